"""The flags of `radixserve serve-ray` besides the server flags (light: the CLI parser imports this without Ray)."""

from __future__ import annotations

import argparse

ROUTER_NAMES = ("affinity", "pow2")  # router.py's ROUTERS


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `radixserve serve-ray` besides the server flags."""
    parser.add_argument("--address", default="auto",
                        help="the Ray cluster to join (default: auto, the one `ray start` started on this node)")
    parser.add_argument("--num-replicas", type=int, default=1, help="engine replicas (default: 1)")
    parser.add_argument("--min-replicas", type=int, default=None,
                        help="autoscale between --min-replicas and --max-replicas instead of --num-replicas")
    parser.add_argument("--max-replicas", type=int, default=None)
    parser.add_argument("--request-router", choices=ROUTER_NAMES, default="affinity",
                        help="affinity: radixserve's cache-aware routing (default); pow2: Ray's default")
    parser.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs reserved per replica (default: 1)")
    parser.add_argument("--replica-gpus", type=float, default=None,
                        help="GPUs reserved per replica (default: tp-size x dp-size on CUDA, 0 on the CPU)")
