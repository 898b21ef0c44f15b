"""The DetokenizerManager: BatchTokenOut (token ids) in, BatchTextOut (safe text deltas) out.

It keeps one IncrementalDecoder per live request, created on the request's first output (which alone carries
the request's stop strings) and dropped with its finished output. As a safeguard against requests whose final
output never arrives, the number of live decoders is capped; beyond the cap the least recently used one is
dropped (and logged).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from radixserve.detokenizer_manager.incremental import IncrementalDecoder
from radixserve.runtime.wire.messages import BatchTextOut, BatchTokenOut

logger = logging.getLogger(__name__)

DEFAULT_MAX_LIVE_DECODERS = 1 << 16


class DetokenizerManager:
    def __init__(self, tokenizer: Any, max_live_decoders: int = DEFAULT_MAX_LIVE_DECODERS):
        self.tokenizer = tokenizer
        self.max_live_decoders = max_live_decoders
        self.decoders: OrderedDict[str, IncrementalDecoder] = OrderedDict()
        self.num_evicted = 0

    def _decoder(self, batch: BatchTokenOut, i: int) -> IncrementalDecoder:
        rid = batch.rids[i]
        decoder = self.decoders.get(rid)
        if decoder is not None:
            self.decoders.move_to_end(rid)
            return decoder
        decoder = IncrementalDecoder(
            self.tokenizer,
            skip_special_tokens=batch.skip_special_tokens[i],
            spaces_between_special_tokens=batch.spaces_between_special_tokens[i],
            stop=batch.stop[i],
        )
        self.decoders[rid] = decoder
        while len(self.decoders) > self.max_live_decoders:
            evicted, _ = self.decoders.popitem(last=False)
            self.num_evicted += 1
            logger.warning("dropped the detokenizer state of request %s (over %d live)",
                           evicted, self.max_live_decoders)
        return decoder

    def handle(self, batch: BatchTokenOut) -> BatchTextOut:
        """Detokenize one scheduler step; finished requests' state is released here."""
        deltas = []
        for i, rid in enumerate(batch.rids):
            finished = batch.finish_reasons[i] is not None
            deltas.append(self._decoder(batch, i).push(batch.new_token_ids[i], finished=finished))
            if finished:
                del self.decoders[rid]
        return BatchTextOut(
            rids=batch.rids,
            text_deltas=deltas,
            new_token_ids=batch.new_token_ids,
            finish_reasons=batch.finish_reasons,
            prompt_tokens=batch.prompt_tokens,
            completion_tokens=batch.completion_tokens,
            cached_tokens=batch.cached_tokens,
            output_token_logprobs=batch.output_token_logprobs,
            output_top_logprobs=batch.output_top_logprobs,
            input_token_logprobs=batch.input_token_logprobs,
            input_top_logprobs=batch.input_top_logprobs,
            spec=batch.spec,
            queue_times=batch.queue_times,
            embeddings=batch.embeddings,
            weight_version=batch.weight_version,
        )
