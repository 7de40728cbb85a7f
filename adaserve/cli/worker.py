"""``adaserve worker``: load the models, profile (or reuse the profile), warm up, serve over HTTP.

Every option can also come from an ``ADASERVE_*`` environment variable (docs/worker.md); options given
on the command line win.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from adaserve.cli.arg_types import add_kv_memory_options, add_weights_option
from adaserve.cli_error import CliError

# command-line option -> settings field; everything else comes from the environment
OPTIONS = ("target", "draft", "model_name", "device", "host", "port", "redis_url", "policy", "budget", "attention",
           "kv_memory_mb", "kv_memory_fraction", "dtype", "weights", "max_depth", "max_width", "worker_id",
           "advertise_url", "max_active_requests", "drain_grace_s", "log_level", "tensor_parallel_size",
           "enable_prefix_caching", "static_shapes")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("worker", help="serve the engine over HTTP (a GPU pod's process)")
    p.add_argument("--target", help="target model: smollm2-135m-instruct (default, brings its draft), demo-tiny, "
                   "a .gguf file or a Hugging Face directory [ADASERVE_TARGET]")
    p.add_argument("--draft", action="append",
                   help="draft model, same forms (or smollm2-draft, smollm2-draft-small) [ADASERVE_DRAFT]; repeat it "
                        "for several drafts, each request's chosen per slot by the policy's selector (spin, "
                        "POLICY@ucb|eps|length|dN) [ADASERVE_DRAFTS, a JSON list]")
    p.add_argument("--model-name", help="name clients pass as 'model' [ADASERVE_MODEL_NAME, default: the model's]")
    p.add_argument("--device", choices=["cpu", "cuda"], help="[ADASERVE_DEVICE, default cpu]")
    p.add_argument("--tensor-parallel-size", type=int, metavar="N", help="shard the target over N ranks, one "
                   "process per device (CUDA: NCCL; CPU: gloo) [ADASERVE_TENSOR_PARALLEL_SIZE, default 1]")
    p.add_argument("--host", help="bind address [ADASERVE_HOST, default 127.0.0.1]")
    p.add_argument("--port", type=int, help="[ADASERVE_PORT, default 8000]")
    p.add_argument("--redis-url", help="register in this Redis [ADASERVE_REDIS_URL]; unset: local mode")
    p.add_argument("--policy", help="decoding policy [ADASERVE_POLICY, default adaserve]")
    p.add_argument("--budget", type=int, help="fixed token budget, skips profiling [ADASERVE_BUDGET]")
    p.add_argument("--attention", choices=["auto", "torch", "flashinfer"], help="[ADASERVE_ATTENTION]")
    add_kv_memory_options(p, env=True)
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], help="[ADASERVE_DTYPE]")
    add_weights_option(p, env="ADASERVE_WEIGHTS", default=None)  # None: the settings' own
    p.add_argument("--max-depth", type=int, help="deepest draft tree [ADASERVE_MAX_DEPTH, default 4]")
    p.add_argument("--max-width", type=int, help="widest beam [ADASERVE_MAX_WIDTH, default 2]")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV of cached prompt prefixes instead of prefilling them again "
                        "[ADASERVE_ENABLE_PREFIX_CACHING, default on]")
    p.add_argument("--reprofile", action="store_true", default=None, help="ignore the cached profile")
    p.add_argument("--worker-id", help="id in the registry [ADASERVE_WORKER_ID, default hostname-port]")
    p.add_argument("--advertise-url", help="address the gateway should use [ADASERVE_ADVERTISE_URL]")
    p.add_argument("--max-active-requests", type=int, help="queued + running before 503 [ADASERVE_MAX_ACTIVE_REQUESTS]")
    p.add_argument("--drain-grace-s", type=float, help="SIGTERM grace for in-flight requests [ADASERVE_DRAIN_GRACE_S]")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--static-shapes", action=argparse.BooleanOptionalAction, default=None,
                   help="static-shape forwards, CUDA graphs on a GPU [ADASERVE_STATIC_SHAPES, default: on for CUDA "
                        "with one rank, off on CPU]")
    p.set_defaults(func=run)


def load_settings(args: argparse.Namespace) -> Any:
    from adaserve.cli_settings import load
    from adaserve.worker.settings import WorkerSettings

    given = {name: getattr(args, name) for name in (*OPTIONS, "reprofile") if getattr(args, name, None) is not None}
    given.update(draft_options(args.draft))
    return load(WorkerSettings, given, options=OPTIONS, env_prefix="ADASERVE_")


def draft_options(drafts: list[str] | None) -> dict[str, Any]:
    """Repeated ``--draft`` as settings: one is ``draft``, several are ``drafts``; either replaces both
    environment variables (the command line wins), none leaves them."""
    if not drafts:
        return {}
    return {"draft": drafts[0], "drafts": []} if len(drafts) == 1 else {"draft": None, "drafts": drafts}


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from adaserve.worker.app import create_app
    from adaserve.worker.runtime import Runtime, State
    from adaserve.worker.server import DrainingServer

    settings = load_settings(args)
    logging.getLogger("adaserve").setLevel(logging.DEBUG if args.verbose else settings.log_level.upper())
    runtime = Runtime(settings)
    config = uvicorn.Config(create_app(runtime), host=settings.host, port=settings.port,
                            log_level=settings.log_level, timeout_graceful_shutdown=10, lifespan="on")
    DrainingServer(config, runtime).run()
    if runtime.state is State.FAILED:
        raise CliError(runtime.failure or "worker failed")
    return 0
