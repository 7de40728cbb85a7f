"""``trim_heap`` gives freed memory back to the system on either allocator the worker runs on (adaserve/allocator.py).
TCMalloc (the real library, where installed) keeps every freed page resident until asked: the case that fails
without ``MallocExtension_ReleaseFreeMemory``. glibc hands 400 KB blocks back as they are freed, so its case checks
only that trimming runs there and the memory is gone; on a machine without TCMalloc both cases are glibc's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from adaserve import allocator

_PROBE = """
import json, os
import numpy as np
from adaserve import allocator
from adaserve.engine.loading.loader import trim_heap

def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20

pieces = [np.ones(50_000) for _ in range(1000)]  # 400 MB in 400 KB pieces, as loading frees its tables
held = rss_mb()
del pieces
freed = rss_mb()
trim_heap()
print(json.dumps({"allocator": allocator.in_use(), "held": held, "freed": freed, "trimmed": rss_mb()}))
"""


def _run(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout)


@pytest.mark.parametrize("preload", ["system", "tcmalloc"])
def test_freed_memory_leaves_the_process_after_trim_heap(preload: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    path = allocator.find_tcmalloc()
    if preload == "tcmalloc" and path is not None:
        env["LD_PRELOAD"] = path
    got = _run(env)
    assert got["allocator"] == ("tcmalloc" if preload == "tcmalloc" and path is not None else "system")
    assert got["held"] - got["trimmed"] > 300, got  # the 400 MB are gone from the resident set
    if got["allocator"] == "tcmalloc":  # TCMalloc kept them until asked
        assert got["held"] - got["freed"] < 100, got
