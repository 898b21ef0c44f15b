"""The Engine end to end on the embedded default model (CPU): real scheduler and detokenizer processes.

One Engine serves the whole module (a start costs seconds). Generation is kept short.
"""

from __future__ import annotations

import asyncio
import os
import threading

import psutil
import pytest

from radixserve import ContextLengthExceededError, Engine, EngineDeadError, GenerateReqInput
from radixserve.runtime.serving_engine import ServingEngine

GREEDY = {"temperature": 0.0}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "import numpy as np\n",
    "Water boils at a temperature of",
    "The quick brown fox",
    "My favourite programming language is",
    "In 1969, the first humans",
    "A haiku about autumn:\n",
    "Translate to French: good morning ->",
    "The square root of 144 is",
    "Photosynthesis is the process by which",
    "The largest planet in the solar system is",
    "Here is a list of fruits: apple, banana,",
    "To make a cup of tea, first",
]


@pytest.fixture(scope="module")
def engine():
    with Engine(log_level="warning") as engine:
        yield engine


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


def hf_greedy(hf_model, input_ids: list[int], max_new_tokens: int, eos_ids: list[int]) -> list[int]:
    """Hugging Face greedy generation of one prompt (unpadded, so no padding numerics are involved)."""
    import torch

    threads = torch.get_num_threads()
    # One thread: the engine's scheduler process shares the (2) cores, and oversubscribed OpenMP threads
    # spin-wait each other into a many-fold slowdown.
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([input_ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_ids,
                pad_token_id=eos_ids[0], attention_mask=torch.ones(1, len(input_ids), dtype=torch.long),
            )
    finally:
        torch.set_num_threads(threads)
    return out[0, len(input_ids):].tolist()


def chat(engine, text: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                add_generation_prompt=True)


def test_single_result_shape(engine):
    result = engine.generate("The capital of France is", {"max_new_tokens": 6, **GREEDY})
    assert set(result) == {"text", "output_ids", "meta_info"}
    meta = result["meta_info"]
    assert list(meta)[0] == "id"
    assert meta["prompt_tokens"] == len(engine.tokenizer.encode("The capital of France is"))
    assert meta["completion_tokens"] == len(result["output_ids"]) == 6
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["e2e_latency"] > 0 and 0 < meta["ttft"] <= meta["e2e_latency"]
    assert result["text"] == engine.tokenizer.decode(result["output_ids"], skip_special_tokens=True)


def test_batch_of_16_greedy_equals_hugging_face(engine, hf_model):
    max_new_tokens = 8
    results = engine.generate(PROMPTS, {"max_new_tokens": max_new_tokens, **GREEDY})
    assert [r["meta_info"]["prompt_tokens"] for r in results] == [len(engine.tokenizer.encode(p)) for p in PROMPTS]
    eos = engine.model_info.eos_token_ids
    for prompt, result in zip(PROMPTS, results):
        expected = hf_greedy(hf_model, engine.tokenizer.encode(prompt), max_new_tokens, eos)
        assert result["output_ids"] == expected, prompt


def test_chat_prompts_and_input_ids_equal_hugging_face(engine, hf_model):
    prompts = [chat(engine, q) for q in ("What is 2+2?", "Name a color.", "Say hello in Spanish.")]
    ids = [engine.tokenizer.encode(p) for p in prompts]
    by_text = engine.generate(prompts, {"max_new_tokens": 10, **GREEDY})
    by_ids = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 10, **GREEDY})
    eos = engine.model_info.eos_token_ids
    for prompt_ids, a, b in zip(ids, by_text, by_ids):
        assert a["output_ids"] == b["output_ids"] == hf_greedy(hf_model, prompt_ids, 10, eos)
        if a["meta_info"]["finish_reason"]["type"] == "stop":
            assert a["meta_info"]["finish_reason"]["matched"] in eos


def test_max_new_tokens_zero_prefills_and_caches(engine):
    prompt = "A long shared context about the history of tea: " + "tea " * 60
    first = engine.generate(prompt, {"max_new_tokens": 0})
    assert first["output_ids"] == [] and first["text"] == ""
    assert first["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    second = engine.generate(prompt + " And then", {"max_new_tokens": 2, **GREEDY})
    assert second["meta_info"]["cached_tokens"] >= first["meta_info"]["prompt_tokens"] - 1


def test_shared_prefix_is_cached_per_namespace(engine):
    page = engine.model_info.page_size
    prefix_ids = engine.tokenizer.encode(" ".join(f"item{i}" for i in range(150)))[:300]
    assert len(prefix_ids) == 300
    question = engine.tokenizer.encode(" Which item comes after item7?")
    params = {"max_new_tokens": 4, **GREEDY}
    engine.generate(input_ids=prefix_ids + engine.tokenizer.encode(" Hello"), sampling_params=params)
    cached = engine.generate(input_ids=prefix_ids + question, sampling_params=params)
    salted = engine.generate(input_ids=prefix_ids + question, sampling_params=params, cache_salt="other-user")
    assert cached["meta_info"]["cached_tokens"] >= 300 // page * page
    assert salted["meta_info"]["cached_tokens"] == 0
    assert cached["output_ids"] == salted["output_ids"]


def test_n_samples_seed_and_rids(engine):
    params = {"max_new_tokens": 6, "temperature": 1.0, "n": 3, "seed": 7}
    # Both runs below then find the prompt in the radix cache and compute alike: a fresh prefill and a cache hit may
    # differ in the last bits, which the GGUF blocks' rounded activations can carry into a sampled token.
    engine.generate("Tell me a word:", {"max_new_tokens": 1, "temperature": 0.0})

    async def with_rid():
        obj = GenerateReqInput(text="Tell me a word:", sampling_params=params, rid="sample")
        return [result async for result in engine.generate_request(obj)][0]

    first = asyncio.run(with_rid())
    assert [r["meta_info"]["id"] for r in first] == ["sample-0", "sample-1", "sample-2"]
    again = engine.generate("Tell me a word:", params)
    assert [r["output_ids"] for r in again] == [r["output_ids"] for r in first], "same seed, same samples"
    assert len({tuple(r["output_ids"]) for r in first}) > 1, "samples of n > 1 use different seeds"


def test_logprobs(engine):
    result = engine.generate("The capital of France is", {"max_new_tokens": 5, **GREEDY},
                             return_logprob=True, top_logprobs_num=3)
    meta = result["meta_info"]
    assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == 5
    for (logprob, token_id, text), top, out_id in zip(meta["output_token_logprobs"], meta["output_top_logprobs"],
                                                        result["output_ids"]):
        assert token_id == out_id and logprob <= 0.0 and text is None
        assert len(top) == 3 and top[0][1] == token_id  # greedy picks the most likely token
        assert top[0][0] == pytest.approx(logprob, abs=1e-4)
    chunks = list(engine.generate("The capital of France is", {"max_new_tokens": 5, **GREEDY},
                                  return_logprob=True, stream=True))
    # As in SGLang, each chunk carries the output logprobs of every token so far.
    for chunk in chunks:
        assert [e[1] for e in chunk["meta_info"]["output_token_logprobs"]] == chunk["output_ids"]
    assert chunks[-1]["output_ids"] == result["output_ids"]


def test_bad_arguments_raise_value_error_and_queue_nothing(engine):
    long_prompt = "word " * (engine.model_info.context_len + 10)
    bad = [
        dict(prompt="x", sampling_params={"max_new_tokens": -1}),
        dict(prompt="x", sampling_params={"temperature": -0.5}),
        dict(prompt="x", sampling_params={"top_p": 0.0}),
        dict(prompt="x", sampling_params={"top_p": 1.5}),
        dict(prompt="x", sampling_params={"top_k": 0}),
        dict(prompt="x", sampling_params={"top_k": -2}),
        dict(prompt="x", sampling_params={"min_p": 1.5}),
        dict(prompt="x", sampling_params={"repetition_penalty": 0.0}),
        dict(prompt="x", sampling_params={"frequency_penalty": 2.5}),
        dict(prompt="x", sampling_params={"presence_penalty": -3}),
        dict(prompt="x", sampling_params={"n": 0}),
        dict(prompt="x", sampling_params={"max_tokens": 5, "bogus": 1}),
        dict(prompt="x", sampling_params={"logit_bias": {"99999999": 1.0}}),
        dict(prompt="x", sampling_params={"stop_token_ids": [-1]}),
        dict(prompt="x", sampling_params={"min_new_tokens": 5, "max_new_tokens": 2}),
        dict(prompt="x", sampling_params={"stop": ""}),
        dict(prompt="x", sampling_params={"ignore_eos": "yes"}),
        dict(prompt=None),
        dict(prompt="x", input_ids=[1, 2]),
        dict(input_ids=[[1, 2], [999999]]),
        dict(input_ids=[]),
        dict(prompt=["a", "b"], sampling_params=[{"max_new_tokens": 1}]),
        dict(prompt="x", return_logprob=True, top_logprobs_num=-1),
    ]
    for kwargs in bad:
        for stream in (False, True):
            with pytest.raises(ValueError):
                engine.generate(**kwargs, stream=stream)
    with pytest.raises(ValueError, match="unknown sampling parameter.*bogus"):
        engine.generate("x", {"bogus": 1})
    with pytest.raises(ContextLengthExceededError):
        engine.generate(long_prompt, {"max_new_tokens": 4})
    with pytest.raises(ValueError, match="prompt 1 of the batch"):
        engine.generate(["ok", "bad"], [{"max_new_tokens": 1}, {"temperature": -1}])
    info = engine.get_server_info()
    assert info["num_pending_requests_in_tokenizer_manager"] == 0
    assert info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 0


def test_inside_running_event_loop(engine):
    async def main():
        # A sync call from inside a running loop (a Jupyter cell): blocks this loop, not the engine's.
        sync_result = engine.generate("Hello, my name is", {"max_new_tokens": 4, **GREEDY})
        async_result = await engine.async_generate("Hello, my name is", {"max_new_tokens": 4, **GREEDY})
        stream = await engine.async_generate("Hello, my name is", {"max_new_tokens": 4, **GREEDY}, stream=True)
        chunks = [chunk async for chunk in stream]
        both = await asyncio.gather(
            engine.async_generate("One", {"max_new_tokens": 3, **GREEDY}),
            engine.async_generate("Two", {"max_new_tokens": 3, **GREEDY}),
        )
        info = await engine.async_get_server_info()
        return sync_result, async_result, chunks, both, info

    sync_result, async_result, chunks, both, info = asyncio.run(main())
    assert sync_result["output_ids"] == async_result["output_ids"] == chunks[-1]["output_ids"]
    assert all(r["meta_info"]["completion_tokens"] == 3 for r in both)
    assert "memory" in info

    async def bad():
        with pytest.raises(ValueError):
            await engine.async_generate("x", {"temperature": -1}, stream=True)
        with pytest.raises(ValueError):
            async for _ in engine.generate_request(GenerateReqInput(text="x", sampling_params={"n": 0})):
                pass

    asyncio.run(bad())


def test_from_several_threads(engine):
    results: dict[int, dict] = {}

    def work(i: int) -> None:
        results[i] = engine.generate(PROMPTS[i], {"max_new_tokens": 4, **GREEDY})

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    expected = engine.generate(PROMPTS[:4], {"max_new_tokens": 4, **GREEDY})
    assert [results[i]["output_ids"] for i in range(4)] == [r["output_ids"] for r in expected]


def test_engine_is_a_serving_engine(engine):
    assert isinstance(engine, ServingEngine)  # what create_app serves (tests/engine/test_serving_engine.py)


def test_flush_cache_and_server_info(engine):
    engine.generate("Some prompt to cache", {"max_new_tokens": 1})
    assert engine.flush_cache() is True
    info = engine.get_server_info()
    memory = info["memory"]
    assert memory["free_tokens"] == memory["total_tokens"] == info["max_total_num_tokens"]
    assert memory["evictable_tokens"] == memory["protected_tokens"] == 0
    for key in ("cache", "num_running_reqs", "num_queued_reqs", "token_usage", "context_len", "vocab_size"):
        assert key in info
    assert engine.is_healthy()


def test_cache_tree_shows_a_requests_path(engine):
    """Engine.get_cache_tree: the tree the scheduler holds, as typed structs, with a request's path marked."""
    prompt = engine.tokenizer.encode("A cache tree test: the shared prefix of two requests, then")
    params = {"max_new_tokens": 3, **GREEDY}
    engine.generate(input_ids=prompt + [11, 12], sampling_params=params)
    rid = engine.generate(input_ids=prompt + [13, 14], sampling_params=params)["meta_info"]["id"]
    summary = engine.get_cache_tree(with_token_ids=True, rid=rid)
    (default,) = [ns for ns in summary.namespaces if ns.name == "default"]
    nodes = {node.id: node for node in default.nodes}
    path = summary.path
    assert path.rid == rid and not path.running and path.num_tokens == len(prompt) + 2 + 3
    spelled = [token for node_id in path.node_ids for token in nodes[node_id].token_ids]
    assert spelled[:len(prompt) + 2] == prompt + [13, 14] and len(spelled) == path.cached_tokens
    assert nodes[path.node_ids[0]].hits >= 1  # the first request's prefix, matched by the second
    with pytest.raises(ValueError, match="max_nodes"):
        engine.get_cache_tree(max_nodes=0)
    assert engine.get_cache_tree(rid="no-such-request").path is None and engine.is_healthy()


def test_shutdown_leaves_no_child_processes(engine):
    """Runs last in this module: it shuts the module's engine down (the fixture's own shutdown is a no-op)."""
    pids = list(engine._resources.children.pids().values())
    ipc_dir = engine._resources.ipc.tmp_dir
    assert all(psutil.pid_exists(pid) for pid in pids)
    engine.shutdown()
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not any(child.pid in pids for child in psutil.Process().children(recursive=True))
    assert not os.path.exists(ipc_dir)
    assert not engine.is_healthy()
    with pytest.raises(EngineDeadError, match="shut down"):
        engine.generate("x")
