"""Embeddings, rerank, score and classify on top of pooling requests: what `Engine` and the HTTP routes share.

Each surface builds its pooling `GenerateRequest` here (`embed_request`, `rerank_request`, `score_request`,
`classify_request`), runs it as it runs any request, and turns the vectors into its answer with the functions below,
so the Engine and the server answer alike:

- embeddings: each prompt's L2-normalized vector; `dimensions` keeps the first components and normalizes again
  (Matryoshka truncation, `truncate_embedding`);
- rerank: with an embedding model, the cosine similarity of the query's and each document's embedding; with a
  classifier, the classifier on the query's tokens followed by the document's: the sigmoid of its logit (one label)
  or the probability of its last label (several). Documents are returned best first (`rank_documents`);
- score (SGLang's `/v1/score`): for each item, the probabilities of `label_token_ids` as the next token after
  query + item (item + query with `item_first`): under the whole vocabulary, or with `apply_softmax` renormalized
  over the label tokens alone (`label_probabilities`);
- classify: a classifier's logits, their softmax and the most likely label (`classify_results`).
"""

from __future__ import annotations

import math
from typing import Any, Awaitable, Callable, Optional, Sequence, Union

from radixserve.runtime.wire.messages import ModelInfo
from radixserve.runtime.wire.pooling import PoolingParams
from radixserve.runtime.wire.request import GenerateRequest, RequestFieldError

Prompt = Union[str, list[int]]
Encode = Callable[[str], Awaitable[list[int]]]


def _request(kind: str, prompts: Sequence[Prompt], label_token_ids: Sequence[int] = (), **fields: Any,
             ) -> GenerateRequest:
    """One pooling request over `prompts` (all text, or all token-id lists)."""
    pooling = PoolingParams(kind=kind, label_token_ids=tuple(label_token_ids))  # type: ignore[arg-type]
    if not prompts:
        raise RequestFieldError("the input is empty", "input")
    if all(isinstance(p, str) for p in prompts):
        return GenerateRequest(text=list(prompts), pooling=pooling, **fields)
    if all(isinstance(p, list) for p in prompts):
        return GenerateRequest(input_ids=[list(p) for p in prompts], pooling=pooling, **fields)
    raise RequestFieldError("give every input as text or every input as token ids, not a mix", "input")


def as_prompts(value: Any, name: str) -> list[Prompt]:
    """OpenAI's `input`: a string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [list(value)]
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        return list(value)
    raise RequestFieldError(f"{name} must be a string, a list of strings, a list of token ids or a list of lists of "
                            "token ids", name)


def embed_kind(model: ModelInfo) -> str:
    """What an embedding request of this model returns: its embedding, or a classifier's logits."""
    if "embed" in model.pooling_kinds:
        return "embed"
    if "classify" in model.pooling_kinds:
        return "classify"
    raise RequestFieldError("this model serves no embeddings: start the server with --is-embedding, or serve an "
                            "embedding or classification model")


def embed_request(model: ModelInfo, prompts: Sequence[Prompt], **fields: Any) -> GenerateRequest:
    return _request(embed_kind(model), prompts, **fields)


def classify_request(prompts: Sequence[Prompt], **fields: Any) -> GenerateRequest:
    return _request("classify", prompts, **fields)


def truncate_embedding(vector: list[float], dimensions: Optional[int]) -> list[float]:
    """The first `dimensions` components, normalized again (Matryoshka); the vector itself when None."""
    if dimensions is None:
        return vector
    if not 0 < dimensions <= len(vector):
        raise RequestFieldError(f"dimensions must be in [1, {len(vector)}] (the model's embedding size), got "
                                f"{dimensions}", "dimensions")
    head = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in head))
    return [x / norm for x in head] if norm > 0 else head


async def _ids(prompt: Prompt, encode: Encode) -> list[int]:
    return list(prompt) if isinstance(prompt, list) else list(await encode(prompt))


async def rerank_request(model: ModelInfo, query: Prompt, documents: Sequence[Prompt], encode: Encode,
                         **fields: Any) -> GenerateRequest:
    """With an embedding model, the query then each document; with a classifier, each query + document pair."""
    if not documents:
        raise RequestFieldError("documents must not be empty", "documents")
    if "embed" in model.pooling_kinds:
        return _request("embed", [query, *documents], **fields)
    if "classify" not in model.pooling_kinds:
        raise RequestFieldError("rerank needs an embedding model or a sequence classifier; this model generates "
                                "(its next-token probabilities are served by /v1/score)")
    query_ids = await _ids(query, encode)
    return _request("classify", [query_ids + await _ids(doc, encode) for doc in documents], **fields)


def relevance_scores(model: ModelInfo, vectors: list[list[float]]) -> list[float]:
    """Each document's relevance from the vectors of `rerank_request` (see the module docstring)."""
    if "embed" in model.pooling_kinds:
        query, documents = vectors[0], vectors[1:]
        return [sum(q * d for q, d in zip(query, doc)) for doc in documents]  # both are unit vectors
    scores = []
    for logits in vectors:
        if len(logits) == 1:
            scores.append(_sigmoid(logits[0]))
        else:
            scores.append(_softmax(logits)[-1])
    return scores


def rank_documents(scores: list[float], documents: Sequence[Prompt], top_n: Optional[int],
                   return_documents: bool) -> list[dict[str, Any]]:
    """Jina/Cohere's results: `index`, `relevance_score` (and `document`), best first, the first `top_n`."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if top_n is not None:
        order = order[:top_n]
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if return_documents:
            document = documents[i]
            item["document"] = {"text": document} if isinstance(document, str) else {"token_ids": document}
        results.append(item)
    return results


async def score_request(query: Prompt, items: Sequence[Prompt], label_token_ids: Sequence[int], item_first: bool,
                        encode: Encode, **fields: Any) -> GenerateRequest:
    """One prompt per item: query + item (item + query with `item_first`), as text when both are text."""
    if not items:
        raise RequestFieldError("items must not be empty", "items")
    prompts: list[Prompt] = []
    for item in items:
        first, second = (item, query) if item_first else (query, item)
        if isinstance(first, str) and isinstance(second, str):
            prompts.append(first + second)
        else:
            prompts.append(await _ids(first, encode) + await _ids(second, encode))
    if not all(isinstance(p, str) for p in prompts):
        prompts = [await _ids(p, encode) for p in prompts]
    return _request("score", prompts, label_token_ids, **fields)


def label_probabilities(logprobs: list[float], apply_softmax: bool) -> list[float]:
    """Probabilities of the label tokens from their log-probabilities under the whole vocabulary."""
    return _softmax(logprobs) if apply_softmax else [math.exp(x) for x in logprobs]


def classify_results(model: ModelInfo, vectors: list[list[float]]) -> list[dict[str, Any]]:
    """vLLM's classification data: per input its `label`, `probs` (softmax of the logits) and `num_classes`."""
    results = []
    for index, logits in enumerate(vectors):
        probs = _softmax(logits)
        best = max(range(len(probs)), key=probs.__getitem__)
        label = model.labels[best] if best < len(model.labels) else f"LABEL_{best}"
        results.append({"index": index, "label": label, "probs": probs, "logits": logits,
                        "num_classes": len(probs)})
    return results


def usage(results: list[dict[str, Any]]) -> dict[str, int]:
    tokens = sum(r["meta_info"]["prompt_tokens"] for r in results)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)  # no overflow for very negative logits
    return z / (1.0 + z)


def _softmax(values: Sequence[float]) -> list[float]:
    top = max(values)
    weights = [math.exp(v - top) for v in values]
    total = sum(weights)
    return [w / total for w in weights]
