"""How `select` scores its choices: token boundaries, one batched logprob request, and the scoring methods.

Token boundaries. The program's text so far (the prefix) and prefix + choice are tokenized separately; the
choice's tokens are those of prefix + choice after their common token prefix. This may re-cover the end of
the prefix: "The capital of France is " + "Paris" tokenizes as [..., " is", " Paris"] while the prefix alone
ends [..., " is", " "], so the scored tokens are [" Paris"], not a stray " " followed by "Paris". Every
choice is scored on the tokens the model would really see, and all of them on the same context.

Requests. The prefix is prefilled once (a max_new_tokens=0 request, so the radix cache holds it), then every
choice (and, for the unconditional method, every choice after a bare BOS/EOS context) is scored in ONE
batched request for prompt-token logprobs.

Methods (higher score wins; ties go to the earlier choice):
- `token_length_normalized` (default): the mean logprob of the choice's tokens.
- `greedy_token_selection`: what greedy decoding would pick: the best first-token logprob; choices that
  share that token are compared on the next one, and so on; a choice whose tokens end while still tied wins.
- `unconditional_likelihood_normalized`: the mean over the choice's tokens of logprob(token | prefix) minus
  logprob(token | BOS), which discounts choices that are likely whatever the context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from radixserve.frontend.backends.base import Backend


class ChoicesMethod:
    """A way to score choices from their token logprobs. `needs_unconditional`: whether it also needs
    each choice's logprobs after a bare BOS/EOS context."""

    name = "abstract"
    needs_unconditional = False

    def scores(self, token_logprobs: list[list[float]], unconditional: Optional[list[list[float]]],
               token_ids: list[list[int]]) -> list[float]:
        raise NotImplementedError

    def decide(self, scores: list[float], token_logprobs: list[list[float]], token_ids: list[list[int]]) -> int:
        """The index of the chosen choice: the best score, the first one on ties."""
        return max(range(len(scores)), key=lambda i: (scores[i], -i))

    def __repr__(self) -> str:
        return self.name


class TokenLengthNormalized(ChoicesMethod):
    name = "token_length_normalized"

    def scores(self, token_logprobs, unconditional, token_ids):
        return [_mean(logprobs) for logprobs in token_logprobs]


class GreedyTokenSelection(ChoicesMethod):
    name = "greedy_token_selection"

    def scores(self, token_logprobs, unconditional, token_ids):
        return [logprobs[0] for logprobs in token_logprobs]

    def decide(self, scores, token_logprobs, token_ids):
        candidates = list(range(len(token_ids)))
        position = 0
        while len(candidates) > 1:
            finished = [i for i in candidates if position >= len(token_ids[i])]
            if finished:
                return finished[0]
            best = max(candidates, key=lambda i: (token_logprobs[i][position], -i))
            # Same token at this position, same context so far: greedy decoding cannot tell them apart yet.
            candidates = [i for i in candidates if token_ids[i][position] == token_ids[best][position]]
            position += 1
        return candidates[0]


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    name = "unconditional_likelihood_normalized"
    needs_unconditional = True

    def scores(self, token_logprobs, unconditional, token_ids):
        assert unconditional is not None
        return [_mean([c - u for c, u in zip(cond, uncond)]) for cond, uncond in zip(token_logprobs, unconditional)]


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()


@dataclass
class ChoiceScores:
    """The outcome of one select: `decision` indexes `choices`; per choice its method score, mean token
    logprob, the scored token ids, their texts and logprobs (and unconditional logprobs when the method used
    them)."""

    choices: list[str]
    method: str
    decision: int
    scores: list[float]
    normalized_logprobs: list[float]
    token_ids: list[list[int]]
    token_texts: list[list[str]]
    token_logprobs: list[list[float]]
    unconditional_logprobs: Optional[list[list[float]]] = None

    @property
    def choice(self) -> str:
        return self.choices[self.decision]

    def meta_info(self) -> dict[str, Any]:
        """Our fields, plus SGLang's keys: `normalized_prompt_logprobs` (the mean token logprob per choice),
        `input_token_logprobs` (per choice, [logprob, token_id, token_text] per scored token),
        `output_token_logprobs` (empty per choice: a select generates nothing), and for the unconditional
        method `unconditional_token_logprobs` (same shape) and `normalized_unconditional_prompt_logprobs`."""
        info: dict[str, Any] = {name: value for name, value in self.__dict__.items()
                                if name != "unconditional_logprobs"}
        info["normalized_prompt_logprobs"] = self.normalized_logprobs
        info["input_token_logprobs"] = self._entries(self.token_logprobs)
        info["output_token_logprobs"] = [[] for _ in self.choices]
        if self.unconditional_logprobs is not None:
            info["unconditional_token_logprobs"] = self._entries(self.unconditional_logprobs)
            info["normalized_unconditional_prompt_logprobs"] = self.scores
        return info

    def _entries(self, logprobs: list[list[float]]) -> list[list[list[Any]]]:
        return [[[logprob, token_id, text] for logprob, token_id, text in zip(lps, ids, texts)]
                for lps, ids, texts in zip(logprobs, self.token_ids, self.token_texts)]


def choice_span(prefix_ids: list[int], full_ids: list[int]) -> int:
    """Where the scored tokens of prefix + choice begin: after the common token prefix with the prefix alone,
    and never at position 0 (the first token of a prompt has no logprob)."""
    common = 0
    for a, b in zip(prefix_ids, full_ids):
        if a != b:
            break
        common += 1
    return max(common, 1)


def score_choices(backend: Backend, prefix: str, choices: list[str], method: ChoicesMethod) -> ChoiceScores:
    """Score `choices` as continuations of `prefix` on `backend` (see the module docstring).

    Raises ValueError for no choices, an empty choice, or a choice that adds no token to score (an empty
    prefix and a one-token choice); BackendError when the backend returns no prompt logprobs.
    """
    if not choices:
        raise ValueError("select needs at least one choice")
    if any(not choice for choice in choices):
        raise ValueError("select choices must be non-empty strings")
    prefix_ids = backend.encode(prefix)
    prompts, starts = [], []
    for choice in choices:
        full_ids = backend.encode(prefix + choice)
        start = choice_span(prefix_ids, full_ids)
        if start >= len(full_ids):
            raise ValueError(f"choice {choice!r} has no token to score after an empty prefix")
        prompts.append(full_ids)
        starts.append(start)
    token_ids = [full[start:] for full, start in zip(prompts, starts)]
    if prefix_ids and len(choices) > 1:
        backend.prefill(prefix)  # computed once; every choice below then matches it in the radix cache
    requests, request_starts = list(prompts), list(starts)
    if method.needs_unconditional:
        context = [unconditional_context_token(backend.tokenizer)]
        requests += [context + ids for ids in token_ids]
        request_starts += [len(context)] * len(choices)
    logprobs = backend.prompt_logprobs(requests, request_starts)
    conditional = logprobs[:len(choices)]
    unconditional = logprobs[len(choices):] if method.needs_unconditional else None
    scores = method.scores(conditional, unconditional, token_ids)
    return ChoiceScores(
        choices=list(choices),
        method=method.name,
        decision=method.decide(scores, conditional, token_ids),
        scores=scores,
        normalized_logprobs=[_mean(lps) for lps in conditional],
        token_ids=token_ids,
        token_texts=[[backend.decode([token_id]) for token_id in ids] for ids in token_ids],
        token_logprobs=conditional,
        unconditional_logprobs=unconditional,
    )


def unconditional_context_token(tokenizer: Any) -> int:
    """The context of the unconditional scores: the BOS token, else EOS (a document boundary)."""
    for name in ("bos_token_id", "eos_token_id"):
        token_id = getattr(tokenizer, name, None)
        if token_id is not None:
            return int(token_id)
    raise ValueError("unconditional_likelihood_normalized needs a tokenizer with a BOS or EOS token")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
