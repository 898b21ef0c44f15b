"""radixserve on Ray Serve: replicas placed and restarted by Ray, requests routed by prefix affinity.

    from ray import serve
    from radixserve.ray import build_app
    serve.run(build_app({"model_path": "/models/llama-3.1-8b", "tp_size": 2}, num_replicas=4), route_prefix="/")

Needs the `ray` extra (`pip install radixserve[ray]`). See docs/parallelism.md, "Ray Serve".
"""

from radixserve.runtime.ray_serve.app import app_builder, build_app
from radixserve.runtime.ray_serve.replica import EngineReplica
from radixserve.runtime.ray_serve.router import AffinityRequestRouter, PowerOfTwoRouter

__all__ = ["AffinityRequestRouter", "EngineReplica", "PowerOfTwoRouter", "app_builder", "build_app"]
