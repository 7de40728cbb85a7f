"""Starting a tensor-parallel target: this process is rank 0, ranks 1..N-1 are child processes.

Each child joins the group, loads its own shard (``load_model(tp=...)``, its slices only) and serves rank 0's
forwards (``parallel.serve``) until rank 0 stops it. A child whose parent has gone exits by itself, so
no rank outlives the worker; a child that dies makes rank 0's next collective fail, which ends its engine.
On CUDA, rank r uses device r (one process per device).

May import: torch, engine.model, engine.loading.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from adaserve.engine.loading.catalog import local_dir
from adaserve.engine.loading.loader import default_dtype, freeze_long_lived, load_model, read_config
from adaserve.engine.model import parallel
from adaserve.engine.model.kv_cache import KVCacheConfig
from adaserve.engine.model.runner import ForwardSettings, ModelRunner

log = logging.getLogger(__name__)
JOIN_S = 10.0  # how long a stopped rank may take to exit before it is terminated


@dataclass(frozen=True)
class Settings:
    """What every rank's runner reads (``ForwardSettings``), with the KV page count pinned to rank 0's."""

    attention: str
    kv: KVCacheConfig
    static_shapes: bool


def _exit_with_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(1)  # orphaned: rank 0 is gone and will never send another command
        time.sleep(1.0)


def _rank_main(rank: int, size: int, port: int, target: str, device: str, dtype: torch.dtype | None,
               weights: str, settings: ForwardSettings, parent: int, threads: int) -> None:
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    torch.set_num_threads(threads)
    tp = parallel.init_rank(rank, size, port=port, device=torch.device(device))
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device(device)
    runner = ModelRunner(load_model(Path(target), device=dev, dtype=dtype, weights=weights, tp=tp), settings)
    freeze_long_lived()  # the rank keeps what it loaded until it exits: no full collection walks it again
    served = parallel.serve(runner, tp)
    log.info("tensor-parallel rank %d stopped after %d forwards", rank, served)
    parallel.leave()


def check_size(ref: str | Path, size: int) -> None:
    """Refuse ``size`` ranks before anything starts: below 1, or more than the model has query heads or MLP
    columns (read from its config.json alone; any smaller size splits, unevenly if need be: parallel.split).
    ``ref`` is a model reference; one that is converted at load (a .gguf file, the default model) is checked by
    ``start_target`` once converted."""
    if size < 1:
        raise ValueError(f"tensor parallel size must be at least 1, got {size}")
    directory = local_dir(str(ref))
    if size > 1 and directory is not None:
        parallel.local_config(read_config(directory), parallel.TensorParallel(0, size))


def start_target(target: Path, size: int, *, device: torch.device, settings: ForwardSettings,
                 dtype: torch.dtype | None = None, weights: str = "auto",
                 progress: bool = False) -> parallel.TensorParallelRunner:
    """Rank 0's runner of ``target`` sharded over ``size`` ranks, the other ranks started and loaded.

    On a CPU the ranks share the cores: each gets ``torch.get_num_threads() // size`` threads."""
    if size < 2:
        raise ValueError("a tensor-parallel target needs at least 2 ranks")
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"tensor parallel size {size} needs {size} CUDA devices; {torch.cuda.device_count()} visible")
    cfg = read_config(target)
    parallel.local_config(cfg, parallel.TensorParallel(0, size))  # refuse before starting
    # every rank the same page count, rank 0's (an uneven split gives the ranks different KV heads)
    settings = Settings(settings.attention, parallel.pages_for(settings.kv, cfg, size, dtype or default_dtype(device)),
                        settings.static_shapes)
    threads = max(1, torch.get_num_threads() // size) if device.type == "cpu" else torch.get_num_threads()
    ctx = mp.get_context("spawn")
    port = parallel.free_port()
    procs = [ctx.Process(target=_rank_main, name=f"adaserve-tp-rank{r}", daemon=True,
                         args=(r, size, port, str(target), device.type, dtype, weights, settings, os.getpid(),
                               threads))
             for r in range(1, size)]
    for p in procs:
        p.start()
    try:
        tp = parallel.init_rank(0, size, port=port, device=device)
        if device.type == "cpu":
            torch.set_num_threads(threads)
        runner = parallel.TensorParallelRunner(
            load_model(target, device=device, dtype=dtype, weights=weights, progress=progress, tp=tp), settings, tp)
    except BaseException:
        for p in procs:
            p.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise

    def join() -> None:
        for p in procs:
            p.join(JOIN_S)
            if p.is_alive():
                p.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()  # this process may start another tensor-parallel target

    runner.after_close.append(join)
    atexit.register(_close_quietly, runner)
    return runner


def _close_quietly(runner: parallel.TensorParallelRunner) -> None:
    try:
        runner.close()
    except Exception as e:  # a rank already gone: nothing to tell it
        log.warning("stopping the tensor-parallel ranks: %s", e)
