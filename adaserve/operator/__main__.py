"""``python -m adaserve.operator [kopf run options]``: kopf's runner with this operator's defaults.

Adds, unless given: ``--all-namespaces`` (when no ``--namespace``), ``--peering=adaserve``,
``--liveness=http://0.0.0.0:8080/healthz`` and a random ``--priority`` (kopf pauses every operator of
an equal priority, so two replicas with the default 0 would both stand still).
"""

from __future__ import annotations

import random
import sys

from kopf.cli import main as kopf_main


def kopf_args(argv: list[str]) -> list[str]:
    def given(*flags: str) -> bool:
        return any(a == f or a.startswith(f"{f}=") for a in argv for f in flags)

    args = ["run", "-m", "adaserve.operator.handlers"]
    if not given("-n", "--namespace", "-A", "--all-namespaces"):
        args.append("--all-namespaces")
    if not given("-P", "--peering", "--standalone"):
        args.append("--peering=adaserve")
    if not given("-L", "--liveness"):
        args.append("--liveness=http://0.0.0.0:8080/healthz")
    if not given("-p", "--priority", "--standalone"):
        args.append(f"--priority={random.randint(1, 1_000_000)}")
    return args + argv


def main(argv: list[str] | None = None) -> None:
    kopf_main(args=kopf_args(sys.argv[1:] if argv is None else argv), prog_name="python -m adaserve.operator")


if __name__ == "__main__":
    main()
