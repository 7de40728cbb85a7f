"""The process's memory allocator: TCMalloc, preloaded where it is installed, for the commands that run the engine.

Why (issue 30): an iteration's host time between the forwards is many small allocations (numpy's and torch's
arrays, Python's objects), and glibc's malloc serves them slower than TCMalloc: with Debian's
``libtcmalloc-minimal4`` preloaded, an iteration's host time fell 5-10% with speculation and 15-17% without, in
paired runs on two machines, and at 32 requests the forwards' large temporaries took a third off a speculative
iteration in all (docs/benchmarks.md, "Fifteenth round" and "Sixteenth round"). vLLM's CPU backend gives the same
advice, and the CPU worker image preloads it (docker/worker.Dockerfile).

An allocator has to be in place before the interpreter's first allocation, so it cannot be switched from inside the
process: ``adaserve worker`` and ``adaserve microbench`` re-execute themselves once, the same command line, with
TCMalloc in ``LD_PRELOAD`` (``reexec_if_wanted``). Only from the command line: ``main(argv)`` called in-process (the
tests) never replaces its process.

``ADASERVE_ALLOCATOR``:
- ``auto`` (default): TCMalloc where found (``SEARCH_DIRS``), else the system's, silently;
- ``tcmalloc``: TCMalloc or an error (exit 2) saying how to install it;
- ``system``: glibc's malloc, nothing preloaded (what every figure before the sixteenth round measured).

A leaf: imports only the standard library.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ENV = "ADASERVE_ALLOCATOR"
CHOICES = ("auto", "tcmalloc", "system")
LIBRARY = "libtcmalloc_minimal.so.4"
# Debian and Ubuntu (amd64, arm64), Fedora and RHEL, and the worker image's arch-independent link
SEARCH_DIRS = ("/usr/local/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")
# TCMalloc reports every allocation above this many bytes on stderr (a KV cache is one): 1 TiB, i.e. never
REPORT_ENV, REPORT_BYTES = "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 40)
CHOSEN = ("tcmalloc", "jemalloc", "mimalloc")  # in LD_PRELOAD: an allocator is chosen already, leave it
COMMANDS = frozenset({"worker", "microbench"})  # the commands that serve or time the engine


class AllocatorError(ValueError):
    """``ADASERVE_ALLOCATOR`` names no allocator, or one that is not installed: a CLI error, exit 2."""


def choice(env: Mapping[str, str]) -> str:
    """The setting of ``ADASERVE_ALLOCATOR`` (``auto`` when unset or empty), checked."""
    value = (env.get(ENV) or "auto").strip().lower()
    if value not in CHOICES:
        raise AllocatorError(f"{ENV}={env.get(ENV)!r}: choose one of {', '.join(CHOICES)}")
    return value


def find_tcmalloc(dirs: Sequence[str] = SEARCH_DIRS) -> str | None:
    """The first ``libtcmalloc_minimal.so.4`` in ``dirs``, or None."""
    for d in dirs:
        path = Path(d) / LIBRARY
        if path.is_file():
            return str(path)
    return None


def preload_env(env: Mapping[str, str], dirs: Sequence[str] = SEARCH_DIRS) -> dict[str, str] | None:
    """The environment to re-execute with so that TCMalloc serves the process, or None to go on as it is: the
    setting is ``system``, ``LD_PRELOAD`` already holds an allocator (this is the re-executed process, the worker
    image, or the user's own choice of one), or TCMalloc is not installed under ``auto``. Raises
    ``AllocatorError`` under ``tcmalloc`` when it is not installed."""
    want = choice(env)
    if want == "system" or any(name in env.get("LD_PRELOAD", "") for name in CHOSEN):
        return None
    path = find_tcmalloc(dirs)
    if path is None:
        if want == "tcmalloc":
            raise AllocatorError(f"{ENV}=tcmalloc, but no {LIBRARY} in {', '.join(dirs)}: install it "
                                 f"(Debian, Ubuntu: apt-get install libtcmalloc-minimal4) or set {ENV}=system")
        return None
    out = dict(env)
    out["LD_PRELOAD"] = ":".join(p for p in (path, env.get("LD_PRELOAD", "")) if p)
    out.setdefault(REPORT_ENV, REPORT_BYTES)
    return out


def in_use(maps: str = "/proc/self/maps") -> str:
    """``tcmalloc`` if this process has TCMalloc mapped, else ``system`` (reported with every timing)."""
    try:
        text = Path(maps).read_text()
    except OSError:
        return "system"
    return "tcmalloc" if "libtcmalloc" in text else "system"


def subcommand(argv: Sequence[str]) -> str | None:
    """The subcommand of an ``adaserve`` command line (its first argument that is not an option)."""
    return next((a for a in argv if not a.startswith("-")), None)


def reexec_if_wanted(argv: Sequence[str]) -> None:
    """Replace this process by the same command with TCMalloc preloaded, for a command in ``COMMANDS`` where
    ``preload_env`` says so; otherwise return. ``argv``: the command's arguments (``sys.argv[1:]``)."""
    if subcommand(argv) not in COMMANDS:
        return
    env = preload_env(os.environ)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:  # the interpreter's own command line (``python -m adaserve ...`` or the console script's), run again
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError as e:  # the process goes on as it is, on the system's allocator, unless TCMalloc was required
        if choice(os.environ) == "tcmalloc":
            raise AllocatorError(f"{ENV}=tcmalloc, but re-executing with it failed: {e}") from None
        print(f"adaserve: warning: could not re-execute with TCMalloc ({e}); running on the system allocator "
              f"(set {ENV}=system to skip the attempt)", file=sys.stderr)
