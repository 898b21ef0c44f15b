"""LoRA adapters in one batch with the base model: greedy tokens equal Hugging Face's with each adapter merged
into the weights; the segmented matmul against a per-token float64 reference; adapter loading errors; slots
when a batch's adapters outnumber them; KV never shared across adapters; unloading frees an adapter's KV.

A real Scheduler and ModelRunner on a tiny random-weight Llama, driven in-process (scheduler_driver.py).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from lora_adapters import make_adapter, merged_greedy
from radixserve.model_runner.lora import LoRAAdapterError, read_adapter
from radixserve.model_runner.lora.layers import LoRABatch, segmented_lora
from radixserve.runtime.wire.lora import LoadLoRAAdapterReq, UnloadLoRAAdapterReq
from scheduler_driver import SchedulerDriver
from test_scheduler import make_prompts


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "every": make_adapter(str(root / "every"), tiny_llama, rank=8, seed=1),
        "attn": make_adapter(str(root / "attn"), tiny_llama, rank=4, alpha=8.0, seed=2,
                             modules=("q_proj", "v_proj", "o_proj")),
        "mlp": make_adapter(str(root / "mlp"), tiny_llama, rank=6, seed=3, modules=("gate_proj", "down_proj"),
                            layers=[1]),
    }


def lora_driver(model_dir: str, adapters: dict[str, str], **args) -> SchedulerDriver:
    paths = [f"{name}={path}" for name, path in adapters.items()]
    return SchedulerDriver(model_dir, lora_paths=paths, **args)


def test_adapters_and_base_in_one_batch_match_merged_hugging_face(tiny_llama, adapters):
    prompts = make_prompts(7, 8, 512, 5, 30)
    names = [None, "every", "attn", "mlp", "every", None, "mlp", "attn"]
    driver = lora_driver(tiny_llama, adapters, max_loras_per_batch=3)
    try:
        for i, (prompt, name) in enumerate(zip(prompts, names)):
            driver.submit(f"r{i}", prompt, lora_name=name, max_new_tokens=8)
        steps_with_all = 0
        while not driver.scheduler.is_idle():
            running = {r.lora_name for r in driver.scheduler.running}
            steps_with_all += running == {None, "every", "attn", "mlp"}
            driver.step()
        outputs = [driver.results[f"r{i}"].output_ids for i in range(len(prompts))]
    finally:
        driver.close()
    assert steps_with_all > 0  # the three adapters and the base model really decoded together
    for name in (None, "every", "attn", "mlp"):
        picked = [i for i, n in enumerate(names) if n == name]
        expected = merged_greedy(tiny_llama, adapters.get(name), [prompts[i] for i in picked], 8)
        assert [outputs[i] for i in picked] == expected, name
    base = merged_greedy(tiny_llama, None, [prompts[1]], 8)[0]
    assert outputs[1] != base  # the adapter changes the output: the comparison above is not vacuous


def test_segmented_lora_equals_a_per_token_float64_reference():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(11, 16, generator=generator)
    a = torch.randn(3, 4, 16, generator=generator)
    b = torch.randn(3, 24, 4, generator=generator)
    slots = [2, 2, -1, 0, 0, 0, -1, 1, 2, 0, -1]
    groups = [(s, torch.tensor([t for t, u in enumerate(slots) if u == s])) for s in (0, 1, 2)]
    delta = segmented_lora(x, a, b, LoRABatch(groups, len(slots)))
    expected = torch.zeros(11, 24, dtype=torch.float64)
    for t, s in enumerate(slots):
        if s >= 0:
            expected[t] = b[s].double() @ (a[s].double() @ x[t].double())
    torch.testing.assert_close(delta.double(), expected, rtol=1e-5, atol=1e-5)
    whole = segmented_lora(x, a, b, LoRABatch([(1, None)], 11))
    torch.testing.assert_close(whole.double(), (x.double() @ a[1].double().T) @ b[1].double().T, rtol=1e-5, atol=1e-5)
    assert segmented_lora(x, a, b, LoRABatch([], 11)) is None


def test_more_adapters_than_slots_run_in_turns(tiny_llama, adapters):
    prompts = make_prompts(9, 6, 512, 4, 12)
    names = ["every", "attn", "mlp", "every", "attn", "mlp"]
    driver = lora_driver(tiny_llama, adapters, max_loras_per_batch=1)
    try:
        for i, (prompt, name) in enumerate(zip(prompts, names)):
            driver.submit(f"r{i}", prompt, lora_name=name, max_new_tokens=4)
        while not driver.scheduler.is_idle():
            assert len({r.lora_name for r in driver.scheduler.running}) <= 1
            driver.step()
        outputs = [driver.results[f"r{i}"].output_ids for i in range(6)]
    finally:
        driver.close()
    for name in ("every", "attn", "mlp"):
        picked = [i for i, n in enumerate(names) if n == name]
        assert [outputs[i] for i in picked] == merged_greedy(tiny_llama, adapters[name],
                                                             [prompts[i] for i in picked], 4)


def test_kv_is_never_shared_across_adapters_and_unloading_frees_it(tiny_llama, adapters):
    prompt = make_prompts(11, 1, 512, 40, 41)[0]
    driver = lora_driver(tiny_llama, adapters)
    try:
        def run(rid: str, name, namespace=()):
            driver.submit(rid, prompt, lora_name=name, namespace=namespace + ((f"lora:{name}",) if name else ()),
                          max_new_tokens=3)
            driver.run_until_idle()
            return driver.results[rid]

        first = run("a1", "every")
        assert first.cached_tokens == 0
        assert run("a2", "every").cached_tokens == len(prompt) - 1  # same adapter: the prompt is cached
        other = run("b1", "attn")
        assert other.cached_tokens == 0 and other.output_ids != first.output_ids
        assert run("base", None).cached_tokens == 0
        driver.scheduler.handle_message(UnloadLoRAAdapterReq(rpc_id="u", lora_name="every"))
        driver._collect()
        reply = driver.replies.pop()
        assert reply.success and "every" not in reply.loaded_adapters
        assert all("lora:every" not in ns for ns in driver.scheduler.cache.root.children)
        driver.scheduler.check_invariants()
        driver.scheduler.handle_message(LoadLoRAAdapterReq(rpc_id="l", lora_name="every",
                                                           lora_path=adapters["attn"]))
        driver._collect()
        assert driver.replies.pop().success
        again = run("a3", "every")  # same name, other weights: nothing cached from before survives
        assert again.cached_tokens == 0 and again.output_ids == other.output_ids
    finally:
        driver.close()


def test_unknown_adapters_and_busy_unloads_are_refused(tiny_llama, adapters, tmp_path):
    driver = lora_driver(tiny_llama, {"every": adapters["every"]})
    try:
        driver.submit("x", [1, 2, 3], lora_name="nope", max_new_tokens=2)
        driver.submit("busy", [1, 2, 3, 4], lora_name="every", max_new_tokens=6)
        driver.scheduler.handle_message(UnloadLoRAAdapterReq(rpc_id="u", lora_name="every"))
        driver._collect()
        reply = driver.replies.pop()
        assert not reply.success and reply.status_code == 400 and "in use" in reply.error_message
        driver.scheduler.handle_message(LoadLoRAAdapterReq(rpc_id="l", lora_name="bad", lora_path=str(tmp_path)))
        driver._collect()
        reply = driver.replies.pop()
        assert not reply.success and "adapter_config.json" in reply.error_message
        assert reply.loaded_adapters == {"every": adapters["every"]}
        driver.run_until_idle()
    finally:
        driver.close()
    refused = driver.results["x"].finish_reason
    assert refused["status_code"] == 400 and "nope" in refused["message"]
    assert driver.results["busy"].finish_reason["type"] == "length"


def test_adapter_files_are_checked(tiny_llama, adapters, tmp_path):
    shapes = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
              "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}
    adapter = read_adapter("every", adapters["every"], 2, shapes, max_rank=8)
    assert adapter.rank == 8 and adapter.scale == 2.0 and len(adapter.weights) == 14
    with pytest.raises(LoRAAdapterError, match="max-lora-rank"):
        read_adapter("every", adapters["every"], 2, shapes, max_rank=4)
    wrong = dict(shapes, q_proj=(64, 48))
    with pytest.raises(LoRAAdapterError, match="q_proj"):
        read_adapter("every", adapters["every"], 2, wrong, max_rank=8)
    folder = make_adapter(str(tmp_path / "dora"), tiny_llama, rank=2)
    with open(os.path.join(folder, "adapter_config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({**config, "use_dora": True}, f)
    with pytest.raises(LoRAAdapterError, match="use_dora"):
        read_adapter("dora", folder, 2, shapes, max_rank=8)


def test_sglang_forms_of_lora_paths_on_the_command_line():
    import argparse

    from radixserve.runtime.wire.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    cli = parser.parse_args(["--lora-paths", "a=/x", "/y", '{"lora_name": "c", "lora_path": "/z", "pinned": true}',
                             "--max-loras-per-batch", "2", "--max-lora-rank", "32"])
    args = ServerArgs.from_cli_args(cli)
    assert args.lora_paths == ["a=/x", "/y=/y", "c=/z"] and args.lora_enabled()
    assert args.max_loras_per_batch == 2 and args.max_lora_rank == 32
    assert ServerArgs(lora_paths={"q": "/p"}).lora_paths == ["q=/p"]
    assert ServerArgs(enable_lora=True).lora_enabled() and not ServerArgs().lora_enabled()
    for bad in (dict(lora_paths=["a=/x", "a=/y"]), dict(lora_paths=["=/x"]), dict(max_loras_per_batch=0),
                dict(lora_paths=['{"lora_name": "c"}']), dict(enable_lora=False, lora_paths=["a=/x"]),
                dict(enable_lora=True, tp_size=2)):
        with pytest.raises(ValueError):
            ServerArgs(**bad)
