"""The mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral) served on the CPU against Hugging Face.

Tiny random-weight models of each family, built from the family's own config class and saved with `save_pretrained`
(tests/conftest.py: 8 experts, top-2), so the loader reads the real checkpoint layout (one tensor per expert):

- the config: experts, routing rule and sparse layers read from each family's keys;
- greedy ids equal `transformers` generate over 32 tokens for 8 prompts of different lengths, in one batched runner;
- through a real scheduler: chunked prefill of 16, mixed prefill/decode batches, the overlap loop, and radix-cache
  hits (the same prompts again compute only their last token) give the same ids;
- the Engine (real scheduler and detokenizer processes) serves one family end to end;
- tensor parallelism over two gloo ranks (each holding half of every expert) gives the ids of one rank.

Qwen3-MoE renormalizes its top-k (`norm_topk_prob`, as the released checkpoints do); Qwen2-MoE has 3 layers with the
middle one dense (`mlp_only_layers`) and a shared expert; Mixtral routes top-k then softmax. The whole file takes
about 20 s on 2 cores; the Engine serves the family with every feature (Qwen2-MoE).
"""

from __future__ import annotations

import pytest
import torch

from scheduler_driver import SchedulerDriver
from test_model_forward import MAX_NEW_TOKENS, assert_same_greedy_tokens, hf_greedy, hf_model, random_prompts

from radixserve.model_runner.model_config import ModelConfig

FAMILIES = {
    "qwen3_moe": {"norm_topk_prob": True},
    "qwen2_moe": {"num_hidden_layers": 3, "mlp_only_layers": [1]},
    "mixtral": {},
}
ENGINE_FAMILY = "qwen2_moe"  # the one with every feature: shared expert, dense and sparse layers
PROMPT_LENGTHS = [3, 17, 8, 1, 25, 12, 5, 30]


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir):
    return {family: tiny_model_dir(family, **overrides) for family, overrides in FAMILIES.items()}


@pytest.fixture(scope="module")
def references(model_dirs):
    """Each family's prompts (a shared 20-token head on some, so the tree shares prefixes) and HF's greedy ids."""
    built = {}

    def get(family: str) -> tuple[list[list[int]], list[list[int]]]:
        if family not in built:
            head = random_prompts(512, [20], seed=11)[0]
            prompts = [head + p if i % 3 == 0 else p
                       for i, p in enumerate(random_prompts(512, PROMPT_LENGTHS, seed=5))]
            reference = hf_model(model_dirs[family])
            built[family] = prompts, [hf_greedy(reference, p, MAX_NEW_TOKENS, []) for p in prompts]
        return built[family]

    return get


def test_each_family_config_is_read(model_dirs):
    qwen3 = ModelConfig.from_path(model_dirs["qwen3_moe"]).moe
    qwen2 = ModelConfig.from_path(model_dirs["qwen2_moe"]).moe
    mixtral = ModelConfig.from_path(model_dirs["mixtral"]).moe
    assert (qwen3.num_experts, qwen3.top_k, qwen3.intermediate_size) == (8, 2, 32)
    assert (qwen3.routing, qwen3.renormalize, qwen3.sparse_layers) == ("softmax_topk", True, {0, 1})
    assert (qwen2.renormalize, qwen2.sparse_layers, qwen2.shared_expert_intermediate_size) == (False, {0, 2}, 48)
    assert (mixtral.routing, mixtral.intermediate_size, mixtral.sparse_layers) == ("topk_softmax", 32, {0, 1})
    assert ModelConfig.from_path(model_dirs["qwen2_moe"]).attention_bias  # Qwen2-MoE's qkv_bias
    assert ModelConfig.from_path(model_dirs["qwen3_moe"]).qk_norm
    dense = ModelConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                                   "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100})
    assert dense.moe is None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_ids_equal_transformers(family, model_dirs, references):
    prompts, expected = references(family)

    def stacked(runner):  # the experts really are stacked [E, ...] parameters, and every layer kind is there
        layers = runner.model.model.layers
        sparse = [type(layer.mlp).__name__ == "SparseMoeBlock" for layer in layers]
        assert sparse == [i in runner.model_config.moe.sparse_layers for i in range(len(layers))]
        assert layers[0].mlp.experts.w13_weight.shape == (8, 64, 64)

    outputs = assert_same_greedy_tokens(model_dirs[family], prompts, on_runner=stacked)
    assert outputs == expected
    assert len({tuple(o) for o in outputs}) == len(outputs)  # not a degenerate comparison


SCHEDULER_CONFIGS = {
    "chunk-16": dict(chunked_prefill_size=16, disable_overlap_schedule=True),
    "mixed-chunk-overlap": dict(chunked_prefill_size=16, enable_mixed_chunk=True, disable_overlap_schedule=False),
}


@pytest.mark.parametrize("config", list(SCHEDULER_CONFIGS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_scheduler_batches_and_radix_hits_keep_the_ids(family, config, model_dirs, references):
    check_batches_and_radix_hits(model_dirs[family], *references(family), config)


def check_batches_and_radix_hits(model_dir: str, prompts: list, expected: list, config: str) -> None:
    """The prompts through a scheduler with `SCHEDULER_CONFIGS[config]` give the expected ids, and again as radix-cache
    hits of all but their last token."""
    driver = SchedulerDriver(model_dir, max_total_tokens=4096, **SCHEDULER_CONFIGS[config])
    for i, prompt in enumerate(prompts):
        driver.submit(f"r{i}", prompt, max_new_tokens=MAX_NEW_TOKENS)
    driver.run_until_idle()
    assert driver.outputs() == expected
    stats = driver.scheduler.stats
    assert stats.partial_chunks > 0 and stats.cached_tokens > 0  # chunks ran, shared heads came from the tree
    assert (stats.mixed_batches > 0) == ("mixed" in config)
    # The same prompts again: all but the last token of each is a radix-cache hit.
    for i, prompt in enumerate(prompts):
        driver.submit(f"again{i}", prompt, max_new_tokens=MAX_NEW_TOKENS)
    driver.run_until_idle()
    again = [driver.results[f"again{i}"] for i in range(len(prompts))]
    assert [r.output_ids for r in again] == expected
    assert [r.cached_tokens for r in again] == [len(p) - 1 for p in prompts]
    driver.close()


def test_engine_serves_a_mixture_of_experts_model(tiny_model_dir, references):
    from radixserve import Engine

    model_dir = tiny_model_dir(ENGINE_FAMILY, **FAMILIES[ENGINE_FAMILY])  # the same folder as `model_dirs`
    prompts, expected = references(ENGINE_FAMILY)
    with Engine(model_path=model_dir, device="cpu", dtype="float32", chunked_prefill_size=16,
                enable_mixed_chunk=True, log_level="warning") as engine:
        results = engine.generate(input_ids=prompts, sampling_params={"temperature": 0.0,
                                                                      "max_new_tokens": MAX_NEW_TOKENS})
        assert [r["output_ids"] for r in results] == expected
        # The same prompts again: all but their last tokens come from the radix cache.
        again = engine.generate(input_ids=prompts, sampling_params={"temperature": 0.0,
                                                                    "max_new_tokens": MAX_NEW_TOKENS})
        assert [r["output_ids"] for r in again] == expected
        assert [r["meta_info"]["cached_tokens"] for r in again] == [len(p) - 1 for p in prompts]


def test_two_tensor_parallel_ranks_equal_one(model_dirs, references):
    """Each rank holds half of every expert's intermediate dimension (and of the shared expert's and the dense MLP's)."""
    from test_tensor_parallel import _run_group, _prompts

    from radixserve.model_runner.static_generate import greedy_generate
    from test_model_forward import make_runner

    dirs = [model_dirs["qwen2_moe"], model_dirs["qwen3_moe"]]
    sharded = _run_group(2, dirs)
    for model_dir, tp2 in zip(dirs, sharded):
        runner = make_runner(model_dir)
        assert tp2 == greedy_generate(runner, _prompts(runner.vocab_size), len(tp2[0]))
        reference = hf_model(model_dir)
        assert tp2 == [hf_greedy(reference, p, len(tp2[0]), []) for p in _prompts(runner.vocab_size)]


def test_lora_adapters_are_refused_on_a_mixture_of_experts_model(model_dirs):
    from test_model_forward import make_runner

    with pytest.raises(ValueError, match="mixture-of-experts"):
        make_runner(model_dirs["qwen3_moe"], enable_lora=True, max_lora_rank=8)


def test_qwen3_30b_a3b_benchmark_config_builds_and_takes_its_dummy_weights():
    """The published config the GPU benchmark runs (benchmarks/configs/qwen3-30b-a3b.json): read as Qwen3-MoE, and its
    dummy weights (checkpoint names and shapes) fill every parameter of the model, checked on the meta device."""
    import json
    from pathlib import Path

    from radixserve.model_runner.loader.weights import dummy_weight_shapes
    from radixserve.model_runner.models import get_model_class

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "qwen3-30b-a3b.json"
    config = ModelConfig.from_dict(json.loads(path.read_text()))
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.renormalize) == (128, 8, 768, True)
    assert moe.sparse_layers == set(range(48)) and config.qk_norm and config.head_dim == 128
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, max_positions=64)
        shapes = dummy_weight_shapes(config)
        model.load_weights((name, torch.empty(shape)) for name, shape in shapes.items())
    total = sum(p.numel() for p in model.parameters())
    assert 30.0e9 < total < 31.0e9  # "30B"
    active = total - 48 * (128 - 8) * 3 * 768 * 2048
    assert 3.2e9 < active < 3.5e9  # "A3B": attention, router, 8 of 128 experts, embeddings and head


# ---- expert parallelism --------------------------------------------------------------------------

EP_FAMILIES = ["qwen3_moe", "mixtral"]


def test_expert_parallel_ranks_equal_one(model_dirs, references):
    """`--tp-size 2 --ep-size 2`: each gloo rank holds 4 of the 8 experts, whole, runs every token through them and
    the all-reduce sums the ranks; the greedy ids equal one rank's and Hugging Face's (8 prompts x 32 tokens)."""
    from test_tensor_parallel import _run_group

    from radixserve.model_runner.static_generate import greedy_generate
    from test_model_forward import make_runner

    for family in EP_FAMILIES:
        prompts, expected = references(family)
        [ep2] = _run_group(2, [model_dirs[family]], prompts=prompts, max_new_tokens=MAX_NEW_TOKENS, ep_size=2)
        assert ep2 == expected, family
        assert ep2 == greedy_generate(make_runner(model_dirs[family]), prompts, MAX_NEW_TOKENS), family


def test_engine_serves_with_expert_parallelism_and_reports_it(model_dirs, references):
    """Two scheduler processes (one per rank) serving Qwen3-MoE with `ep_size=2`: Hugging Face's ids, and
    `get_server_info` reports the expert-parallel size beside the tensor-parallel one."""
    from radixserve import Engine

    prompts, expected = references("qwen3_moe")
    with Engine(model_path=model_dirs["qwen3_moe"], device="cpu", dtype="float32", tp_size=2, ep_size=2,
                log_level="warning") as engine:
        results = engine.generate(input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": 8})
        assert [r["output_ids"] for r in results] == [ids[:8] for ids in expected]
        layout = engine.get_server_info()["tensor_parallel"]
        assert (layout["tp_size"], layout["ep_size"], layout["backend"]) == (2, 2, "gloo")


class _RecordedSlice:
    """A lazy safetensors slice that notes its name in `read` when indexed (when its data is read)."""

    def __init__(self, name: str, tensor_slice, read: set[str]) -> None:
        self.name, self.slice, self.read = name, tensor_slice, read

    def get_shape(self):
        return self.slice.get_shape()

    def __getitem__(self, index):
        self.read.add(self.name)
        return self.slice[index]


@pytest.mark.parametrize("family", EP_FAMILIES)
def test_each_expert_parallel_rank_loads_only_its_experts(family, model_dirs):
    """Under tp 2 / ep 2, rank r's stacked experts are experts [4r, 4r+4), whole ([4, 2I, H] and [4, H, I]) and equal
    to the checkpoint's; the other rank's expert tensors are never read from the file."""
    import re

    from safetensors import safe_open

    from radixserve.model_runner.loader.weights import iter_weights
    from radixserve.model_runner.models import get_model_class
    from radixserve.model_runner.parallel import TPGroup
    from radixserve.runtime.wire.model_files import safetensors_files

    model_dir = model_dirs[family]
    config = ModelConfig.from_path(model_dir)
    expert_tensor = re.compile(r"\.experts\.(\d+)\.")
    [path] = safetensors_files(model_dir)
    for rank in range(2):
        with torch.device("meta"):
            model = get_model_class(config.architecture)(config, max_positions=64, tp=TPGroup(rank, 2, None, 2))
        model = model.to_empty(device="cpu")
        read: set[str] = set()
        with torch.no_grad():
            model.load_weights((name, _RecordedSlice(name, s, read)) for name, s in iter_weights(model_dir, lazy=True))
        experts = model.model.layers[0].mlp.experts
        assert experts.w13_weight.shape == (4, 64, 64) and experts.w2_weight.shape == (4, 64, 32)
        read_experts = {int(m.group(1)) for m in map(expert_tensor.search, read) if m}
        assert read_experts == set(range(4 * rank, 4 * rank + 4))
        prefix = "block_sparse_moe" if family == "mixtral" else "mlp"
        down = "w2" if family == "mixtral" else "down_proj"
        with safe_open(path, framework="pt") as f:
            checkpoint = f.get_tensor(f"model.layers.0.{prefix}.experts.{4 * rank + 1}.{down}.weight")
        assert torch.equal(experts.w2_weight[1], checkpoint)


def test_expert_parallelism_is_refused_where_it_cannot_shard(model_dirs, tiny_model_dir):
    from test_model_forward import make_runner

    from radixserve.runtime.wire.server_args import ServerArgs

    with pytest.raises(ValueError, match="ep_size 2 shards a mixture-of-experts model's experts, and this model is "
                                         "dense"):
        make_runner(tiny_model_dir("qwen3"), tp_size=2, ep_size=2)
    with pytest.raises(ValueError, match="ep_size 3 does not divide the model's 8 experts"):
        make_runner(model_dirs["qwen3_moe"], tp_size=3, ep_size=3)
    with pytest.raises(ValueError, match="ep_size 4 does not divide tp_size 2"):
        ServerArgs(model_path=model_dirs["qwen3_moe"], tp_size=2, ep_size=4)
    with pytest.raises(ValueError, match="ep_size 2 does not divide tp_size 3"):
        ServerArgs(model_path=model_dirs["qwen3_moe"], tp_size=3, ep_size=2)


def test_ep_size_flag_and_its_sglang_alias():
    import argparse

    from radixserve.runtime.wire.server_args import ServerArgs

    for flag in ("--ep-size", "--expert-parallel-size"):
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        args = ServerArgs.from_cli_args(parser.parse_args(["--model-path", "x", "--tp-size", "2", flag, "2"]))
        assert (args.tp_size, args.ep_size) == (2, 2)


def test_deterministic_inference_gives_a_request_the_same_bits_alone_and_in_a_batch(model_dirs):
    """`--enable-deterministic-inference` on the CPU with Qwen3-MoE: a request run alone and among 11 others gets the
    same ids and logprobs, bit for bit. The radix cache is off, so the batch prefills it again with the others (about
    200 pairs, where the grouped GEMMs would serve the normal mode and change its bits)."""
    prompts = random_prompts(512, [7, 12, 5, 9, 14, 6, 8, 11, 4, 10, 13, 3], seed=21)
    driver = SchedulerDriver(model_dirs["qwen3_moe"], max_total_tokens=4096, enable_deterministic_inference=True,
                             disable_radix_cache=True)
    experts = [m for m in driver.runner.model.modules() if hasattr(m, "batch_invariant")]
    assert experts and all(m.batch_invariant for m in experts)
    driver.submit("alone", prompts[0], max_new_tokens=12, return_logprob=True)
    driver.run_until_idle()
    for i, prompt in enumerate(prompts):
        driver.submit(f"batch{i}", prompt, max_new_tokens=12, return_logprob=True)
    driver.run_until_idle()
    alone, batched = driver.results["alone"], driver.results["batch0"]
    assert alone.output_ids == batched.output_ids and alone.logprobs == batched.logprobs
    driver.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_gpu_decode_runs_the_post_attention_norm_in_the_routers_launch(family, model_dirs, monkeypatch):
    """At one token on CUDA the sparse block's residual add and RMSNorm join the router's launch
    (`add_norm_route_tokens`); in bfloat16, in CUDA graphs, greedy ids at batch 1 equal those of the norm's own kernel
    before the router's (the two normalized rows can differ in a last bit where the statistics' sums round apart)."""
    from radixserve.kernels import moe_routing
    from radixserve.model_runner.model_runner import ModelRunner
    from radixserve.model_runner.moe import layer as moe_layer
    from radixserve.model_runner.moe.routing import route_tokens
    from radixserve.model_runner.runner_config import RunnerConfig
    from radixserve.model_runner.static_generate import greedy_generate
    from radixserve.runtime.wire.server_args import ServerArgs

    prompts = random_prompts(512, [5, 17, 9, 30], seed=3)
    fused_calls = []
    launch = moe_routing.add_norm_route
    monkeypatch.setattr(moe_routing, "add_norm_route", lambda *a, **k: fused_calls.append(1) or launch(*a, **k))

    def generate() -> list[list[int]]:
        runner = ModelRunner(RunnerConfig.from_server_args(ServerArgs(
            model_path=model_dirs[family], device="cuda", dtype="bfloat16", attention_backend="triton",
            cuda_graph_max_bs=4, max_total_tokens=4096, max_running_requests=8)))
        assert runner.cuda_graph_runner is not None
        return [greedy_generate(runner, [prompt], 16)[0] for prompt in prompts]

    fused = generate()
    assert fused_calls, "the decode steps did not take the fused launch"

    def norm_then_route(x, residual, norm, gate, top_k, routing, renormalize):
        hidden, residual = norm(x, residual)
        return (hidden, residual) + route_tokens(hidden, gate, top_k, routing, renormalize)

    monkeypatch.setattr(moe_layer, "add_norm_route_tokens", norm_then_route)
    separate = generate()
    assert sum(a == b for a, b in zip(fused, separate)) >= len(prompts) - 1
