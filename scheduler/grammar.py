"""Structured output with xgrammar: grammar compilation off the critical path, the grammar wait queue,
per-request matchers, and the token bitmask that constrains sampling.

A request with `json_schema`, `regex` or `ebnf` in its sampling parameters goes through these stages:

1. `GrammarManager.submit` asks the `GrammarCache` for its compiled grammar. Compilation runs on one worker
   thread (xgrammar releases the GIL), never on the scheduler's thread; the cache is keyed by (kind, text),
   so identical grammars compile once and concurrent requests share one compilation.
2. Until its grammar is ready the request waits in the grammar queue, outside the scheduler's `waiting`
   list; `poll` hands over the ready ones (each with a fresh `GrammarState`) and the failed ones (with a
   message naming the problem; the scheduler finishes only that request, with an abort). A request whose grammar
   has not compiled within `--grammar-compile-timeout` seconds fails the same way, so a grammar built to compile
   for minutes costs its sender an error, not the server a stuck queue (under tensor parallelism every rank must
   admit at the same step, so there the ranks wait for the compilation instead: a clock would differ by rank).
3. Every batch entry that samples an output for such a request gets a row in the batch's `GrammarMask`:
   the tokens the grammar allows next, as xgrammar's packed int32 bitmask. The executor applies it to the
   logits (disallowed tokens -> -inf) after the forward pass and before sampling, whatever the attention
   backend, so greedy picks, draws and output logprobs all see the constrained distribution.
4. Each sampled token is fed to the request's matcher (`GrammarManager.accept`). When the matcher has
   terminated (it accepted an end-of-sequence token in a state where the grammar is complete) the request
   finishes with {"type": "stop"}; where the grammar can go no further, only end-of-sequence tokens are
   allowed, so EOS is forced. A token the matcher refuses (only possible when other bans removed every
   allowed token) aborts the request.

Overlap. The mask of the token sampled at step N+1 depends on the token sampled at step N, which the
overlap scheduler has not seen when it builds batch N+1. So a mask is a promise: the scheduler builds batch
N+1 and launches it; the executor runs its forward pass and then waits for the mask; meanwhile the scheduler
processes batch N's results, feeds the new tokens to the matchers, fills batch N+1's mask and releases it
(`fill_pending`). Only sampling waits; the forward pass still overlaps with the host work. A request that
finished in batch N but already sits in batch N+1 gets no mask row: that extra token is dropped anyway.
Without overlap every mask is complete when its batch is built.

The end-of-sequence tokens the grammar knows are the model's EOS ids (the tokenizer's EOS when the model
names none); a request's own `stop_token_ids` are not allowed inside the grammar.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections import OrderedDict
from typing import Any, Optional, Sequence

import torch

from radixserve.runtime.wire.grammar_check import GRAMMAR_KINDS, grammar_error_message
from radixserve.runtime.wire.messages import FinishReason, SamplingParams

GrammarKey = tuple[str, str]  # (kind, grammar text)

# Compiled grammars kept; a small JSON schema compiled over a 49k vocabulary takes 50-100 KB.
MAX_CACHED_GRAMMARS = 256
COMPILER_THREADS = 2
# The executor gives up on a mask that was never filled after this long: a scheduler bug, not a slow step.
MASK_WAIT_TIMEOUT_S = 120.0


def grammar_key(params: SamplingParams) -> Optional[GrammarKey]:
    """The request's grammar as (kind, text), or None when it has none."""
    for kind in GRAMMAR_KINDS:
        text = getattr(params, kind)
        if text is not None:
            return kind, text
    return None


class GrammarCache:
    """Compiles grammars on a worker thread; one future per (kind, text), least recently used dropped first.

    The xgrammar compiler (and its tokenizer info, which takes a moment to build) is created on the worker
    at the first compilation, so a server that never sees a grammar never pays for it.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 max_entries: int = MAX_CACHED_GRAMMARS) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self.max_entries = max_entries
        self._compiler: Any = None
        self._futures: OrderedDict[GrammarKey, concurrent.futures.Future] = OrderedDict()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixserve-grammar")
        self.num_compiled = 0
        self.num_hits = 0

    def get(self, key: GrammarKey) -> concurrent.futures.Future:
        """The future compiled grammar of `key`; it raises ValueError (naming the problem) when invalid."""
        future = self._futures.get(key)
        if future is not None:
            self._futures.move_to_end(key)
            self.num_hits += 1
            return future
        future = self._pool.submit(self._compile, key)
        self._futures[key] = future
        if len(self._futures) > self.max_entries:
            for old_key, old in list(self._futures.items()):
                if len(self._futures) <= self.max_entries:
                    break
                if old.done():  # one still compiling is still awaited by its requests
                    del self._futures[old_key]
        return future

    def _compile(self, key: GrammarKey) -> Any:
        import xgrammar

        kind, text = key
        if self._compiler is None:
            # A model without EOS ids leaves it to the tokenizer's own end-of-sequence token.
            info = xgrammar.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids or None)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=COMPILER_THREADS)
        try:
            if kind == "json_schema":
                json.loads(text)  # a clearer message for malformed JSON than the converter's
                # Fixed separators rather than free whitespace: a small model can otherwise fill its whole
                # budget with blanks between tokens and never close the object.
                compiled = self._compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "regex":
                compiled = self._compiler.compile_regex(text)
            elif kind == "ebnf":
                compiled = self._compiler.compile_grammar(text)
            else:
                raise ValueError(f"unknown grammar kind {kind!r}")
        except (RuntimeError, ValueError) as error:
            raise ValueError(grammar_error_message(kind, error)) from None
        self.num_compiled += 1
        return compiled

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One request's matcher; `num_accepted` counts the output tokens it has been fed."""

    def __init__(self, compiled: Any) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.num_accepted = 0

    def accept(self, token_id: int) -> Optional[FinishReason]:
        """Feed the next output token; a finish reason when the grammar ends the request here, else None."""
        if not self.matcher.accept_token(int(token_id)):
            return FinishReason.abort(f"token {token_id} does not fit the request's grammar", status_code=500)
        self.num_accepted += 1
        if self.matcher.is_terminated():
            return FinishReason.stop(int(token_id))
        return None

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def allows_a_token(self, vocab_size: int, banned: Sequence[int]) -> bool:
        """Whether the grammar's next step allows some token outside `banned` (checked before the request runs,
        so a grammar that matches nothing, or allows only a banned end, is refused up front)."""
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        self.fill(bitmask, 0)
        bits = (bitmask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.flatten()[:vocab_size].bool()
        if banned:
            allowed[torch.tensor(list(banned), dtype=torch.int64)] = False
        return bool(allowed.any())


class GrammarMask:
    """The allowed next tokens of one batch's grammar entries; filled on the scheduler's thread, applied on the
    executor's (after `release`).

    `entries[i]` is the batch entry of grammar row i and `num_before[i]` how many outputs its request has
    before the token this batch samples for it: the row can be filled once the matcher has accepted exactly
    that many.
    """

    def __init__(self, batch_size: int, vocab_size: int, entries: list[int], reqs: list[Any],
                 num_before: list[int]) -> None:
        import xgrammar

        self.bitmask = xgrammar.allocate_token_bitmask(batch_size, vocab_size)  # all allowed
        self.vocab_size = vocab_size
        self.entries = entries
        self.reqs = reqs
        self.num_before = num_before
        self.filled = [False] * len(entries)
        self.applied_entries: list[int] = []  # rows really constrained (finished requests are not)
        self._ready = threading.Event()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def try_fill(self) -> bool:
        """Fill every row whose matcher is up to date; release the mask (and return True) once all are."""
        for i, (entry, req) in enumerate(zip(self.entries, self.reqs)):
            if self.filled[i]:
                continue
            if req.finished:
                self.filled[i] = True  # its token here is dropped: leave the row unconstrained
                continue
            state = req.grammar
            if state.num_accepted < self.num_before[i]:
                return False  # its previous token is still in flight
            assert state.num_accepted == self.num_before[i], (
                f"{req!r}: matcher at {state.num_accepted} tokens, batch samples output {self.num_before[i]}")
            state.fill(self.bitmask, entry)
            self.applied_entries.append(entry)
            self.filled[i] = True
        self.release()
        return True

    def release(self) -> None:
        self._ready.set()

    def apply(self, logits: torch.Tensor) -> None:
        """Wait until the mask is filled, then set the disallowed logits of its rows to -inf (in place).

        `logits [batch_size, vocab]` are the rows the sampler reads, one per batch entry."""
        if not self._ready.wait(MASK_WAIT_TIMEOUT_S):
            raise RuntimeError(f"the grammar mask of a batch was not filled within {MASK_WAIT_TIMEOUT_S:.0f} s")
        if not self.applied_entries:
            return
        import xgrammar

        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1],
                                             indices=list(self.applied_entries))


class GrammarManager:
    """The scheduler's structured-output side: the grammar queue, the matchers and the batch masks.

    Used only from the scheduler's thread (the executor only waits on and applies masks).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 compile_timeout: Optional[float] = None) -> None:
        """`compile_timeout`: seconds a request waits for its grammar before it fails (None: no limit)."""
        self.vocab_size = vocab_size
        self.compile_timeout = compile_timeout
        self.cache = GrammarCache(tokenizer, vocab_size, eos_token_ids) if tokenizer is not None else None
        self.queue: list[tuple[Any, concurrent.futures.Future, float]] = []  # (req, compiled grammar, submitted)
        self.pending_masks: list[GrammarMask] = []
        self.num_deferred_masks = 0  # masks launched before their rows could be filled (overlap)

    @property
    def num_queued(self) -> int:
        return len(self.queue)

    def submit(self, req: Any) -> bool:
        """True when `req` can be scheduled now (it has no grammar); else it waits in the grammar queue."""
        key = grammar_key(req.sampling_params)
        if key is None:
            return True
        if self.cache is None:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_exception(ValueError("structured output needs the model's tokenizer, and this model has none"))
        else:
            future = self.cache.get(key)
        self.queue.append((req, future, time.monotonic()))
        return False

    def poll(self) -> tuple[list[Any], list[tuple[Any, str]]]:
        """Requests whose grammar is now ready (their `grammar` set), and those whose grammar failed."""
        if not self.queue:
            return [], []
        ready, failed, waiting = [], [], []
        now = time.monotonic()
        for req, future, submitted in self.queue:
            if not future.done():
                if self.compile_timeout is not None and now - submitted > self.compile_timeout:
                    failed.append((req, f"the grammar did not compile within {self.compile_timeout:g} s "
                                        "(--grammar-compile-timeout); simplify it"))
                else:
                    waiting.append((req, future, submitted))
                continue
            error = future.exception()
            if error is not None:
                failed.append((req, str(error) if isinstance(error, ValueError) else
                               f"grammar compilation failed: {type(error).__name__}: {error}"))
                continue
            req.grammar = GrammarState(future.result())
            ready.append(req)
        self.queue = waiting
        return ready, failed

    def wait_for_queue(self, timeout: Optional[float] = None) -> None:
        """Block until every queued request's grammar has compiled (or failed); `poll` then hands them over."""
        concurrent.futures.wait([future for _, future, _ in self.queue], timeout=timeout)

    def discard(self, req: Any) -> None:
        """Forget a queued request (aborted before its grammar was ready)."""
        self.queue = [entry for entry in self.queue if entry[0] is not req]

    def accept(self, req: Any, token_id: int) -> Optional[FinishReason]:
        """Feed a new output token of `req` to its matcher; the grammar's finish reason, if any."""
        if req.grammar is None:
            return None
        return req.grammar.accept(token_id)

    def mask_for(self, batch: Any) -> Optional[GrammarMask]:
        """The mask of a batch that was just built (None when no entry has a grammar); filled at once when
        every matcher is up to date, else left pending for `fill_pending`."""
        entries, reqs, num_before = [], [], []
        for i, (req, samples) in enumerate(zip(batch.reqs, batch.samples_output)):
            if samples and getattr(req, "grammar", None) is not None:
                entries.append(i)
                reqs.append(req)
                num_before.append(req.kv_len - req.prompt_len)
        if not entries:
            return None
        mask = GrammarMask(batch.batch_size, self.vocab_size, entries, reqs, num_before)
        if not mask.try_fill():
            self.pending_masks.append(mask)
            self.num_deferred_masks += 1
        return mask

    def fill_pending(self) -> None:
        """Fill the masks that waited for results the scheduler has now processed (oldest first)."""
        while self.pending_masks and self.pending_masks[0].try_fill():
            self.pending_masks.pop(0)

    def shutdown(self) -> None:
        """Release every pending mask (so no executor thread waits forever) and stop compiling."""
        for mask in self.pending_masks:
            mask.release()
        self.pending_masks = []
        if self.cache is not None:
            self.cache.shutdown()
