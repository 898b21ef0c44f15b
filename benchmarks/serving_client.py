"""The serving benchmark's HTTP client: one streaming request timed, and sessions run under an arrival process.

`send_request` sends a prompt to native `/generate` (input_ids, or text) or OpenAI `/v1/completions` (text),
asking for exactly `output_len` tokens (`ignore_eos`), and measures TTFT (send to the first chunk carrying
output), ITL (gaps between successive chunks carrying output; radixserve sends one chunk per token) and the
end-to-end latency. Token counts are those the server reports (native `meta_info`, OpenAI `usage` with
`stream_options.include_usage`), else the prompt's length and the number of output chunks.

`run_sessions` starts sessions at Poisson times (`request_rate`) or all at once (`inf`), and caps the requests
in flight at `max_concurrency` when given: open loop without the cap, closed loop with it and rate `inf`. The
connection pool (HTTP/1.1 keep-alive) is sized for the most requests that can be in flight, so no request
waits for a connection inside the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import multiprocessing
import random
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Sequence

import httpx
from tqdm import tqdm

from serving_datasets import Session

BACKENDS = ("radixserve", "openai")


@dataclass(frozen=True)
class Target:
    """Where and how to send requests."""

    backend: str  # "radixserve" (native /generate) or "openai" (/v1/completions)
    base_url: str
    api_key: Optional[str] = None
    model: Optional[str] = None  # the OpenAI "model" field; omitted when None
    prompt_as_text: bool = False  # native backend: send text instead of input_ids
    temperature: float = 0.0

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def request(self, ids: list[int], text: str, output_len: int) -> tuple[str, dict[str, Any]]:
        """(url, JSON body) of one streaming request for `output_len` tokens exactly."""
        if self.backend == "radixserve":
            prompt: dict[str, Any] = {"text": text} if self.prompt_as_text else {"input_ids": ids}
            params = {"max_new_tokens": output_len, "ignore_eos": True, "temperature": self.temperature}
            return self.base_url + "/generate", {**prompt, "sampling_params": params, "stream": True}
        body: dict[str, Any] = {"prompt": text, "max_tokens": output_len, "ignore_eos": True,
                                "temperature": self.temperature, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        return self.base_url + "/v1/completions", body


@dataclass
class RequestResult:
    """What one request measured. Times in seconds (`start`: `time.perf_counter()` at sending); `itl` holds the
    gaps after the first output chunk."""

    planned_output_len: int
    prompt_len: int = 0
    output_len: int = 0
    cached_tokens: Optional[int] = None  # prompt tokens the server says it served from its cache, if it says
    success: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)  # native backend only
    output_text: str = ""

    @property
    def tpot(self) -> Optional[float]:
        return (self.latency - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


class StreamError(Exception):
    """The server reported an error inside the stream."""


async def _sse_events(response: httpx.Response) -> AsyncIterator[dict]:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _fold_chunk(backend: str, chunk: dict, result: RequestResult) -> bool:
    """Add one stream chunk to `result`; True when it carries output tokens."""
    if "error" in chunk:
        raise StreamError(json.dumps(chunk["error"])[:500])
    if backend == "radixserve":
        meta = chunk.get("meta_info") or {}
        result.prompt_len = meta.get("prompt_tokens", result.prompt_len)
        result.cached_tokens = meta.get("cached_tokens", result.cached_tokens)
        ids, text = chunk.get("output_ids") or [], chunk.get("text") or ""
        before = len(result.output_ids)
        if len(ids) == meta.get("completion_tokens", -1):  # the whole output so far (SGLang's default)
            result.output_ids, result.output_text = list(ids), text
        else:  # only the new output (--incremental-streaming-output)
            result.output_ids.extend(ids)
            result.output_text += text
        result.output_len = meta.get("completion_tokens", len(result.output_ids))
        return len(result.output_ids) > before
    usage = chunk.get("usage")
    if usage:  # the final chunk (stream_options.include_usage): exact counts replace the chunk count
        result.prompt_len = usage.get("prompt_tokens", result.prompt_len)
        result.output_len = usage.get("completion_tokens", result.output_len)
        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", result.cached_tokens)
    choices = chunk.get("choices") or []
    if not choices:
        return False
    result.output_text += choices[0].get("text") or ""
    if not usage:
        result.output_len += 1
    return True


async def send_request(client: httpx.AsyncClient, target: Target, ids: list[int], text: str,
                       output_len: int) -> RequestResult:
    """Send one streaming request and time it; never raises for server or transport errors (they are recorded)."""
    url, body = target.request(ids, text, output_len)
    start = time.perf_counter()
    result = RequestResult(planned_output_len=output_len, prompt_len=len(ids), start=start)
    last_output = None
    try:
        async with client.stream("POST", url, json=body, headers=target.headers()) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode("utf-8", errors="replace")[:500]
                result.error = f"HTTP {response.status_code}: {detail}"
                return result
            async for chunk in _sse_events(response):
                if not _fold_chunk(target.backend, chunk, result):
                    continue
                now = time.perf_counter()
                if last_output is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last_output)
                last_output = now
    except (httpx.HTTPError, StreamError, ValueError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.latency = time.perf_counter() - start
    result.success = last_output is not None
    if not result.success:
        result.error = "the stream ended without output"
    return result


def arrival_label(request_rate: float, max_concurrency: Optional[int]) -> tuple[str, str]:
    """(loop, label): "open" or "closed", and a one-line description of the arrival process."""
    if math.isinf(request_rate):
        if max_concurrency:
            return "closed", f"closed loop, {max_concurrency} requests in flight"
        return "open", "open loop, all requests at once"
    capped = f", at most {max_concurrency} in flight" if max_concurrency else ""
    return "open", f"open loop, Poisson arrivals at {request_rate:g} req/s{capped}"


def run_sessions_in_processes(target: Target, sessions: Sequence[Session], processes: int,
                               request_rate: float = math.inf, max_concurrency: Optional[int] = None, seed: int = 0,
                               request_timeout: Optional[float] = None) -> tuple[list[RequestResult], float]:
    """`run_sessions` split over `processes` client processes (sessions dealt round-robin; each process gets the
    rate and the concurrency divided by `processes`, so the arrival process is the same). One Python process
    parsing a thousand streams saturates its core and delays what it measures; several do not. The duration runs
    from the first process's start to the last one's end (their clocks are the same monotonic clock)."""
    shares = [sessions[i::processes] for i in range(processes)]
    jobs = [(target, share, request_rate / processes, -(-max_concurrency // processes) if max_concurrency else None,
             seed + i, request_timeout) for i, share in enumerate(shares) if share]
    with multiprocessing.get_context("spawn").Pool(len(jobs)) as pool:
        outcomes = pool.map(_run_share, jobs)
    results = [result for share_results, _, _ in outcomes for result in share_results]
    start = min(began for _, began, _ in outcomes)
    return results, max(ended for _, _, ended in outcomes) - start


def _run_share(job: tuple) -> tuple[list[RequestResult], float, float]:
    target, sessions, rate, concurrency, seed, timeout = job
    began = time.perf_counter()
    results, _ = asyncio.run(run_sessions(target, sessions, rate, concurrency, seed, False, timeout))
    return results, began, time.perf_counter()


async def run_sessions(target: Target, sessions: Sequence[Session], request_rate: float = math.inf,
                       max_concurrency: Optional[int] = None, seed: int = 0, progress: bool = True,
                       request_timeout: Optional[float] = None) -> tuple[list[RequestResult], float]:
    """Run every session under the arrival process; returns the results (one per turn) and the duration (s).

    A turn that fails ends its conversation: the later turns are recorded as failed without being sent (their
    prompts would extend an answer that never came).
    """
    num_turns = sum(len(session.turns) for session in sessions)
    connections = min(max_concurrency or len(sessions), len(sessions)) or 1
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    timeout = httpx.Timeout(request_timeout, connect=60.0)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[RequestResult] = []
    bar = tqdm(total=num_turns, disable=not progress, desc="requests")

    async def run_session(client: httpx.AsyncClient, session: Session) -> None:
        for index, turn in enumerate(session.turns):
            ids, text = session.next_prompt(index)
            async with semaphore or contextlib.nullcontext():
                result = await send_request(client, target, ids, text, turn.output_len)
            results.append(result)
            bar.update(1)
            if not result.success:
                for later in session.turns[index + 1:]:
                    results.append(RequestResult(planned_output_len=later.output_len,
                                                 error="not sent: an earlier turn of its conversation failed"))
                bar.update(len(session.turns) - index - 1)
                return
            session.record_answer(index, ids, text, result.output_ids, result.output_text)

    rng = random.Random(seed)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        start = time.perf_counter()
        tasks = []
        for index, session in enumerate(sessions):
            if index and not math.isinf(request_rate):  # the first session starts at once, the rest at Poisson gaps
                await asyncio.sleep(rng.expovariate(request_rate))
            tasks.append(asyncio.create_task(run_session(client, session)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return results, duration

