"""Pooling requests against Hugging Face references: last-token, mean and CLS embeddings (a tiny Qwen3 and a tiny
BERT encoder), a sequence classifier's logits, and score's label log-probabilities, through a real Scheduler
(tests/scheduler_driver.py) with its invariants checked after every step."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
import transformers

from radixserve.runtime.wire.pooling import PoolingParams
from scheduler_driver import SchedulerDriver

EMBED = PoolingParams(kind="embed")
# Prompts sharing a head (the radix cache serves it to the later ones) and one longer than the chunk size.
PROMPTS = [list(range(10, 40)), list(range(10, 30)) + [7, 8, 9], list(range(10, 40)) + [99, 98], list(range(50, 120))]


def _cosine_distance(got: list[float], ref: torch.Tensor) -> float:
    return 1.0 - float(F.cosine_similarity(torch.tensor(got, dtype=torch.float64), ref.double(), dim=0))


def _run(driver: SchedulerDriver, prompts, pooling, **sampling) -> list:
    for i, ids in enumerate(prompts):
        driver.submit(f"p{i}", ids, pooling=pooling, max_new_tokens=0, **sampling)
    results = driver.run_until_idle()
    return [results[f"p{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def qwen3_dir(tiny_model_dir) -> str:
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("tiny-bert"))
    config = transformers.BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=256)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformers.BertModel(config).save_pretrained(out)
    return out


def _hf_hidden(model_dir: str, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0]


@pytest.mark.parametrize("method", ["last", "mean", "cls"])
def test_qwen3_embeddings_match_hf_pooling(qwen3_dir, method):
    """Chunked prompts, a shared cached prefix (last-token pooling reuses it) and every prompt within 1e-5. Last and
    CLS run the last layer's feed-forward on the pooled rows alone."""
    driver = SchedulerDriver(qwen3_dir, is_embedding=True, pooling_method=method, chunked_prefill_size=32)
    results = _run(driver, PROMPTS, EMBED)
    driver.close()
    for ids, result in zip(PROMPTS, results):
        hidden = _hf_hidden(qwen3_dir, ids)
        ref = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[method]
        assert result.finish_reason == {"type": "length", "length": 0} and result.output_ids == []
        assert _cosine_distance(result.embedding, ref) < 1e-5
        assert abs(float(torch.tensor(result.embedding).norm()) - 1.0) < 1e-6
    cached = [r.cached_tokens for r in results]
    assert (cached[2] > 0) == (method == "last"), cached  # mean pooling computes every token's hidden state


def test_sentence_transformers_config_picks_the_method(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("qwen3", seed=1)
    os.makedirs(tmp_path / "1_Pooling")
    for name in os.listdir(model_dir):
        os.symlink(os.path.join(model_dir, name), tmp_path / name)
    (tmp_path / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "", "type":
                                                        "sentence_transformers.models.Transformer"},
                                                       {"idx": 1, "name": "1", "path": "1_Pooling",
                                                        "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    driver = SchedulerDriver(str(tmp_path), is_embedding=True)
    assert driver.server_report().model.pooling_method == "mean"
    [result] = _run(driver, PROMPTS[:1], EMBED)
    driver.close()
    assert _cosine_distance(result.embedding, _hf_hidden(model_dir, PROMPTS[0]).mean(0)) < 1e-5


@pytest.mark.parametrize("method", ["cls", "mean"])
def test_bert_encoder_embeddings_match_hf(bert_dir, method):
    """Bidirectional attention; a prompt longer than the chunk size is computed whole, and no KV is shared."""
    driver = SchedulerDriver(bert_dir, pooling_method=method, chunked_prefill_size=32)
    results = _run(driver, PROMPTS, EMBED)
    model = driver.server_report().model
    driver.close()
    assert model.pooling_kinds == ["embed"] and not model.is_generation and not model.radix_cache
    for ids, result in zip(PROMPTS, results):
        hidden = _hf_hidden(bert_dir, ids)
        ref = hidden[0] if method == "cls" else hidden.mean(0)
        assert _cosine_distance(result.embedding, ref) < 1e-5
        assert result.cached_tokens == 0


def test_encoder_refuses_generation(bert_dir):
    driver = SchedulerDriver(bert_dir)
    driver.submit("gen", [1, 2, 3], max_new_tokens=2)
    driver.submit("score", [1, 2, 3], pooling=PoolingParams(kind="score", label_token_ids=(1,)), max_new_tokens=0)
    results = driver.run_until_idle()
    driver.close()
    assert "does not generate" in results["gen"].finish_reason["message"]
    assert "cannot serve score" in results["score"].finish_reason["message"]


def test_sequence_classifier_logits_match_hf(tmp_path_factory):
    model_dir = str(tmp_path_factory.mktemp("tiny-qwen3-cls"))
    config = transformers.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=512, num_labels=3, pad_token_id=0,
                                      id2label={0: "neg", 1: "neutral", 2: "pos"},
                                      label2id={"neg": 0, "neutral": 1, "pos": 2})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        reference = transformers.Qwen3ForSequenceClassification(config).eval()
    reference.save_pretrained(model_dir)
    driver = SchedulerDriver(model_dir, chunked_prefill_size=32)
    results = _run(driver, PROMPTS, PoolingParams(kind="classify"))
    model = driver.server_report().model
    driver.close()
    assert model.labels == ["neg", "neutral", "pos"] and model.pooling_kinds == ["classify"]
    for ids, result in zip(PROMPTS, results):
        with torch.no_grad():
            ref = reference(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(torch.tensor(result.embedding), ref, rtol=1e-4, atol=1e-5)


def test_score_batched_with_generation(qwen3_dir):
    """Score requests ride in generation's batches; the generation output is unchanged and the label
    log-probabilities are Hugging Face's."""
    labels = (5, 17, 300)
    alone = SchedulerDriver(qwen3_dir)
    alone.submit("gen", PROMPTS[0], max_new_tokens=8)
    expected = alone.run_until_idle()["gen"].output_ids
    alone.close()
    driver = SchedulerDriver(qwen3_dir)
    driver.submit("gen", PROMPTS[0], max_new_tokens=8)
    results = _run(driver, PROMPTS[1:], PoolingParams(kind="score", label_token_ids=labels))
    driver.close()
    assert driver.results["gen"].output_ids == expected
    model = transformers.AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    for ids, result in zip(PROMPTS[1:], results):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)[list(labels)]
        torch.testing.assert_close(torch.tensor(result.embedding), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["last", "cls"])
def test_pooled_rows_alone_equal_the_full_forward(qwen3_dir, method):
    """The last layer's feed-forward run on the pooled rows alone gives those rows' final hidden states of the whole
    forward, and every token's K/V still goes to the pool (a later request may extend the prompt)."""
    from radixserve.model_runner.forward_batch import ForwardMode
    from radixserve.model_runner.model_runner import ModelRunner
    from radixserve.model_runner.pooling import pool_hidden, pooled_rows
    from radixserve.model_runner.runner_config import RunnerConfig
    from radixserve.model_runner.static_generate import assign_kv_slots, make_forward_batch
    from radixserve.runtime.wire.server_args import ServerArgs

    runner = ModelRunner(RunnerConfig.from_server_args(ServerArgs(
        model_path=qwen3_dir, device="cpu", dtype="float32", is_embedding=True, pooling_method=method,
        max_total_tokens=1024, max_running_requests=8)))
    assert runner.model.selects_rows
    assert runner.model.logits_head is None  # its LM head never runs: no copy of it is made for the CPU kernels
    prompts = PROMPTS[:3]
    entries = torch.tensor([0, 2])  # not every entry pools: the rows are the pooled entries' only
    outputs, kv = [], []
    for select in (False, True):
        rows = [runner.req_to_token_pool.alloc() for _ in prompts]
        loc = assign_kv_slots(runner.allocator, runner.req_to_token_pool, rows, [0] * len(prompts),
                              [len(p) for p in prompts])
        batch = make_forward_batch(ForwardMode.EXTEND, rows, [0] * len(prompts), prompts, loc,
                                   runner.req_to_token_pool, runner.token_to_kv_pool)
        selected = pooled_rows(batch, entries, method) if select else None
        with torch.inference_mode():
            hidden = runner._hidden_states(batch, selected)
        outputs.append(pool_hidden(hidden, batch, entries, method, selected=select))
        last_layer = runner.token_to_kv_pool.get_kv_buffer(runner.model_config.num_hidden_layers - 1)
        kv.append([buffer[loc].clone() for buffer in last_layer])
    full, alone = outputs
    assert alone.shape == (2, runner.model_config.hidden_size)
    torch.testing.assert_close(alone, full, rtol=1e-5, atol=1e-5)
    for got, want in zip(kv[1], kv[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_model_that_only_pools_takes_large_chunks_on_the_cpu(qwen3_dir):
    """No decode step waits between a pooling model's chunks, so the CPU's small default chunk does not apply to it;
    an explicit --chunked-prefill-size still does."""
    chunks = []
    for args in ({"is_embedding": True}, {}, {"is_embedding": True, "chunked_prefill_size": 32}):
        driver = SchedulerDriver(qwen3_dir, **args)
        chunks.append(driver.scheduler.chunk_size)
        driver.close()
    assert chunks == [8192, 512, 32]
