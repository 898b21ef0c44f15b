"""Engine.encode, Engine.rerank and Engine.score against Hugging Face references on tiny random models."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import transformers

from radixserve import Engine

QUERY = [11, 12, 13, 14]
DOCUMENTS = [[20, 21, 22], [11, 12, 30, 31, 32, 33], [40, 41], [50, 51, 52, 53, 54]]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    """A tiny Qwen3ForSequenceClassification with one label (a cross-encoder reranker) and its HF reference."""
    model_dir = str(tmp_path_factory.mktemp("tiny-qwen3-reranker"))
    config = transformers.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=512, num_labels=1, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        reference = transformers.Qwen3ForSequenceClassification(config).eval()
        with torch.no_grad():
            reference.score.weight.normal_(0.0, 1.0)  # spread the scores, so the order is well defined
    reference.save_pretrained(model_dir)
    return model_dir, reference


def test_rerank_with_a_classifier_matches_hf(reranker):
    model_dir, reference = reranker
    with torch.no_grad():
        expected = [float(torch.sigmoid(reference(torch.tensor([QUERY + doc])).logits[0, 0])) for doc in DOCUMENTS]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    with Engine(model_path=model_dir, log_level="warning") as engine:
        ranked = engine.rerank(QUERY, DOCUMENTS)
        top = engine.rerank(QUERY, DOCUMENTS, top_n=2, return_documents=True)
        with pytest.raises(ValueError, match="does not generate"):
            engine.generate(input_ids=QUERY, sampling_params={"max_new_tokens": 2})
        logits = engine.encode(QUERY + DOCUMENTS[0])["embedding"]  # a classifier's encode is its logits
    assert [r["index"] for r in ranked] == order
    assert [r["relevance_score"] for r in ranked] == pytest.approx([expected[i] for i in order], abs=1e-5)
    assert [r["index"] for r in top] == order[:2] and top[0]["document"] == {"token_ids": DOCUMENTS[order[0]]}
    assert 1 / (1 + math.exp(-logits[0])) == pytest.approx(expected[0], abs=1e-5)


def test_encode_with_matryoshka_dimensions(tiny_model_dir):
    model_dir = tiny_model_dir("qwen3")
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        refs = [F.normalize(model(torch.tensor([ids])).last_hidden_state[0, -1].double(), dim=0)
                for ids in DOCUMENTS]
    with Engine(model_path=model_dir, is_embedding=True, log_level="warning") as engine:
        full = engine.encode(DOCUMENTS)
        short = engine.encode(DOCUMENTS, dimensions=24)
        single = engine.encode(DOCUMENTS[0])
        with pytest.raises(ValueError, match="dimensions"):
            engine.encode(DOCUMENTS[0], dimensions=65)
        with pytest.raises(ValueError, match="cannot serve score"):
            engine.score(QUERY, DOCUMENTS, label_token_ids=[1])
    for got, ref in zip(full, refs):
        assert 1 - float(F.cosine_similarity(torch.tensor(got["embedding"], dtype=torch.float64), ref, dim=0)) < 1e-5
        assert got["meta_info"]["finish_reason"]["type"] == "length"
    for got, ref in zip(short, refs):
        truncated = F.normalize(ref[:24], dim=0)
        assert len(got["embedding"]) == 24
        assert 1 - float(F.cosine_similarity(torch.tensor(got["embedding"], dtype=torch.float64), truncated, dim=0)) < 1e-5
    assert isinstance(single, dict) and single["embedding"] == pytest.approx(full[0]["embedding"], abs=1e-6)


def test_score_matches_hf_next_token_probabilities(tiny_model_dir):
    model_dir = tiny_model_dir("qwen3")
    labels = [3, 77, 200]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)[labels]

    with Engine(model_path=model_dir, log_level="warning") as engine:
        scores = engine.score(QUERY, DOCUMENTS, label_token_ids=labels)
        normalized = engine.score(QUERY, DOCUMENTS[:2], label_token_ids=labels, apply_softmax=True)
        item_first = engine.score(QUERY, DOCUMENTS[:1], label_token_ids=labels, item_first=True)
        with pytest.raises(ValueError, match="--is-embedding"):
            engine.encode(QUERY)
    for got, doc in zip(scores, DOCUMENTS):
        assert got == pytest.approx(probs(QUERY + doc).tolist(), rel=1e-4, abs=1e-7)
    for got, doc in zip(normalized, DOCUMENTS[:2]):
        ref = probs(QUERY + doc)
        assert got == pytest.approx((ref / ref.sum()).tolist(), rel=1e-4)
    assert item_first[0] == pytest.approx(probs(DOCUMENTS[0] + QUERY).tolist(), rel=1e-4, abs=1e-7)
