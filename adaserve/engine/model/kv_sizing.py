"""Sizing the KV cache from the device's memory, as vLLM's ``gpu_memory_utilization`` (issue 30, item 3).

With ``--kv-memory-fraction f`` the caches get what is left of ``f`` of the device once the models are
loaded (and, on CUDA, once a profiling forward has shown the activations' peak):

    CUDA   budget = f * total - (total - free) - activation peak - graph reserve
           (total - free: everything the device holds already, this process's weights and any other's;
           graph reserve: with CUDA graphs, each model's graphs keep a memory pool of their own beside the
           eager forwards'; set aside as that model's peak once more, a guess, not a measurement: the pool also
           holds every captured bucket's logits, and each draft search shape captures into a pool of its own.
           A capture that finds too little left runs its shape eagerly instead: static.StaticForward.try_capture)
    CPU    budget = min(f * available RAM, CPU_CAP_BYTES)
           (RAM is shared with the host's own work; a fraction of it, capped, instead of all of it)

Every model of the engine (the target and its drafts) holds the same sequences, so the budget buys one
token capacity for all of them: ``pages = budget / (page_size * sum of each model's bytes per token)``.
The pure functions take the numbers; ``device_memory`` reads them.

May import: torch only.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

CPU_CAP_BYTES = 16 * 2**30  # the most a fraction of RAM sizes the CPU caches to, together


class KVSizingError(ValueError):
    """The fraction leaves no room for a KV cache; the message is meant for the user."""


def kv_budget_bytes(fraction: float, *, device_type: str, total: int, free: int, activation_peak: int = 0,
                    graph_reserve: int = 0, cpu_cap: int = CPU_CAP_BYTES) -> int:
    """Bytes the KV caches may take (see the module docstring); ``free`` is available RAM on a CPU."""
    if not 0 < fraction <= 1:
        raise KVSizingError(f"the KV memory fraction must be in (0, 1], got {fraction}")
    if device_type == "cuda":
        budget = int(fraction * total) - (total - free) - activation_peak - graph_reserve
        if budget <= 0:
            graphs = f" and its CUDA graphs {graph_reserve / 2**30:.2f} GiB" if graph_reserve else ""
            raise KVSizingError(
                f"--kv-memory-fraction {fraction} leaves no room for the KV cache: the device holds "
                f"{(total - free) / 2**30:.2f} of {total / 2**30:.2f} GiB already and a forward needs "
                f"{activation_peak / 2**30:.2f} GiB more{graphs}; raise the fraction or use --kv-memory-mb")
        return budget
    return min(int(fraction * free), cpu_cap)


def pages_for_budget(budget_bytes: int, bytes_per_token: Sequence[int], page_size: int) -> int:
    """Pages per model so that every model's cache holds the same tokens and together they fit the budget."""
    per_page = page_size * sum(bytes_per_token)
    pages = budget_bytes // per_page
    if pages < 1:
        raise KVSizingError(f"a KV budget of {budget_bytes / 2**20:.1f} MiB holds no page "
                            f"({per_page / 2**20:.2f} MiB per page of {page_size} tokens across the models)")
    return int(pages)


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes: the CUDA device's, or on a CPU the available and total RAM."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    return _ram()


def _ram() -> tuple[int, int]:
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                fields[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    page = os.sysconf("SC_PAGE_SIZE")
    total = fields.get("MemTotal") or os.sysconf("SC_PHYS_PAGES") * page
    available = fields.get("MemAvailable") or os.sysconf("SC_AVPHYS_PAGES") * page
    return int(available), int(total)
