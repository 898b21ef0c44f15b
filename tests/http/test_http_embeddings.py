"""/v1/embeddings, /v1/rerank, /v1/score and /classify over HTTP: a real server of a tiny random Qwen3 served with
--is-embedding, driven by the official `openai` client and LangChain's `OpenAIEmbeddings`, against Hugging Face's
pooling of the same model; and /v1/score on the suite's generative server against its own sampler's logprobs."""

from __future__ import annotations

import base64
import math
import struct

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
import transformers

from http_fixtures import ServerProcess, shared_server

TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors.", "The capital of France is"]


@pytest.fixture(scope="module")
def embed_dir(tiny_model_dir) -> str:
    return tiny_model_dir("qwen3", with_tokenizer=True)


@pytest.fixture(scope="module")
def server(embed_dir):
    server = ServerProcess("--model-path", embed_dir, "--is-embedding", "--log-level", "warning")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(embed_dir):
    """Hugging Face's last-token pooling, normalized, of a text (tokenized as the server tokenizes it)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(embed_dir)
    model = transformers.AutoModel.from_pretrained(embed_dir, dtype=torch.float32)

    def embed(text_or_ids) -> torch.Tensor:
        ids = tokenizer(text_or_ids).input_ids if isinstance(text_or_ids, str) else text_or_ids
        with torch.no_grad():
            return F.normalize(model(torch.tensor([ids])).last_hidden_state[0, -1].double(), dim=0)

    return embed


def _close(got, ref: torch.Tensor, tol: float = 1e-5) -> bool:
    return 1.0 - float(F.cosine_similarity(torch.tensor(got, dtype=torch.float64), ref, dim=0)) < tol


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]


def test_openai_client_embeddings_match_hf(server, reference, model):
    client = _client(server)
    response = client.embeddings.create(model=model, input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in response.data] == [0, 1, 2]
    for item, text in zip(response.data, TEXTS):
        assert _close(item.embedding, reference(text))
    assert response.usage.prompt_tokens == response.usage.total_tokens > 0
    # The same batch as floats. Its prompts now hit the radix cache, and attention over cached keys sums in another
    # order than over keys computed in the batch: float32 agrees to its last bits, not bit for bit.
    floats = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    for as_float, as_base64 in zip(floats.data, response.data):
        assert as_float.embedding == pytest.approx(as_base64.embedding, abs=1e-6)


def test_token_id_inputs(server, reference, model):
    client = _client(server)
    ids = [[5, 6, 7, 8], [5, 6, 7, 9, 10]]
    response = client.embeddings.create(model=model, input=ids, encoding_format="float")
    for item, one in zip(response.data, ids):
        assert _close(item.embedding, reference(one))
    single = client.embeddings.create(model=model, input=ids[0], encoding_format="float")
    assert len(single.data) == 1 and _close(single.data[0].embedding, reference(ids[0]))


def test_matryoshka_dimensions(server, reference):
    """`dimensions` keeps the first components and normalizes again: the truncated, renormalized reference."""
    response = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS[1], "dimensions": 16,
                                                               "encoding_format": "base64"}, timeout=60)
    assert response.status_code == 200, response.text
    vector = list(struct.unpack("<16f", base64.b64decode(response.json()["data"][0]["embedding"])))
    ref = F.normalize(reference(TEXTS[1])[:16], dim=0)
    assert _close(vector, ref) and abs(math.sqrt(sum(x * x for x in vector)) - 1) < 1e-6
    too_big = httpx.post(server.url + "/v1/embeddings", json={"input": "x", "dimensions": 100000}, timeout=60)
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "dimensions"


def test_langchain_openai_embeddings(server, reference, model):
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(model=model, base_url=server.url + "/v1", api_key="unused",
                                  check_embedding_ctx_length=False)  # token counting would fetch tiktoken's tables
    documents = embeddings.embed_documents(TEXTS[:2])
    assert all(_close(got, reference(text)) for got, text in zip(documents, TEXTS[:2]))
    assert _close(embeddings.embed_query(TEXTS[2]), reference(TEXTS[2]))


def test_rerank_by_embedding_similarity(server, reference):
    query, documents = "capital of France", TEXTS
    response = httpx.post(server.url + "/v1/rerank", json={"query": query, "documents": documents, "top_n": 2},
                          timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    expected = sorted(range(3), key=lambda i: -float(reference(query) @ reference(documents[i])))
    assert [r["index"] for r in body["results"]] == expected[:2]
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(float(reference(query) @ reference(documents[result["index"]])),
                                                          abs=1e-5)
        assert result["document"] == {"text": documents[result["index"]]}


def test_routes_the_model_cannot_serve(server):
    generate = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert generate.status_code == 400 and "does not generate" in generate.json()["error"]["message"]
    score = httpx.post(server.url + "/v1/score", json={"query": "a", "items": ["b"], "label_token_ids": [1]},
                       timeout=60)
    assert score.status_code == 400 and "cannot serve score" in score.json()["error"]["message"]
    classify = httpx.post(server.url + "/classify", json={"input": "a"}, timeout=60)
    assert classify.status_code == 400 and "cannot serve classify" in classify.json()["error"]["message"]
    bad = httpx.post(server.url + "/v1/embeddings", json={"input": []}, timeout=60)
    assert bad.status_code == 400
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200
    server.wait_idle()


def test_score_on_a_generative_server():
    """SGLang's /v1/score: label-token probabilities after query + item, equal to the sampler's logprobs of the
    same next token, and renormalized over the labels with apply_softmax."""
    server = shared_server()
    headers = server.headers()
    query, items = "The capital of France is", [" Paris", " a city"]
    labels = []
    for item in items:
        response = httpx.post(server.url + "/generate", headers=headers, timeout=120, json={
            "text": query + item, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True, "top_logprobs_num": 5})
        labels.append(response.json()["meta_info"]["output_top_logprobs"][0])
    label_ids = [top[1] for top in labels[0][:3]]
    response = httpx.post(server.url + "/v1/score", headers=headers, timeout=120, json={
        "query": query, "items": items, "label_token_ids": label_ids})
    assert response.status_code == 200, response.text
    scores = response.json()["scores"]
    expected = {tid: math.exp(lp) for lp, tid, _ in labels[0]}
    assert scores[0] == pytest.approx([expected[t] for t in label_ids], rel=1e-3)
    softmax = httpx.post(server.url + "/v1/score", headers=headers, timeout=120, json={
        "query": query, "items": items, "label_token_ids": label_ids, "apply_softmax": True}).json()["scores"]
    for probs, raw in zip(softmax, scores):
        assert sum(probs) == pytest.approx(1.0) and probs == pytest.approx([p / sum(raw) for p in raw], rel=1e-4)
    refused = httpx.post(server.url + "/v1/embeddings", headers=headers, json={"input": "x"}, timeout=60)
    assert refused.status_code == 400 and "--is-embedding" in refused.json()["error"]["message"]
