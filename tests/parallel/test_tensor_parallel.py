"""Tensor parallelism on the CPU (gloo): sharded models equal the unsharded model and Hugging Face, and a
served TP group (one scheduler process per rank) gives the same greedy output as TP=1.

The model-level test runs each rank's ModelRunner in its own spawned process (a real gloo group over
loopback); the engine-level tests start real Engines with `tp_size > 1`.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from typing import Optional

import pytest
import torch

from radixserve.model_runner.parallel import HeadLayout, TPGroup, check_tp_divides, vocab_shard

MAX_NEW_TOKENS = 6
TINY_CONFIGS = {
    # Qwen2, one KV head: replicated on both ranks; tied embeddings.
    "qwen2-1kv": ("qwen2", {"num_key_value_heads": 1}),
    # Qwen3, two KV heads: one per rank; a vocabulary that does not divide by 2 (padded last shard).
    "qwen3-odd-vocab": ("qwen3", {"vocab_size": 511}),
    # Llama with an untied LM head.
    "llama": ("llama", {}),
}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in (5, 11, 3, 17)]


def _rank_main(rank: int, tp_size: int, addrs: list[str], model_dirs: list[str], results, device: str,
               prompts: Optional[list[list[int]]] = None, max_new_tokens: int = MAX_NEW_TOKENS,
               server_args: Optional[dict] = None) -> None:
    """One rank: build the sharded runner of each model and run the same batched greedy generation (of `prompts`,
    default `_prompts`; `server_args`: more ServerArgs fields)."""
    import torch.distributed as dist

    from radixserve.model_runner.model_runner import ModelRunner
    from radixserve.model_runner.runner_config import RunnerConfig
    from radixserve.model_runner.static_generate import greedy_generate
    from radixserve.runtime.wire.server_args import ServerArgs

    try:
        outputs = []
        for addr, model_dir in zip(addrs, model_dirs):
            args = ServerArgs(model_path=model_dir, device=device, dtype="float32", max_total_tokens=1024,
                              max_running_requests=8, tp_size=tp_size, dist_init_addr=addr, **(server_args or {}))
            runner = ModelRunner(RunnerConfig.from_server_args(args), tp_rank=rank)
            outputs.append(greedy_generate(runner, prompts or _prompts(runner.vocab_size), max_new_tokens))
            dist.destroy_process_group()  # a fresh group (at the next address) for the next model
        results.put((rank, outputs))
    except BaseException as exc:  # report, so the test fails with the reason rather than a timeout
        import traceback

        results.put((rank, traceback.format_exc()))
        raise SystemExit(1) from exc


def _run_group(tp_size: int, model_dirs: list[str], timeout_s: float = 300.0, device: str = "cpu",
               prompts: Optional[list[list[int]]] = None, max_new_tokens: int = MAX_NEW_TOKENS,
               **server_args) -> list[list[list[int]]]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    addrs = [f"127.0.0.1:{_free_port()}" for _ in model_dirs]
    procs = [ctx.Process(target=_rank_main, args=(r, tp_size, addrs, model_dirs, results, device, prompts,
                                                  max_new_tokens, server_args))
             for r in range(tp_size)]
    for p in procs:
        p.start()
    try:
        by_rank = dict(results.get(timeout=timeout_s) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, out in by_rank.items():
        assert not isinstance(out, str), f"rank {rank} failed:\n{out}"
    assert all(by_rank[r] == by_rank[0] for r in by_rank), "ranks disagree"
    return by_rank[0]


def _hf_greedy(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_NEW_TOKENS, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def test_sharded_tiny_models_equal_tp1_and_transformers(tiny_model_dir):
    """TP=2 (Qwen2 with its single KV head replicated, Qwen3 with a padded vocabulary shard, Llama untied)
    gives the same greedy ids as TP=1 and as Hugging Face."""
    from test_model_forward import make_runner
    from radixserve.model_runner.static_generate import greedy_generate

    dirs = [tiny_model_dir(arch, **overrides) for arch, overrides in TINY_CONFIGS.values()]
    sharded = _run_group(2, dirs)
    for name, model_dir, tp2 in zip(TINY_CONFIGS, dirs, sharded):
        runner = make_runner(model_dir)
        prompts = _prompts(runner.vocab_size)
        tp1 = greedy_generate(runner, prompts, MAX_NEW_TOKENS)
        assert tp2 == tp1, name
        assert tp2 == _hf_greedy(model_dir, prompts), name


def test_head_layout_replicates_kv_heads_when_ranks_exceed_them():
    # 4 query heads over 4 ranks, 2 KV heads: ranks 0-1 read KV head 0, ranks 2-3 KV head 1.
    layouts = [HeadLayout.of(4, 2, TPGroup(rank, 4)) for rank in range(4)]
    assert [(lay.num_heads, lay.q_start, lay.num_kv_heads, lay.kv_start) for lay in layouts] == [
        (1, 0, 1, 0), (1, 1, 1, 0), (1, 2, 1, 1), (1, 3, 1, 1)]
    # The embedded model: 9 heads, 3 KV heads over 3 ranks: 3 query heads and 1 KV head each.
    assert HeadLayout.of(9, 3, TPGroup(2, 3)) == HeadLayout(3, 1, 6, 2)


def test_tp_size_that_does_not_divide_the_heads_names_the_numbers():
    with pytest.raises(ValueError, match="tp_size 2 does not divide the model's 9 attention heads"):
        check_tp_divides(9, 3, 2)
    with pytest.raises(ValueError, match="tp_size 6 exceeds the model's 4 KV heads"):
        check_tp_divides(12, 4, 6)


def test_vocab_shards_cover_the_vocabulary_once():
    shards = [vocab_shard(511, TPGroup(rank, 2)) for rank in range(2)]
    assert shards == [(0, 256, 256), (256, 511, 256)]


def _desync_rank(rank: int, addr: str, model_dir: str, results) -> None:
    """Two real schedulers in a TP group: equal digests pass; then rank 1 takes a KV slot rank 0 did not, and
    the check must fail on both ranks."""
    from radixserve.model_runner.model_runner import ModelRunner
    from radixserve.model_runner.runner_config import RunnerConfig
    from radixserve.runtime.wire.server_args import ServerArgs
    from radixserve.scheduler.scheduler import Scheduler
    from radixserve.scheduler.tp import TPDesyncError, TPRelay

    args = ServerArgs(model_path=model_dir, device="cpu", dtype="float32", max_total_tokens=256,
                      max_running_requests=4, tp_size=2, dist_init_addr=addr)
    scheduler = Scheduler(args, model_runner=ModelRunner(RunnerConfig.from_server_args(args), tp_rank=rank))
    relay = TPRelay(rank, scheduler.runner.tp_cpu_group)
    relay.check_digests(scheduler)
    if rank == 1:
        scheduler.allocator.alloc(1)
    try:
        relay.check_digests(scheduler)
        results.put((rank, "no error"))
    except TPDesyncError as error:
        results.put((rank, str(error)))


def test_desync_check_fails_on_every_rank(tiny_model_dir):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    addr = f"127.0.0.1:{_free_port()}"
    model = tiny_model_dir("qwen2", num_key_value_heads=1)
    procs = [ctx.Process(target=_desync_rank, args=(r, addr, model, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        by_rank = dict(results.get(timeout=300) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all("tensor-parallel ranks diverged" in by_rank[r] for r in (0, 1)), by_rank


# ---- served: one scheduler process per rank -----------------------------------------------------------------

ENGINE_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Water boils at",
    "List three colors:",
    "In 1969, humans first",
]


def _engine_outputs(tp_size: int, prompts, **extra) -> tuple[list[list[int]], dict]:
    from radixserve import Engine

    params = {"max_new_tokens": 12, "temperature": 0.0}
    with Engine(dtype="float32", tp_size=tp_size, max_running_requests=8, **extra) as engine:
        first = engine.generate(prompts, params)
        # The radix cache serves a second round of the same prompts; the output must not change.
        second = engine.generate(prompts, params)
        info = engine.get_server_info()
    assert info["tensor_parallel"]["tp_size"] == tp_size
    ids = [out["output_ids"] for out in first]
    assert ids == [out["output_ids"] for out in second]
    assert any(out["meta_info"]["cached_tokens"] > 0 for out in second)
    return ids, info


@pytest.mark.slow
def test_embedded_model_tp3_equals_tp1():
    """The embedded model (9 heads, 3 KV heads) at TP=3: same greedy ids as TP=1 for a batch of prompts, with
    the radix cache reused, chunked prefill (small chunks), mixed chunks, and a KV pool small enough that
    decoding retracts requests."""
    extra = {"chunked_prefill_size": 8, "enable_mixed_chunk": True, "max_total_tokens": 128}
    tp1, _ = _engine_outputs(1, ENGINE_PROMPTS, **extra)
    tp3, info = _engine_outputs(3, ENGINE_PROMPTS, **extra)
    assert tp3 == tp1
    assert info["num_retractions"] > 0
    assert info["tensor_parallel"]["attention_heads_per_rank"] == 3
    assert info["tensor_parallel"]["kv_heads_per_rank"] == 1


@pytest.mark.slow
def test_tp_size_not_dividing_heads_fails_at_startup():
    from radixserve import Engine
    from radixserve.runtime.launch import EngineStartupError

    with pytest.raises(EngineStartupError, match="tp_size 2 does not divide the model's 9 attention heads"):
        Engine(tp_size=2)


@pytest.mark.slow
def test_killing_a_rank_fails_pending_requests_and_leaves_no_process():
    import signal
    import time

    import psutil

    from radixserve import Engine

    engine = Engine(dtype="float32", tp_size=3)
    try:
        ranks = dict(engine._resources.children.pids())
        children = [psutil.Process(pid) for pid in ranks.values()]
        children += [grandchild for child in children for grandchild in child.children(recursive=True)]
        import threading

        errors: list[BaseException] = []

        def run() -> None:
            try:
                engine.generate(ENGINE_PROMPTS, {"max_new_tokens": 2000, "temperature": 0.0, "ignore_eos": True})
            except BaseException as exc:  # the request must fail, not hang
                errors.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(3.0)
        os.kill(ranks["scheduler-tp1"], signal.SIGKILL)
        killed_at = time.monotonic()
        thread.join(timeout=5.0)
        assert not thread.is_alive(), "pending requests still waiting 5 s after a rank died"
        assert errors and time.monotonic() - killed_at < 5.0
        assert not engine.is_healthy()
    finally:
        engine.shutdown()
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"processes left behind: {alive}"


@pytest.mark.slow
def test_two_nodes_on_loopback_equal_tp1(tiny_model_dir, tmp_path):
    """Two "nodes" on loopback: this process serves node 0 (rank 0), a `radixserve serve --node-rank 1`
    worker runs rank 1, both holding the group's secret (the worker from the environment); greedy output equals
    TP=1, and the worker exits once node 0 is gone."""
    import subprocess
    import sys

    from radixserve import Engine

    model = tiny_model_dir("qwen2", with_tokenizer=True, num_key_value_heads=1)
    prompts = ENGINE_PROMPTS[:4]
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    addr = f"127.0.0.1:{_free_port()}"
    secret_file = tmp_path / "dist-secret"
    secret_file.write_text("a secret the two nodes share\n")
    secret_file.chmod(0o600)
    common = {"model_path": model, "dtype": "float32", "device": "cpu"}
    worker = subprocess.Popen([sys.executable, "-m", "radixserve", "serve", "--model-path", model, "--dtype",
                               "float32", "--device", "cpu", "--tp-size", "2", "--nnodes", "2", "--node-rank", "1",
                               "--dist-init-addr", addr],
                              env={**os.environ, "RADIXSERVE_DIST_SECRET": "a secret the two nodes share"})
    try:
        with Engine(tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr, dist_auth_secret_file=str(secret_file),
                    **common) as engine:
            two_nodes = [out["output_ids"] for out in engine.generate(prompts, params)]
            layout = engine.get_server_info()["tensor_parallel"]
        assert worker.wait(timeout=60) != 0  # its group ended with node 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    with Engine(**common) as engine:
        one_rank = [out["output_ids"] for out in engine.generate(prompts, params)]
    assert two_nodes == one_rank
    assert layout["tp_size"] == 2 and layout["kv_heads_replicated"]


# ---- two GPUs (NCCL); skipped elsewhere ------------------------------------------------------------------------

needs_two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                    reason="needs two CUDA devices")


@pytest.mark.gpu
@needs_two_gpus
def test_sharded_tiny_models_on_two_gpus_equal_transformers(tiny_model_dir):
    """NCCL: the sharded runners on two GPUs (eager) give Hugging Face's greedy ids."""
    dirs = [tiny_model_dir(arch, **overrides) for arch, overrides in TINY_CONFIGS.values()]
    # Triton attention: FlashInfer has neither float32 nor kernels for the tiny models' head size of 16.
    sharded = _run_group(2, dirs, device="cuda", attention_backend="triton")
    for name, model_dir, tp2 in zip(TINY_CONFIGS, dirs, sharded):
        assert tp2 == _hf_greedy(model_dir, _prompts(_config_vocab(model_dir))), name


def _config_vocab(model_dir: str) -> int:
    import json

    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)["vocab_size"]


@pytest.mark.gpu
@needs_two_gpus
def test_engine_tp2_on_gpus_with_cuda_graphs_equals_tp1(tiny_model_dir):
    """An Engine at TP=2 on two GPUs, decode in CUDA graphs capturing the NCCL all-reduce: same greedy ids
    as TP=1 on one GPU."""
    from radixserve import Engine

    model = tiny_model_dir("qwen3", with_tokenizer=True)
    params = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    outputs = []
    for tp_size in (1, 2):
        with Engine(model_path=model, device="cuda", dtype="float32", tp_size=tp_size) as engine:
            outputs.append([out["output_ids"] for out in engine.generate(ENGINE_PROMPTS, params)])
    assert outputs[1] == outputs[0]
