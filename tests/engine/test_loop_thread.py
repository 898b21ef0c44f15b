"""The engine loop's bridges: streams awaited from another event loop arrive whole and in order, in batches."""

from __future__ import annotations

import asyncio

from radixserve.runtime.loop_thread import LoopThread, _Outbox


async def _numbers(count: int, pause_every: int):
    for i in range(count):
        if i % pause_every == 0:
            await asyncio.sleep(0)
        yield i


def test_many_streams_from_one_loop_arrive_whole_and_in_order():
    engine = LoopThread(name="test-engine-loop")
    deliveries = 0
    original = _Outbox._deliver

    def counting_deliver(self):
        nonlocal deliveries
        deliveries += 1
        original(self)

    async def consume(stream_id: int) -> list[int]:
        stream = await engine.stream_async(lambda: 200, lambda count: _numbers(count, 1 + stream_id % 7))
        return [item async for item in stream]

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(consume(i) for i in range(60)))

    _Outbox._deliver = counting_deliver
    try:
        results = asyncio.run(main())
    finally:
        _Outbox._deliver = original
    assert results == [list(range(200))] * 60
    # 60 x (200 items + the start and the end) entries crossed threads in far fewer wake-ups of the caller's loop.
    assert 0 < deliveries < 60 * 202 / 4


def test_a_stream_start_error_and_a_closed_caller_loop():
    engine = LoopThread(name="test-engine-loop")

    def refuse():
        raise ValueError("bad arguments")

    async def start_refused() -> None:
        await engine.stream_async(refuse, lambda _: _numbers(1, 1))

    try:
        asyncio.run(start_refused())
    except ValueError as error:
        assert "bad arguments" in str(error)
    else:
        raise AssertionError("the start error must reach the caller")

    async def leave_early() -> None:  # the caller's loop closes while the engine still produces items
        stream = await engine.stream_async(lambda: 10_000, lambda count: _numbers(count, 50))
        async for item in stream:
            if item == 3:
                break

    asyncio.run(leave_early())
    # The engine loop still serves new callers.
    async def again() -> list[int]:
        return [item async for item in await engine.stream_async(lambda: 5, lambda count: _numbers(count, 1))]

    assert asyncio.run(again()) == list(range(5))
