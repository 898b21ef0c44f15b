"""An event loop on a daemon thread, and the bridges that let any caller use it.

The Engine's TokenizerManager lives on this loop. Callers reach it from:
- plain code or another thread: `call(coro)` blocks for the result; `stream(start, iterate)` is a blocking
  iterator fed through a thread-safe queue;
- any other running event loop (a Jupyter cell, `asyncio.run`, uvicorn): `call_async(coro)` and
  `stream_async(start, iterate)` await through `asyncio.wrap_future` / `call_soon_threadsafe`, so the caller's
  loop is never blocked and no nested loop (nest_asyncio) is needed. Stream items for one caller loop travel
  in batches (`_Outbox`): a server streaming to a thousand clients wakes its loop once per engine round, not
  once per chunk.

Streams start in two steps: `start()` runs on the engine loop and may raise (bad arguments) before anything
is queued; `iterate(started)` then yields items. Closing or abandoning a stream on the caller's side cancels
the pump on the engine loop, which closes `iterate`'s generator (the TokenizerManager aborts the requests).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import queue
import threading
import weakref
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, TypeVar

T = TypeVar("T")

_ITEM, _END, _ERROR = "item", "end", "error"


class _Outbox:
    """Stream items bound for one caller loop. The first item posted after a delivery schedules the next
    delivery (one `call_soon_threadsafe`); the items posted until it runs go with it, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, tuple[str, Any]]] = []

    def post(self, items: asyncio.Queue, entry: tuple[str, Any]) -> None:
        with self._lock:
            self._pending.append((items, entry))
            if len(self._pending) > 1:
                return
        with contextlib.suppress(RuntimeError):  # the caller's loop is already closed: nobody listens
            self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        for items, entry in batch:
            items.put_nowait(entry)


class LoopThread:
    def __init__(self, name: str = "radixserve-engine-loop"):
        self._outboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # caller loop -> _Outbox
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def on_loop(self) -> bool:
        """True when called from the loop's own thread."""
        return threading.current_thread() is self.thread

    # ---- one-shot calls --------------------------------------------------------------------------

    def call(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result from a thread that is not the loop's."""
        if self.on_loop():
            raise RuntimeError("blocking call from the engine's own event loop thread; use the async API")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except BaseException:  # KeyboardInterrupt or timeout: do not leave the coroutine running
            future.cancel()
            raise

    async def call_async(self, coro: Awaitable[T]) -> T:
        """Await `coro` run on the loop, from any running event loop; cancelling the await cancels it."""
        if self.on_loop():
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    # ---- streams ---------------------------------------------------------------------------------

    def _pump(self, start: Callable[[], Any], iterate: Callable[[Any], AsyncIterator[Any]],
              emit: Callable[[tuple[str, Any]], None]) -> concurrent.futures.Future:
        """Run start() then iterate() on the loop, emitting ("item"|"end"|"error", value) tuples.

        The first emission is ("item", None) once start() succeeded, or ("error", exc) when it raised.
        """

        async def pump() -> None:
            try:
                started = start()
                if inspect.isawaitable(started):
                    started = await started
            except BaseException as exc:
                emit((_ERROR, exc))
                return
            emit((_ITEM, None))
            try:
                async with contextlib.aclosing(iterate(started)) as items:
                    async for item in items:
                        emit((_ITEM, item))
                emit((_END, None))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                emit((_ERROR, exc))

        return asyncio.run_coroutine_threadsafe(pump(), self.loop)

    def stream(self, start: Callable[[], Any], iterate: Callable[[Any], AsyncIterator[Any]]) -> Iterator[Any]:
        """A blocking iterator over iterate(start()); start()'s exception is raised here, at once."""
        items: queue.SimpleQueue = queue.SimpleQueue()
        future = self._pump(start, iterate, items.put)
        kind, value = items.get()
        if kind == _ERROR:
            raise value
        return _SyncStream(items, future)

    async def stream_async(self, start: Callable[[], Any],
                           iterate: Callable[[Any], AsyncIterator[Any]]) -> AsyncIterator[Any]:
        """Like `stream`, awaited from any running loop; returns once start() succeeded (or raises)."""
        caller_loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        outbox = self._outboxes.get(caller_loop)
        if outbox is None:
            outbox = self._outboxes[caller_loop] = _Outbox(caller_loop)

        def emit(entry: tuple[str, Any]) -> None:
            outbox.post(items, entry)

        future = self._pump(start, iterate, emit)
        try:
            kind, value = await items.get()
        except BaseException:
            future.cancel()
            raise
        if kind == _ERROR:
            raise value
        return _AsyncStream(items, future)


class _SyncStream:
    """Blocking iterator over a pump's items; closing it, or dropping it unread, stops the pump."""

    def __init__(self, items: queue.SimpleQueue, future: concurrent.futures.Future):
        self._items = items
        self._future = future
        self._done = False

    def __iter__(self) -> "_SyncStream":
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        try:
            kind, value = self._items.get()
        except BaseException:  # KeyboardInterrupt while waiting
            self.close()
            raise
        if kind == _ITEM:
            return value
        self.close()
        if kind == _END:
            raise StopIteration
        raise value

    def close(self) -> None:
        self._done = True
        self._future.cancel()  # no-op once the pump finished; otherwise it aborts the requests

    def __del__(self) -> None:
        self._future.cancel()


class _AsyncStream:
    """Async iterator over a pump's items; `aclose()`, cancellation or dropping it stops the pump."""

    def __init__(self, items: asyncio.Queue, future: concurrent.futures.Future):
        self._items = items
        self._future = future
        self._done = False

    def __aiter__(self) -> "_AsyncStream":
        return self

    async def __anext__(self) -> Any:
        if self._done:
            raise StopAsyncIteration
        try:
            kind, value = await self._items.get()
        except BaseException:  # cancelled while waiting
            await self.aclose()
            raise
        if kind == _ITEM:
            return value
        await self.aclose()
        if kind == _END:
            raise StopAsyncIteration
        raise value

    async def aclose(self) -> None:
        self._done = True
        self._future.cancel()

    def __del__(self) -> None:
        self._future.cancel()
