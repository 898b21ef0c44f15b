"""Scheduler counters, the prefill and periodic decode log lines, and the KV tokens in use that they report.

Counters are cumulative over the scheduler's life. `cached_tokens` / `queried_tokens` count each request's
prefix match at its first admission, so the hit rate is "share of prompt tokens served from the cache".
Generation throughput is measured over the window since the previous log line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SchedulerStats:
    num_requests: int = 0  # admitted at least once
    num_finished: int = 0
    num_aborted: int = 0
    num_retractions: int = 0
    num_failed_batches: int = 0  # batches the device could not hold (out of memory); their requests failed
    prefill_tokens_computed: int = 0  # extend tokens run through the model (cached prefix excluded)
    decode_steps: int = 0  # DECODE batches
    extend_batches: int = 0  # EXTEND batches
    mixed_batches: int = 0  # MIXED batches (extend with running requests decoding along)
    partial_chunks: int = 0  # prefill chunks that left the rest of their prompt for a later batch
    forced_syncs: int = 0  # times the overlap scheduler had to wait for the batch in flight
    generated_tokens: int = 0  # output tokens appended
    queried_tokens: int = 0  # prompt tokens at first admission
    cached_tokens: int = 0  # of those, served from the radix cache
    _window_start: float = field(default_factory=time.monotonic)
    _window_tokens: int = 0
    _last_throughput: float = 0.0

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def on_admitted(self, prompt_len: int, cached_len: int) -> None:
        self.num_requests += 1
        self.queried_tokens += prompt_len
        self.cached_tokens += cached_len

    def on_batch(self, batch) -> None:
        """Count a ScheduleBatch that is about to run."""
        self.prefill_tokens_computed += sum(batch.extend_lens) - len(batch.table_entries)
        self.partial_chunks += batch.samples_output.count(False)
        if batch.mode.name == "EXTEND":
            self.extend_batches += 1
        elif batch.mode.name == "MIXED":
            self.mixed_batches += 1

    def on_tokens(self, num_tokens: int) -> None:
        self.generated_tokens += num_tokens
        self._window_tokens += num_tokens

    def gen_throughput(self) -> float:
        """Output tokens/s over the current window (the last closed window when it is still empty)."""
        elapsed = time.monotonic() - self._window_start
        if self._window_tokens and elapsed > 0:
            return self._window_tokens / elapsed
        return self._last_throughput

    def close_window(self) -> float:
        throughput = self.gen_throughput()
        self._last_throughput = throughput
        self._window_start = time.monotonic()
        self._window_tokens = 0
        return throughput

    def as_dict(self) -> dict:
        return {
            "num_requests": self.num_requests,
            "num_finished": self.num_finished,
            "num_aborted": self.num_aborted,
            "num_retractions": self.num_retractions,
            "prefill_tokens_computed": self.prefill_tokens_computed,
            "decode_steps": self.decode_steps,
            "extend_batches": self.extend_batches,
            "mixed_batches": self.mixed_batches,
            "partial_chunks": self.partial_chunks,
            "forced_syncs": self.forced_syncs,
            "generated_tokens": self.generated_tokens,
            "gen_throughput": self.gen_throughput(),
        }


def prefill_log_line(
    num_new_seqs: int, new_tokens: int, cached_tokens: int, used_tokens: int, total_tokens: int, num_running: int,
    num_queued: int
) -> str:
    usage = used_tokens / total_tokens if total_tokens else 0.0
    return (
        f"Prefill batch. #new-seq: {num_new_seqs}, #new-token: {new_tokens}, #cached-token: {cached_tokens}, "
        f"token usage: {usage:.2f}, #running-req: {num_running}, #queue-req: {num_queued}"
    )


def decode_log_line(
    num_running: int, num_queued: int, used_tokens: int, total_tokens: int, hit_rate: float, throughput: float
) -> str:
    usage = used_tokens / total_tokens if total_tokens else 0.0
    return (
        f"Decode batch. #running-req: {num_running}, #queue-req: {num_queued}, #token: {used_tokens}, "
        f"token usage: {usage:.2f}, cache hit rate: {hit_rate:.2%}, gen throughput (token/s): {throughput:.2f}"
    )


def used_kv_tokens(allocator: Any, cache: Any) -> int:
    """KV slots in use by requests: neither free nor held by the cache for reuse only (evictable)."""
    return allocator.size - allocator.available_size() - cache.evictable_size()
