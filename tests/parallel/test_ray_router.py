"""The Ray Serve request routers' choices, without a cluster: Ray's RequestRouter machinery runs for real, over
stand-in replicas that answer queue-length probes (as Ray's own router tests do). Also build_app's argument
checks and the `serve-ray` command line."""

from __future__ import annotations

import asyncio
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest, ReplicaID  # noqa: E402

from radixserve.runtime.ray_serve.router import AffinityRequestRouter, PowerOfTwoRouter  # noqa: E402
from radixserve.runtime.ray_serve.routing import (  # noqa: E402
    ROUTE_KWARG, PrefixRoute, ReplicaGoneError, ReplicaTarget, lookup,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOYMENT = DeploymentID(name="EngineReplica", app_name="router-test")
GROUP_A = tuple(range(100, 200))
GROUP_B = tuple(range(300, 400))


class StandInReplica:
    """What the router reads of a RunningReplica: its id, capacity, placement, and its queue length."""

    def __init__(self, unique_id: str, queue_len: int = 0) -> None:
        self.replica_id = ReplicaID(unique_id=unique_id, deployment_id=DEPLOYMENT)
        self.max_ongoing_requests = 8
        self.queue_len = queue_len
        self.node_id = "node"
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


def make_router(cls=AffinityRequestRouter, names=("a", "b"), **state):
    router = cls(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN,
                 use_replica_queue_len_cache=True)
    router.initialize_state(**state)
    replicas = {name: StandInReplica(name) for name in names}
    router.update_replicas(list(replicas.values()))
    return router, replicas


def pending(route) -> PendingRequest:
    return PendingRequest(args=[], kwargs={ROUTE_KWARG: route},
                          metadata=RequestMetadata(request_id="r", internal_request_id="r"))


def prefix(key, namespace=()) -> PrefixRoute:
    return PrefixRoute(namespace, tuple(key), len(key) + 16)


async def choose(router, route) -> list[list[str]]:
    ranked = await router.choose_replicas(list(router.curr_replicas.values()), pending(route))
    return [[replica.replica_id.unique_id for replica in group] for group in ranked]


def test_affinity_keeps_each_prefix_on_its_replica_and_spreads_new_ones():
    async def run():
        router, _ = make_router()
        [[first]] = await choose(router, prefix(GROUP_A + (1,)))
        [[second]] = await choose(router, prefix(GROUP_B + (1,)))
        assert first != second  # a new prefix goes to the replica caching the least
        for tail in range(2, 6):
            assert await choose(router, prefix(GROUP_A + (tail,))) == [[first]]
            assert await choose(router, prefix(GROUP_B + (tail,))) == [[second]]
        # Another namespace shares nothing with the default one: its copy of group A spreads like a new prefix.
        router.balancer.tree.insert(("tenant:x",), GROUP_B, 0)  # make `first` (index 0) the busier cache
        assert await choose(router, prefix(GROUP_A, ("tenant:y",))) == [[second]]
    asyncio.run(run())


def test_affinity_balances_load_and_spills_over_a_full_replica():
    async def run():
        router, _ = make_router(balance_abs_threshold=4)
        [[home]] = await choose(router, prefix(GROUP_A + (1,)))
        other = ({"a", "b"} - {home}).pop()
        home_id = next(replica_id for replica_id in router.curr_replicas if replica_id.unique_id == home)
        for _ in range(6):  # six requests in flight on the prefix's replica, none on the other
            router.on_send_request(home_id)
        assert await choose(router, prefix(GROUP_A + (2,))) == [[other]]
        for _ in range(6):
            router.on_request_completed(home_id, "done")
        assert await choose(router, prefix(GROUP_A + (3,))) == [[home]]
        router.on_new_queue_len_info(home_id, 8)  # Ray saw its queue full: the request spills to the other one
        assert await choose(router, prefix(GROUP_A + (4,))) == [[other]]
    asyncio.run(run())


def test_a_dead_or_flushed_replica_loses_its_prefixes_and_new_replicas_get_new_indices():
    async def run():
        router, replicas = make_router()
        [[home]] = await choose(router, prefix(GROUP_A + (1,)))
        assert router.balancer.tree.match((), GROUP_A)
        router.flushed(home)
        assert router.balancer.tree.match((), GROUP_A) == {}
        [[home]] = await choose(router, prefix(GROUP_A + (1,)))
        router.on_replica_actor_died(replicas[home].replica_id)
        assert router.replica_ids() == [({"a", "b"} - {home}).pop()]
        assert router.balancer.tree.match((), GROUP_A) == {}
        survivor = router.replica_ids()[0]
        router.update_replicas([replicas[survivor], StandInReplica("c")])
        assert router.replica_ids() == [survivor, "c"]
        assert await choose(router, prefix(GROUP_A)) == [[survivor]]  # neither caches anything: the first seen
        assert await choose(router, prefix(GROUP_B)) == [["c"]]  # the survivor caches more now
        assert set(router.balancer.tree.match((), GROUP_B)) == {2}  # "c" has a fresh index: it inherited nothing
        assert lookup(DEPLOYMENT.app_name, DEPLOYMENT.name) is router
    asyncio.run(run())


@pytest.mark.parametrize("cls", [AffinityRequestRouter, PowerOfTwoRouter])
def test_control_requests_reach_their_replica_or_fail_at_once(cls):
    async def run():
        router, _ = make_router(cls, names=("a", "b", "c"))
        for name in ("a", "b", "c"):
            assert await choose(router, ReplicaTarget(name)) == [[name]]
        request = pending(ReplicaTarget("gone"))
        assert await router.choose_replicas(list(router.curr_replicas.values()), request) == []
        with pytest.raises(ReplicaGoneError):
            request.future.result()
        ranked = await choose(router, None)  # an ordinary request: any replica may take it
        assert ranked and set(ranked[0]) <= {"a", "b", "c"}
    asyncio.run(run())


def test_build_app_refuses_bad_arguments_before_deploying():
    from radixserve.ray import build_app

    with pytest.raises(ValueError, match="router"):
        build_app({}, router="random")
    with pytest.raises(ValueError, match="unknown server argument"):
        build_app({"no_such_flag": 1})
    with pytest.raises(ValueError, match="num_replicas"):
        build_app({}, num_replicas=0)


def test_serve_ray_command_line():
    help_text = subprocess.run([sys.executable, "-m", "radixserve", "serve-ray", "--help"], capture_output=True,
                               text=True, timeout=120).stdout
    for flag in ("--num-replicas", "--address", "--request-router", "--min-replicas", "--replica-gpus",
                 "--tenants-file"):
        assert flag in help_text
    bad = subprocess.run([sys.executable, "-m", "radixserve", "serve-ray", "--request-router", "random"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--request-router" in bad.stderr


def test_the_example_serve_config_builds_the_application():
    import yaml
    from ray.serve import Application
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.schema import ServeDeploySchema

    from radixserve.ray import app_builder

    with open(ROOT / "examples" / "ray_serve.yaml", encoding="utf-8") as f:
        config = ServeDeploySchema.model_validate(yaml.safe_load(f))
    [app] = config.applications
    assert app.import_path == "radixserve.ray:app_builder"
    built = call_user_app_builder_with_args_if_necessary(app_builder, app.args)
    assert isinstance(built, Application)


@pytest.mark.parametrize("cls", [AffinityRequestRouter, PowerOfTwoRouter])
def test_a_replica_whose_engine_is_down_is_passed_over_until_ray_replaces_it(cls):
    async def run():
        router, replicas = make_router(cls)
        router.exclude("a")
        for tail in range(8):
            ranked = await choose(router, prefix(GROUP_A + (tail,)))
            assert ranked and all(group == ["b"] for group in ranked if group)
        router.exclude("b")  # every replica down: requests still go somewhere (they wait for Ray's restart)
        assert any(await choose(router, prefix(GROUP_A)))
        router.update_replicas([replicas["b"], StandInReplica("c")])  # Ray replaced "a"; "b" is still down
        for tail in range(8):
            ranked = await choose(router, prefix(GROUP_B + (tail,)))
            assert ranked and all(group == ["c"] for group in ranked if group)
    asyncio.run(run())


@pytest.mark.parametrize("salt, lora", [(None, None), ("s1", None), (None, "adapter-a"), ("s1", "adapter-a")])
def test_the_routing_key_is_the_cache_namespace(salt, lora):
    """The Ray ingress routes a request by the namespace the scheduler caches it under, adapter included."""
    from types import SimpleNamespace

    from radixserve.runtime.ray_serve.proxy import EngineProxy
    from radixserve.tokenizer_manager.io import GenerateReqInput, split_requests

    async def encode(text):
        return [len(text), 7, 8]

    obj = GenerateReqInput(text="hello there", sampling_params={"max_new_tokens": 4}, cache_salt=salt, lora_path=lora,
                           tenant="acme")
    route = asyncio.run(EngineProxy._route(SimpleNamespace(async_encode=encode), obj))
    assert route.namespace == split_requests(obj)[0].namespace("acme")
    assert route.namespace[0] == "tenant:acme" and (lora is None) == (not any("lora" in p for p in route.namespace))
    assert route.key == (11, 7, 8) and route.tokens == 3 + 4
