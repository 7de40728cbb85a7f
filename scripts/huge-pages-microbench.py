"""The engine-only microbench with parts of the process on 2 MiB pages (docs/benchmarks.md, "Twenty-third round": both
tried on a Xeon VM that grants transparent huge pages, neither gained).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 python scripts/huge-pages-microbench.py \\
        [--code LIB[,LIB...]] [--weights] MICROBENCH-OPTIONS...

``--code``: the executable mappings of the libraries whose path contains each LIB (libtorch_cpu, libtorch_python,
_multiarray_umath, libpython3.11) are copied into ``madvise(MADV_HUGEPAGE)`` private memory and mapped back in place
(``mremap``), each over the 2 MiB-aligned window around its code, within the library's read-only mappings. A small
C helper does it (compiled here with ``cc``): code can only be remapped from outside itself. Done after the imports,
before the models load. Do not name libgomp: remapping it crashed the process.
``--weights``: after loading, every parameter, buffer and KV cache of both models is copied into such memory.
Every other option goes to ``python -m adaserve.bench.engine_only`` (the microbench: its JSON on stdout); what was
put on huge pages is said on stderr. Linux only. Python's ``mmap.mmap(-1, n)`` maps shared memory, which follows
``shmem_enabled``, not ``enabled``: the private mappings here are what ``madvise`` applies to.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import adaserve.bench.engine_only as engine_only

HUGE = 2 << 20
MADV_HUGEPAGE = 14

REMAP_C = r"""
#define _GNU_SOURCE
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <stdint.h>
#define HP (2UL << 20)
typedef struct { uintptr_t s, e; char perms[8]; char path[512]; } Map;
static Map maps[8192];
/* y follows x with no gap, both of `of`'s file, neither writable: one run of the library's read-only mappings. */
static int joins(const Map *x, const Map *y, const Map *of) {
    return x->e == y->s && !strcmp(x->path, of->path) && !strcmp(y->path, of->path) && x->perms[1] != 'w'
           && y->perms[1] != 'w';
}
/* Each r-xp mapping of a file whose path contains `needle`: its 2 MiB-aligned window, clipped to the run of the
 * file's non-writable mappings around it, copied into THP memory and mapped r-x over itself. Bytes remapped, or < 0. */
long remap_code(const char *needle) {
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return -1;
    int n = 0; char line[4096];
    while (n < 8192 && fgets(line, sizeof line, f)) {
        Map *m = &maps[n]; m->path[0] = 0;
        if (sscanf(line, "%lx-%lx %7s %*s %*s %*s %511s", &m->s, &m->e, m->perms, m->path) >= 3) n++;
    }
    fclose(f);
    long total = 0;
    for (int i = 0; i < n; i++) {
        if (strcmp(maps[i].perms, "r-xp") || !strstr(maps[i].path, needle)) continue;
        int a = i, b = i;
        while (a > 0 && joins(&maps[a - 1], &maps[a], &maps[i])) a--;
        while (b < n - 1 && joins(&maps[b], &maps[b + 1], &maps[i])) b++;
        uintptr_t lo = maps[i].s & ~(HP - 1), hi = (maps[i].e + HP - 1) & ~(HP - 1);
        if (lo < maps[a].s) lo = (maps[a].s + HP - 1) & ~(HP - 1);
        if (hi > maps[b].e) hi = maps[b].e & ~(HP - 1);
        if (hi <= lo) continue;
        size_t len = hi - lo;
        void *raw = mmap(NULL, len + HP, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (raw == MAP_FAILED) return -2;
        uintptr_t tmp = ((uintptr_t)raw + HP - 1) & ~(HP - 1);
        if (madvise((void *)tmp, len, MADV_HUGEPAGE)) return -3;
        memcpy((void *)tmp, (void *)lo, len);
        if (mprotect((void *)tmp, len, PROT_READ | PROT_EXEC)) return -4;
        if (mremap((void *)tmp, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, (void *)lo) == MAP_FAILED) return -5;
        total += (long)len;
    }
    return total;
}
"""

_kept: list[Any] = []  # the mappings the moved tensors live in, alive for the process


def remap_code(libraries: list[str]) -> dict[str, int]:
    """Bytes remapped per library (0: none of its code spans a whole aligned 2 MiB window)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("huge-pages-microbench: --code needs a C compiler (cc)")
    build = Path(tempfile.mkdtemp(prefix="huge-pages-"))
    (build / "remap.c").write_text(REMAP_C)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", str(build / "remap.c"), "-o", str(build / "remap.so")], check=True)
    lib = ctypes.CDLL(str(build / "remap.so"))
    lib.remap_code.restype, lib.remap_code.argtypes = ctypes.c_long, [ctypes.c_char_p]
    done = {}
    for name in libraries:
        got = lib.remap_code(name.encode())
        if got < 0:
            raise SystemExit(f"huge-pages-microbench: remapping {name}'s code failed at step {-got} "
                             "(1 maps, 2 mmap, 3 madvise: are transparent huge pages enabled?, 4 mprotect, 5 mremap)")
        done[name] = got
    return done


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` (a CPU tensor) in its own 2 MiB-aligned ``madvise(MADV_HUGEPAGE)`` private mapping."""
    nbytes = t.numel() * t.element_size()
    size = max(HUGE, -(-nbytes // HUGE) * HUGE)
    m = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = ctypes.addressof(ctypes.c_char.from_buffer(m))
    at = -(-start // HUGE) * HUGE
    if ctypes.CDLL(None).madvise(ctypes.c_void_p(at), ctypes.c_size_t(size), MADV_HUGEPAGE) != 0:
        raise SystemExit("huge-pages-microbench: madvise(MADV_HUGEPAGE) failed: are transparent huge pages enabled?")
    buf = (ctypes.c_char * max(nbytes, 1)).from_address(at)
    moved = torch.frombuffer(buf, dtype=t.dtype, count=t.numel()).view(t.shape)
    moved.copy_(t)
    _kept.append((m, buf))
    return moved


def move_runner(runner: Any) -> int:
    """Every parameter (a shared one once), buffer and KV cache of ``runner`` onto huge pages; bytes moved."""
    moved: dict[int, torch.Tensor] = {}
    total = 0
    with torch.no_grad():
        for module in runner.model.modules():
            for p in module._parameters.values():
                if p is not None:
                    if p.data_ptr() not in moved:
                        moved[p.data_ptr()] = on_huge_pages(p.data)
                        total += p.numel() * p.element_size()
                    p.data = moved[p.data_ptr()]
            for name, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[name] = on_huge_pages(b)
                    total += b.numel() * b.element_size()
        for side in ("k", "v"):
            t = getattr(runner.cache, side)
            setattr(runner.cache, side, on_huge_pages(t))
            total += t.numel() * t.element_size()
    return total


def anon_huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 add_help=False)
    ap.add_argument("--code", default="", help="libraries (path substrings, comma-separated) whose code to remap")
    ap.add_argument("--weights", action="store_true", help="the models' weights and KV caches on huge pages")
    ours, rest = ap.parse_known_args()
    if not sys.platform.startswith("linux"):
        raise SystemExit("huge-pages-microbench: Linux only")
    if ours.code:
        done = remap_code([x for x in ours.code.split(",") if x])
        print("huge pages, code: " + ", ".join(f"{k} {v >> 20} MiB" for k, v in done.items()), file=sys.stderr)
    if ours.weights:
        load = engine_only.load_pair

        def load_on_huge_pages(*args: Any, **kwargs: Any) -> Any:
            target, draft, tok = load(*args, **kwargs)
            mib = (move_runner(target) + move_runner(draft)) >> 20
            print(f"huge pages, weights and KV caches: {mib} MiB moved; AnonHugePages {anon_huge_kib()} kB",
                  file=sys.stderr)
            return target, draft, tok

        engine_only.load_pair = load_on_huge_pages  # the microbench loads through this module's name
    return engine_only.main(rest)


if __name__ == "__main__":
    sys.exit(main())
