"""A batch's per-request sampling parameters as tensors, built once per step for the Sampler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from radixserve.model_runner.penalties import LogitAdjustments
from radixserve.runtime.wire.messages import SamplingParams

_MASK64 = (1 << 64) - 1
_UNIFORM_BITS = 24  # a float32 in [0, 1) holds 24 bits exactly


def _splitmix64(x: int) -> int:
    """SplitMix64's finaliser: a bijective 64-bit mix, so nearby inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, step: int) -> float:
    """The uniform in [0, 1) that drives a seeded request's draw at output position `step`.

    A pure function of (seed, step): the draw does not depend on the batch the request runs in, on
    the device's random state, or on how many steps ran before (a retracted and re-run request
    redraws the same tokens). It has 24 bits, exactly representable in float32.
    """
    mixed = _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))
    return (mixed >> (64 - _UNIFORM_BITS)) / float(1 << _UNIFORM_BITS)


@dataclass
class SamplingBatchInfo:
    """Tensors for one sampling step of a batch of `bs` requests over a vocabulary of `vocab_size`.

    Row i of every `[bs]` tensor is request i. Greedy rows (temperature 0 or top_k 1) take the argmax
    of the adjusted logits; the other rows (`sampled_rows`) are sampled. The `need_*` flags look at
    sampled rows only, so a batch of greedy requests without penalties is a plain argmax.
    """

    vocab_size: int
    temperatures: torch.Tensor  # [bs, 1]; 1.0 on greedy rows, which never divide by it
    top_ps: torch.Tensor  # [bs]; 1.0 = off
    top_ks: torch.Tensor  # [bs] int64; vocab_size = off
    min_ps: torch.Tensor  # [bs]; 0.0 = off
    is_greedy: torch.Tensor  # [bs] bool
    sampled_rows: torch.Tensor  # [n_sampled] int64, the rows that are not greedy, ascending
    seeded: torch.Tensor  # [bs] bool: the request has a seed
    seeded_uniforms: torch.Tensor  # [bs] float32: seeded_uniform(seed, len(output)); 0 when unseeded
    all_greedy: bool
    any_greedy: bool
    any_unseeded_sampled: bool  # whether the global generator is drawn from at all
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    max_top_k: int  # the largest active top_k among sampled rows (0 when none)
    adjustments: Optional[LogitAdjustments]  # None when no row has penalties, bias or bans

    @property
    def batch_size(self) -> int:
        return int(self.is_greedy.shape[0])

    @property
    def need_penalties(self) -> bool:
        return self.adjustments is not None and self.adjustments.need_penalties

    @property
    def need_logit_adjustments(self) -> bool:
        return self.adjustments is not None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
        *,
        prompt_ids: Optional[Sequence[Sequence[int]]] = None,
        banned_token_ids: Optional[Sequence[Sequence[int]]] = None,
    ) -> "SamplingBatchInfo":
        """Build the tensors for `params[i]` with `output_ids[i]` generated so far.

        `len(output_ids[i])` is the step index of a seeded request's draw, and the history of its
        frequency / presence penalties. `prompt_ids[i]` is needed only when a request has
        `repetition_penalty != 1`. `banned_token_ids[i]` are ids masked to -inf for request i at this
        step (EOS / stop ids while below `min_new_tokens`; the scheduler decides). Everything is
        computed host-side here, so sampling makes no device-to-host round trip for its decisions.
        The parameters were checked once, when the request entered (SamplingParams.from_request); nothing here
        re-checks their values. Raises ValueError only when the lists do not match the batch.
        """
        device = torch.device(device)
        bs = len(params)
        if len(output_ids) != bs:
            raise ValueError("output_ids must have one list per request")
        if prompt_ids is not None and len(prompt_ids) != bs:
            raise ValueError("prompt_ids must have one list per request")

        greedy = [p.is_greedy() for p in params]
        sampled = [i for i in range(bs) if not greedy[i]]
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        active_top_ks = [top_ks[i] for i in sampled if top_ks[i] < vocab_size]
        uniforms = [
            seeded_uniform(p.seed, len(out)) if p.seed is not None else 0.0 for p, out in zip(params, output_ids)
        ]

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            vocab_size=vocab_size,
            temperatures=floats([[1.0 if greedy[i] else p.temperature] for i, p in enumerate(params)]).view(bs, 1),
            top_ps=floats([p.top_p for p in params]),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=floats([p.min_p for p in params]),
            is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            sampled_rows=torch.tensor(sampled, dtype=torch.int64, device=device),
            seeded=torch.tensor([p.seed is not None for p in params], dtype=torch.bool, device=device),
            seeded_uniforms=torch.tensor(uniforms, dtype=torch.float32, device=device),
            all_greedy=not sampled,
            any_greedy=len(sampled) < bs,
            any_unseeded_sampled=any(params[i].seed is None for i in sampled),
            need_top_k=bool(active_top_ks),
            need_top_p=any(params[i].top_p < 1.0 for i in sampled),
            need_min_p=any(params[i].min_p > 0.0 for i in sampled),
            max_top_k=max(active_top_ks, default=0),
            adjustments=LogitAdjustments.build(
                params, output_ids, vocab_size, device, dtype, prompt_ids=prompt_ids, banned_token_ids=banned_token_ids
            ),
        )
