"""The Ray Serve application: an HTTP ingress (radixserve's own FastAPI app) in front of N EngineReplica replicas.

    from radixserve.ray import build_app
    serve.run(build_app({"model_path": "...", "tp_size": 2}, num_replicas=4), route_prefix="/")

`radixserve serve-ray` runs this against a running cluster; `serve deploy` config files name `app_builder`.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, Optional

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from radixserve.runtime.http.server import create_app
from radixserve.runtime.ray_serve.proxy import EngineProxy
from radixserve.runtime.ray_serve.replica import EngineReplica
from radixserve.runtime.ray_serve.router import ROUTERS
from radixserve.runtime.tenancy import TenantResolver
from radixserve.runtime.wire.server_args import ServerArgs, make_server_args

logger = logging.getLogger(__name__)

APP_NAME = "radixserve"


@serve.ingress()
class RadixServeIngress:
    """radixserve's HTTP surface (same routes, tenants file and error envelope as `radixserve serve`) over the
    replicas behind `replicas`."""

    async def __init__(self, replicas: Any, engine_args: dict[str, Any], max_replicas: int) -> None:
        self._server_args = make_server_args(**engine_args)
        description = await replicas.describe.remote()  # waits until a replica's engine is up
        self._proxy = EngineProxy(replicas, description, self._server_args, max_replicas)

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(self._proxy, self._server_args)


def build_app(engine_args: Optional[dict[str, Any]] = None, *, num_replicas: int = 1,
              autoscaling_config: Optional[dict[str, Any]] = None, router: str = "affinity",
              router_kwargs: Optional[dict[str, Any]] = None, num_cpus: float = 1.0,
              num_gpus: Optional[float] = None, max_ongoing_requests: int = 256,
              health_check_period_s: float = 10.0) -> Any:
    """A Ray Serve application serving `engine_args` (ServerArgs fields, as `Engine(**engine_args)` takes them).

    Replicas: `num_replicas` of them, or `autoscaling_config` (Ray Serve's: min_replicas, max_replicas, ...).
    Each reserves `num_cpus` CPUs and `num_gpus` GPUs on one node (default: tp_size x dp_size GPUs when the
    replicas run on CUDA, none on the CPU). `router`: "affinity" (radixserve's cache-aware policy; `router_kwargs`
    cache_threshold, balance_abs_threshold, balance_rel_threshold, max_tree_tokens) or "pow2" (Ray's default).
    Raises ValueError for bad arguments, before anything is deployed.
    """
    engine_args = dict(engine_args or {})
    server_args = make_server_args(**engine_args)  # unknown or invalid arguments fail here
    TenantResolver.from_server_args(server_args.api_key, server_args.tenants_file, server_args.admin_api_key)
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {sorted(ROUTERS)}, got {router!r}")
    if autoscaling_config is None and num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
    max_replicas = int(autoscaling_config.get("max_replicas", 1)) if autoscaling_config else num_replicas
    gpus = _gpus_per_replica(server_args) if num_gpus is None else num_gpus
    replica = serve.deployment(
        EngineReplica,
        name="EngineReplica",
        num_replicas="auto" if autoscaling_config else num_replicas,
        autoscaling_config=autoscaling_config,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": gpus},
        max_ongoing_requests=max_ongoing_requests,
        health_check_period_s=health_check_period_s,
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[router],
                                                  request_router_kwargs=dict(router_kwargs or {})),
    )
    ingress = serve.deployment(RadixServeIngress, name="Ingress", num_replicas=1,
                               ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=server_args.resolved_max_queued_requests() + 1024)
    return ingress.bind(replica.bind(engine_args), engine_args, max_replicas)


def app_builder(args: dict[str, Any]) -> Any:
    """For `serve deploy` / `serve run` config files: `import_path: radixserve.ray:app_builder`, `args:` being
    build_app's keyword arguments (engine_args a mapping of ServerArgs fields)."""
    return build_app(**args)


def _gpus_per_replica(server_args: ServerArgs) -> float:
    if server_args.device == "cpu":
        return 0
    per_replica = server_args.tp_size * server_args.dp_size
    if server_args.device == "auto":  # the replicas' nodes decide: GPUs when the cluster has any
        return per_replica if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0 else 0
    return per_replica


# ---- `radixserve serve-ray` (its flags: cli.py) ---------------------------------------------------------
def run_cli(args: argparse.Namespace, server_args: ServerArgs) -> int:
    """Deploy onto the cluster at --address and serve on --host/--port until interrupted."""
    autoscaling = None
    if args.min_replicas is not None or args.max_replicas is not None:
        if args.min_replicas is None or args.max_replicas is None:
            raise ValueError("give both --min-replicas and --max-replicas")
        autoscaling = {"min_replicas": args.min_replicas, "max_replicas": args.max_replicas}
    ray.init(address=args.address)
    app = build_app(server_args.to_dict(), num_replicas=args.num_replicas, autoscaling_config=autoscaling,
                    router=args.request_router, num_cpus=args.replica_cpus, num_gpus=args.replica_gpus)
    serve.start(http_options={"host": server_args.host, "port": server_args.port})
    logger.info("serving on http://%s:%d", server_args.host, server_args.port)
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=True)
    return 0
