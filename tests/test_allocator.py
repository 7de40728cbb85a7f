"""The allocator choice (adaserve/allocator.py): which environment an engine command re-executes with, and that the
re-executed process runs on TCMalloc where it is installed (the real library, Debian's libtcmalloc-minimal4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adaserve import allocator
from adaserve.allocator import LIBRARY, REPORT_ENV, AllocatorError, preload_env, subcommand


@pytest.fixture
def libdir(tmp_path: Path) -> list[str]:
    """A directory holding a file by TCMalloc's name: what ``preload_env`` looks for (it is never loaded)."""
    (tmp_path / LIBRARY).write_bytes(b"")
    return [str(tmp_path / "missing"), str(tmp_path)]


def test_auto_preloads_the_library_it_finds_ahead_of_what_is_preloaded_already(libdir: list[str]) -> None:
    env = preload_env({"LD_PRELOAD": "/opt/other.so", "PATH": "/bin"}, dirs=libdir)
    assert env is not None
    assert env["LD_PRELOAD"] == f"{libdir[1]}/{LIBRARY}:/opt/other.so"
    assert env["PATH"] == "/bin" and env[REPORT_ENV] == allocator.REPORT_BYTES
    # the user's own report threshold stands
    env = preload_env({REPORT_ENV: "1000", allocator.ENV: "tcmalloc"}, dirs=libdir)
    assert env is not None and env[REPORT_ENV] == "1000" and env["LD_PRELOAD"] == f"{libdir[1]}/{LIBRARY}"


@pytest.mark.parametrize("env", [
    {allocator.ENV: "system"},
    {"LD_PRELOAD": f"/usr/lib/{LIBRARY}"},  # the re-executed process itself: no loop
    {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},  # the user chose an allocator
    {allocator.ENV: "tcmalloc", "LD_PRELOAD": "/usr/local/lib/libtcmalloc.so.4"},
])
def test_nothing_is_re_executed_where_the_allocator_is_chosen_already(env: dict[str, str],
                                                                       libdir: list[str]) -> None:
    assert preload_env(env, dirs=libdir) is None


def test_a_missing_library_is_silent_under_auto_and_an_error_when_required(tmp_path: Path) -> None:
    assert preload_env({}, dirs=[str(tmp_path)]) is None
    with pytest.raises(AllocatorError, match="apt-get install libtcmalloc-minimal4"):
        preload_env({allocator.ENV: "tcmalloc"}, dirs=[str(tmp_path)])
    with pytest.raises(AllocatorError, match="choose one of auto, tcmalloc, system"):
        preload_env({allocator.ENV: "jemalloc"}, dirs=[str(tmp_path)])


def test_the_subcommand_is_the_first_argument_that_is_not_an_option() -> None:
    assert subcommand(["-v", "worker", "--port", "1"]) == "worker"
    assert subcommand(["--version"]) is None


def test_the_mapped_allocator_is_read_from_the_process_maps(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(f"7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/{LIBRARY}.5.10\n")
    assert allocator.in_use(str(maps)) == "tcmalloc"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert allocator.in_use(str(maps)) == "system"
    assert allocator.in_use(str(tmp_path / "absent")) == "system"


_PROBE = """
import json, os, sys
from adaserve import allocator
allocator.reexec_if_wanted(sys.argv[1:])
print(json.dumps({"allocator": allocator.in_use(), "argv": sys.argv[1:], "pid": os.getpid()}))
"""


def _probe(tmp_path: Path, env: dict[str, str], *args: str) -> dict:
    """Run the probe; its report, checked to come from the process started (re-executed in place, not a child)."""
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    proc = subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    got = json.loads(out)
    assert got["pid"] == proc.pid
    return got


def test_an_engine_command_runs_on_tcmalloc_where_it_is_installed(tmp_path: Path) -> None:
    """The real re-execution: the same arguments, the same process, the library mapped (or, on a machine without
    it, the system's allocator and no error)."""
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.ENV)}
    got = _probe(tmp_path, base, "microbench", "--batches", "1")
    assert got["argv"] == ["microbench", "--batches", "1"]
    assert got["allocator"] == ("tcmalloc" if allocator.find_tcmalloc() else "system")
    # opted out, or not an engine command: glibc's malloc
    assert _probe(tmp_path, {**base, allocator.ENV: "system"}, "worker")["allocator"] == "system"
    assert _probe(tmp_path, base, "gateway")["allocator"] == "system"


def test_a_bad_setting_stops_the_command_with_one_line_and_exit_2() -> None:
    env = {**os.environ, allocator.ENV: "bogus"}
    out = subprocess.run([sys.executable, "-m", "adaserve", "worker"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == "adaserve: error: ADASERVE_ALLOCATOR='bogus': choose one of auto, tcmalloc, system"


@pytest.mark.parametrize("setting", ["auto", "tcmalloc"])
def test_a_failed_re_execution_goes_on_under_auto_and_stops_when_required(
        setting: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(allocator.ENV, setting)
    monkeypatch.setattr(allocator, "preload_env", lambda env: {"LD_PRELOAD": f"/usr/lib/{LIBRARY}"})

    def refused(*_: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "execve", refused)
    if setting == "tcmalloc":
        with pytest.raises(AllocatorError, match=r"re-executing with it failed: .*Permission denied"):
            allocator.reexec_if_wanted(["worker"])
    else:
        allocator.reexec_if_wanted(["worker"])  # returns: this process goes on
        assert "could not re-execute with TCMalloc" in capsys.readouterr().err
