"""Streaming through the Engine: read SGLang's way (each chunk holds the whole output so far), a stream ends with
exactly the non-streamed result (CJK, emoji, stop strings), and aborting streams in every way (close, cancel, abort by id, an HTTP client's disconnect) leaks nothing.

Real scheduler and detokenizer processes on the embedded default model (CPU); one Engine for the module.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from radixserve import Engine

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def engine():
    with Engine(log_level="warning") as engine:
        yield engine


def chat(engine, text: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                add_generation_prompt=True)


def wait_until_idle(engine, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        info = engine.get_server_info()
        if info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 0:
            return info
        assert time.monotonic() < deadline, f"scheduler not idle: {info}"
        time.sleep(0.05)


def _stream_text(engine, prompt, params):
    chunks = list(engine.generate(prompt, params, stream=True))
    assert chunks, "a stream yields at least its final chunk"
    assert all(c["meta_info"]["id"] == chunks[0]["meta_info"]["id"] for c in chunks)
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] is not None
    # SGLang's default: each chunk holds the whole output so far; a reader prints chunk["text"][offset:].
    text, ids = "", []
    for chunk in chunks:
        assert chunk["text"].startswith(text) and chunk["output_ids"][: len(ids)] == ids
        text += chunk["text"][len(text):]
        ids = list(chunk["output_ids"])
    return text, ids, chunks[-1]


def _multibyte_token_ids(tokenizer, text):
    return sorted({t for t in tokenizer.encode(text)})


def test_stream_concatenates_to_non_stream_cjk_and_emoji(engine):
    # The model prefers English, so a logit bias pushes it to the byte-level pieces of CJK and emoji text:
    # the output then holds characters split across tokens (and broken sequences), the hard case.
    forced = _multibyte_token_ids(engine.tokenizer, "你好世界，大海很美。😀🎉🌊")
    params = {"max_new_tokens": 24, "logit_bias": {t: 30.0 for t in forced}, **GREEDY}
    prompts = [chat(engine, "用中文写一句关于大海的话，并加上表情符号。"), "Emoji party: 🎉🎉"]
    for prompt in prompts:
        full = engine.generate(prompt, params)
        text, ids, last = _stream_text(engine, prompt, params)
        assert ids == full["output_ids"]
        assert text == full["text"] == engine.tokenizer.decode(full["output_ids"], skip_special_tokens=True)
        assert any(ord(ch) > 0x2E80 for ch in text), f"expected CJK/emoji output, got {text!r}"
        assert last["meta_info"]["completion_tokens"] == len(ids)
    natural = chat(engine, "Write one short sentence in Chinese with an emoji.")
    full = engine.generate(natural, {"max_new_tokens": 20, **GREEDY})
    assert _stream_text(engine, natural, {"max_new_tokens": 20, **GREEDY})[0] == full["text"]


def test_stop_string_split_across_tokens_stream_and_non_stream(engine):
    prompt = "Count: one, two, three, four, five, six,"
    base = engine.generate(prompt, {"max_new_tokens": 16, "ignore_eos": True, **GREEDY})
    ids = base["output_ids"]
    # A stop string that starts inside one token and ends inside a later one.
    pieces = [engine.tokenizer.decode([t]) for t in ids]
    k = next(i for i in range(2, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 1)
    stop = pieces[k][-1] + pieces[k + 1]
    cut = base["text"].find(stop)
    assert cut >= 0
    params = {"max_new_tokens": 16, "ignore_eos": True, "stop": [stop], **GREEDY}
    stopped = engine.generate(prompt, params)
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stopped["text"] == base["text"][:cut]
    assert stopped["output_ids"] == ids[: len(stopped["output_ids"])]
    text, stream_ids, _ = _stream_text(engine, prompt, params)
    assert text == stopped["text"] and stream_ids == stopped["output_ids"]




def test_request_observer_and_abort_by_id(engine):
    seen = []
    engine.request_observer = lambda meta, times: seen.append((meta, times))
    try:
        stream = engine.generate("Write a long story about a dragon.", {"max_new_tokens": 200, "ignore_eos": True},
                                 stream=True)
        first = next(stream)
        engine.abort(first["meta_info"]["id"])
        rest = list(stream)
        final = (rest or [first])[-1]
        assert final["meta_info"]["finish_reason"]["type"] == "abort"
        assert final["meta_info"]["completion_tokens"] < 200
    finally:
        engine.request_observer = None
    assert len(seen) == 1
    meta, times = seen[0]
    assert meta["finish_reason"]["type"] == "abort" and meta["ttft"] > 0 and times == sorted(times)




@pytest.mark.parametrize("ending", ["disconnect", "broken channel"])
def test_an_http_run_waits_for_its_clients_disconnect_without_polling(engine, ending):
    """The HTTP layer's run over this engine, with a real ASGI receive channel: while it generates, the channel is
    read once (a run waiting for tokens costs nothing); the client's `http.disconnect`, or a channel that fails,
    stops the run at once and aborts its request."""
    from starlette.requests import Request

    from radixserve.runtime.http.generation import ClientDisconnected, GenerationRun
    from radixserve.runtime.http.state import InflightRequests, ServerState
    from radixserve.tokenizer_manager.io import GenerateReqInput

    state = ServerState(engine=engine, server_args=None, tenants=None, inflight=InflightRequests(None),
                        tokenizer=None, served_model_name="m", model_info=None, context_len=0, vocab_size=0,
                        max_total_tokens=None)
    request = GenerateReqInput(text="Write a long story about a dragon.", rid="http-run-disconnect", stream=True,
                               sampling_params={"max_new_tokens": 400, "ignore_eos": True})

    async def main():
        reads, disconnect = [], asyncio.Event()

        async def receive():
            reads.append(time.monotonic())
            await disconnect.wait()
            if ending == "broken channel":
                raise OSError("connection reset")
            return {"type": "http.disconnect"}

        http_request = Request({"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}, receive)
        run = GenerationRun(state, {"http-run-disconnect": ["http-run-disconnect"]}, [request], None, http_request)
        chunks = 0
        with pytest.raises(ClientDisconnected):
            async for _, chunk in run.events():
                chunks += 1
                if chunks == 20:
                    await asyncio.sleep(1.0)  # time passes: the channel is read once per run, not per interval
                    assert len(reads) == 1
                    disconnect.set()
        return chunks, chunk

    chunks, last = asyncio.run(main())
    assert 20 <= chunks < 400 and last["meta_info"]["finish_reason"] is None
    info = wait_until_idle(engine)
    assert info["num_pending_requests_in_tokenizer_manager"] == 0


def test_closing_a_sync_stream_aborts_it(engine):
    stream = engine.generate("Tell me about the ocean.", {"max_new_tokens": 200, "ignore_eos": True}, stream=True)
    next(stream)
    stream.close()
    info = wait_until_idle(engine)
    assert info["num_pending_requests_in_tokenizer_manager"] == 0


def test_40_streams_half_aborted_at_random_points(engine):
    prompts = [f"Story number {i}: once upon a time there was a" for i in range(8)]
    params = {"max_new_tokens": 12, "ignore_eos": True, **GREEDY}
    expected = engine.generate(prompts, params)
    rng = random.Random(4)
    methods = ["close", "cancel", "abort_by_id", "drop"]
    plan = [(i % len(prompts), None if i % 2 else (rng.randint(0, 8), methods[(i // 2) % 4])) for i in range(40)]

    async def consume(prompt_index, abort, reached):
        stream = await engine.async_generate(prompts[prompt_index], params, stream=True)
        text, ids, last, count = "", [], None, 0
        async for chunk in stream:
            text, ids, last, count = chunk["text"], chunk["output_ids"], chunk, count + 1  # whole output so far
            if abort is None or count <= abort[0]:
                continue
            method = abort[1]
            if method == "close":
                await stream.aclose()
                return "closed", text, ids, last
            if method == "drop":
                return "dropped", text, ids, last  # the stream is garbage once this frame is gone
            if method == "abort_by_id" and count == abort[0] + 1:
                engine.abort(chunk["meta_info"]["id"])
            if method == "cancel" and not reached.done():
                reached.set_result(None)
                await asyncio.sleep(30)  # cancelled by the driver long before this ends
        return "finished", text, ids, last

    async def main():
        loop = asyncio.get_running_loop()
        reached = [loop.create_future() for _ in plan]
        tasks = [asyncio.create_task(consume(p, a, r)) for (p, a), r in zip(plan, reached)]
        for (p, abort), task, r in zip(plan, tasks, reached):
            if abort is not None and abort[1] == "cancel":
                await asyncio.wait([r, task], return_when=asyncio.FIRST_COMPLETED)
                task.cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    outcomes = asyncio.run(main())
    cut_short = 0
    for (prompt_index, abort), outcome in zip(plan, outcomes):
        reference = expected[prompt_index]
        if abort is None:
            kind, text, ids, last = outcome
            assert kind == "finished"
            assert ids == reference["output_ids"] and text == reference["text"]
            assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
        elif abort[1] == "cancel":
            assert isinstance(outcome, asyncio.CancelledError) or outcome[0] == "finished"
            cut_short += isinstance(outcome, asyncio.CancelledError)
        else:
            kind, text, ids, last = outcome
            assert ids == reference["output_ids"][: len(ids)], "an aborted stream's tokens are a prefix"
            assert reference["text"].startswith(text)
            if abort[1] == "abort_by_id" and kind == "finished" and len(ids) < 12:
                assert last["meta_info"]["finish_reason"]["type"] == "abort"
            cut_short += len(ids) < 12
    assert cut_short >= 10, f"only {cut_short} of the 20 streams meant to be aborted were cut short"

    info = wait_until_idle(engine)
    memory = info["memory"]
    assert memory["free_tokens"] + memory["evictable_tokens"] == memory["total_tokens"]
    assert memory["protected_tokens"] == 0
    assert info["num_pending_requests_in_tokenizer_manager"] == 0
    # Everything still works afterwards.
    again = engine.generate(prompts[0], params)
    assert again["output_ids"] == expected[0]["output_ids"]
