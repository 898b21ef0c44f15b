"""The TokenizerWorker: prompts that arrive together are encoded in one batch call, with exactly the ids that
encoding each alone gives (the tokenizer's own `encode` is the reference), and a burst does not serialize."""

from __future__ import annotations

import asyncio
import time

import pytest

from radixserve.runtime.model_files import load_tokenizer
from radixserve.runtime.wire.errors import EngineDeadError
from radixserve.tokenizer_manager.tokenize import TokenizerWorker

TEXTS = ["", "Hello", " leading space", "<|im_start|>user\nName three fruits.<|im_end|>\n", "naïve café 東京 🙂",
         "tabs\tand\nnewlines\r\n", "1234567890" * 30, "The quick brown fox " * 50]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def test_a_burst_is_encoded_in_batches_with_the_same_ids(default_model_dir, tokenizer):
    texts = [f"{text} #{i}" if i % 3 else text for i, text in enumerate(TEXTS * 8)]
    worker = TokenizerWorker(load_tokenizer(default_model_dir))

    async def burst():
        return await asyncio.gather(*(worker.encode(text, 10 ** 6) for text in texts))

    try:
        results = asyncio.run(burst())
    finally:
        worker.close()
    assert results == [tokenizer.encode(text) for text in texts]
    assert worker.num_encode_calls < len(texts) / 4  # they waited for one call together, not one each


def test_one_text_at_a_time_and_a_failed_caller(default_model_dir, tokenizer):
    worker = TokenizerWorker(load_tokenizer(default_model_dir))

    async def one_by_one():
        out = [await worker.encode(text, 10 ** 6) for text in TEXTS]
        abandoned = asyncio.ensure_future(worker.encode("gone before its ids came", 10 ** 6))
        abandoned.cancel()
        out.append(await worker.encode("after a cancelled caller", 10 ** 6))
        return out

    try:
        results = asyncio.run(one_by_one())
    finally:
        worker.close()
    assert results == [tokenizer.encode(text) for text in TEXTS + ["after a cancelled caller"]]


def test_closing_fails_queued_texts_instead_of_leaving_them_waiting(default_model_dir):
    worker = TokenizerWorker(load_tokenizer(default_model_dir))

    async def close_with_texts_queued():
        worker._pool.submit(time.sleep, 0.5)  # the worker thread busy, so the texts wait in the queue
        queued = [asyncio.ensure_future(worker.encode(f"text {i}", 10 ** 6)) for i in range(3)]
        await asyncio.sleep(0.05)
        worker.close()
        outcomes = await asyncio.wait_for(asyncio.gather(*queued, return_exceptions=True), timeout=5)
        with pytest.raises(EngineDeadError):
            await worker.encode("after close", 10 ** 6)
        return outcomes

    outcomes = asyncio.run(close_with_texts_queued())
    assert all(isinstance(outcome, EngineDeadError) for outcome in outcomes)
