"""Running program functions: one (`run`), or many concurrently (`run_batch`).

A run creates the program's executor and state, calls the function (whose `s += ...` only queue work), and,
unless streaming, waits for the program and every branch it forked. A batch first prefills the prefix that
every program's text begins with (found by tracing, see tracing.py) in one max_new_tokens=0 request (unless
global_config.enable_precache_with_tracing is False), then runs the programs on a thread pool; their requests
meet in the scheduler and batch there, each finding the prefix in the radix cache.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Callable, Optional, Union

from tqdm.auto import tqdm

from radixserve.frontend.backends.base import Backend
from radixserve.frontend.executor import ProgramExecutor
from radixserve.frontend.global_config import global_config
from radixserve.frontend.sampling import SamplingDefaults
from radixserve.frontend.state import ProgramState
from radixserve.frontend.tracing import constant_prefix

MAX_AUTO_THREADS = 64


def run_program(func: Callable[..., Any], args: tuple, kwargs: dict[str, Any], backend: Backend,
                defaults: SamplingDefaults, stream: bool = False,
                num_api_spec_tokens: Optional[int] = None) -> ProgramState:
    """Run `func(s, *args, **kwargs)`. Without stream, returns once the program (and its branches) finished
    and raises the program's error; with stream, returns at once, and `s.text_iter()` follows it.
    `num_api_spec_tokens`: API speculative execution (speculative.py)."""
    executor = ProgramExecutor(backend, defaults, stream, num_api_spec_tokens=num_api_spec_tokens)
    state = ProgramState(executor)
    try:
        func(state, *args, **kwargs)
    finally:
        executor.end()
    if not stream:
        executor.wait_all()
        executor.raise_if_failed()
        if global_config.verbosity >= 2:
            print(state.text())
    return state


def run_program_batch(func: Callable[..., Any], batch_kwargs: list[dict[str, Any]], bound: dict[str, Any],
                      backend: Backend, defaults: SamplingDefaults, num_threads: Union[int, str] = "auto",
                      progress_bar: bool = False, num_api_spec_tokens: Optional[int] = None) -> list[ProgramState]:
    """Run `func(s, **bound, **kwargs)` for every kwargs of the batch; the states in batch order.

    A failing program does not stop the others: its state's `error` holds the exception, and reading its
    results raises it.
    """
    if not batch_kwargs:
        return []
    if len(batch_kwargs) > 1 and global_config.enable_precache_with_tracing:
        names = sorted(set().union(*batch_kwargs))
        prefix = constant_prefix(func, names, bound, lambda: backend.chat_template)
        if prefix:
            backend.prefill(prefix)

    def run_one(kwargs: dict[str, Any]) -> ProgramState:
        executor = ProgramExecutor(backend, defaults, num_api_spec_tokens=num_api_spec_tokens)
        state = ProgramState(executor)
        try:
            func(state, **bound, **kwargs)
        except BaseException as error:  # noqa: BLE001 - recorded in the state; the batch goes on
            executor.fail(error)
        finally:
            executor.end()
        executor.wait_all()
        return state

    workers = _thread_count(num_threads, len(batch_kwargs))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="radixserve-dsl-batch") as pool, \
            tqdm(total=len(batch_kwargs), disable=not progress_bar, desc="programs") as bar:
        futures = [pool.submit(run_one, kwargs) for kwargs in batch_kwargs]
        for _ in as_completed(futures):
            bar.update(1)
    return [future.result() for future in futures]


def _thread_count(num_threads: Union[int, str], batch_size: int) -> int:
    if num_threads == "auto":
        return max(1, min(batch_size, MAX_AUTO_THREADS))
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be a positive int or 'auto', got {num_threads!r}")
    return min(num_threads, batch_size)
