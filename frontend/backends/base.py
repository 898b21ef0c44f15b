"""What the DSL needs from a model endpoint, on top of one request shape shared by every backend.

Every backend speaks the native generate API (the dict `POST /generate` takes and the Engine's `generate`
mirrors): `{"text" | "input_ids", "sampling_params", "return_logprob", "logprob_start_len", ...}`, answered
with `{"text", "output_ids", "meta_info"}` (a list of them for a batch). A subclass supplies the transport
(`_request`, `_request_stream`), the tokenizer, and the server statistics; this class builds the requests the
DSL makes: generate, prefill a prefix into the radix cache, and score prompt tokens.

Backends are thread-safe: many programs (run_batch, fork branches) call one backend at once, and their
requests batch together in the scheduler.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any, Iterator, Optional, Union

from radixserve.frontend.chat_template import ChatTemplate


class BackendError(RuntimeError):
    """The backend refused or failed a request; `status_code` is the HTTP status when there is one."""

    def __init__(self, message: str, status_code: Optional[int] = None):
        super().__init__(message)
        self.status_code = status_code


class InvalidRequestError(BackendError, ValueError):
    """The backend rejected the request's arguments (HTTP 400), as the Engine raises ValueError."""


class ModalityNotSupportedError(BackendError, ValueError):
    """A program gave an image or video to a model that reads only text (every model radixserve serves)."""


class TokenUsage:
    """Prompt and completion tokens of the generate requests a backend made since the last `reset()` (SGLang's
    `backend.token_usage`, which its scripts read to compare programs)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def add(self, meta_info: dict[str, Any]) -> None:
        with self._lock:
            self.prompt_tokens += int(meta_info.get("prompt_tokens", 0))
            self.completion_tokens += int(meta_info.get("completion_tokens", 0))

    def reset(self) -> None:
        with self._lock:
            self.prompt_tokens = self.completion_tokens = 0

    def __repr__(self) -> str:
        return f"TokenUsage(prompt_tokens={self.prompt_tokens}, completion_tokens={self.completion_tokens})"


class Backend(ABC):
    """A model the DSL runs programs against. `chat_template`: a ChatTemplate or a Jinja template string that
    replaces the model tokenizer's own for system()/user()/assistant()."""

    def __init__(self, chat_template: Union[ChatTemplate, str, None] = None):
        self.token_usage = TokenUsage()
        self._lock = threading.Lock()
        self._incremental_streaming: Optional[bool] = None
        self._tokenizer: Any = None
        self._chat_template_arg = chat_template
        self._chat_template: Optional[ChatTemplate] = chat_template if isinstance(chat_template, ChatTemplate) else None

    # ---- what a backend supplies -----------------------------------------------------------------

    @abstractmethod
    def _request(self, payload: dict[str, Any]) -> Any:
        """Run one native generate request to completion; its result (a list of results for a batch)."""

    @abstractmethod
    def _request_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Run one single-prompt native request, yielding its streaming chunks (text deltas, meta_info)."""

    @abstractmethod
    def _load_tokenizer(self) -> Any:
        """The Hugging Face tokenizer the server tokenizes with."""

    @abstractmethod
    def get_server_info(self) -> dict[str, Any]:
        """The scheduler's statistics (prefill tokens computed, cache hit counters, memory)."""

    @abstractmethod
    def flush_cache(self) -> bool:
        """Drop the radix cache; False when the server refused (requests running)."""

    @abstractmethod
    def _streams_incrementally(self) -> bool:
        """Whether the server's streaming chunks carry only the new text (SGLang's
        --incremental-streaming-output), rather than the whole text so far (SGLang's default)."""

    def streams_incrementally(self) -> bool:
        """Whether streaming chunks carry only new text (asked once, then remembered)."""
        if self._incremental_streaming is None:
            self._incremental_streaming = self._streams_incrementally()
        return self._incremental_streaming

    @property
    def model_name(self) -> str:
        """The served model's path or name, for messages."""
        return "the served model"

    def get_model_name(self) -> str:
        """SGLang's name of `model_name` (its scripts call `backend.get_model_name()`)."""
        return self.model_name

    def check_modality(self, kind: str) -> None:
        """Raise ModalityNotSupportedError: `kind` ("image", "video") input needs a multimodal model, and
        radixserve serves text-only models (Llama, Mistral, Qwen2, Qwen3 families)."""
        raise ModalityNotSupportedError(f"{kind} input is not supported by this model ({self.model_name}): "
                                        f"it reads text only")

    # ---- tokenizer and chat template -----------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._load_tokenizer()
            return self._tokenizer

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` exactly as the server tokenizes a text prompt (special tokens included)."""
        tokenizer = self.tokenizer
        with self._lock:  # one tokenizer object shared by threads; keep its calls serial
            return list(tokenizer.encode(text))

    def decode(self, token_ids: list[int]) -> str:
        tokenizer = self.tokenizer
        with self._lock:
            return tokenizer.decode(token_ids)

    @property
    def chat_template(self) -> ChatTemplate:
        """The role prefixes and suffixes (derived once, on first use). ValueError when the model has none."""
        if self._chat_template is None:
            template = ChatTemplate.from_tokenizer(self.tokenizer, self._chat_template_arg)
            with self._lock:
                self._chat_template = template
        return self._chat_template

    # ---- the requests the DSL makes ------------------------------------------------------------

    def generate(self, text: str, sampling_params: dict[str, Any], **options: Any) -> dict[str, Any]:
        """Complete `text`; options are return_logprob, logprob_start_len, top_logprobs_num,
        return_text_in_logprobs (None = the server default). BackendError if the server aborted it."""
        result = _check_not_aborted(self._request(_payload(text, sampling_params, options)))
        self.token_usage.add(result["meta_info"])
        return result

    def generate_stream(self, text: str, sampling_params: dict[str, Any], **options: Any) -> Iterator[dict[str, Any]]:
        """`generate`, as streaming chunks: each has the new "text" and a "meta_info" whose output logprob lists
        hold the new tokens' entries only, whichever way the server streams (see `_streams_incrementally`)."""
        deltas = StreamDeltas(self.streams_incrementally())
        meta_info: dict[str, Any] = {}
        for chunk in self._request_stream({**_payload(text, sampling_params, options), "stream": True}):
            chunk = _check_not_aborted(chunk)
            meta_info = chunk.get("meta_info") or meta_info
            yield deltas(chunk)
        self.token_usage.add(meta_info)

    def prefill(self, text: str) -> dict[str, Any]:
        """Run `text` through the model without generating (max_new_tokens=0), so the radix cache holds its
        KV for the requests that follow; returns the result (meta_info has prompt and cached tokens)."""
        return _check_not_aborted(self._request({"text": text, "sampling_params": {"max_new_tokens": 0}}))

    def prompt_logprobs(self, input_ids: list[list[int]], starts: list[int]) -> list[list[float]]:
        """For each prompt, the logprobs of its tokens at positions starts[i].. (each given the tokens before
        it), all prompts in one batched request. starts[i] must be >= 1: the first token has no logprob.

        Raises BackendError when the server returns fewer logprobs than asked or for other tokens.
        """
        if len(input_ids) != len(starts) or not input_ids:
            raise ValueError("give one start per prompt, for at least one prompt")
        for ids, start in zip(input_ids, starts):
            if not 1 <= start < len(ids):
                raise ValueError(f"start {start} is outside 1..{len(ids) - 1}")
        results = self._request({
            "input_ids": [list(ids) for ids in input_ids],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            # The server then reuses at most start - 1 cached tokens and computes the logits at start - 1
            # onwards itself, which is what the logprob of token `start` needs.
            "logprob_start_len": list(starts),
        })
        return [_prompt_logprobs_of(result, ids, start) for result, ids, start in zip(results, input_ids, starts)]


_STREAMED_LOGPROB_LISTS = ("output_token_logprobs", "output_top_logprobs")


class StreamDeltas:
    """Turns one request's streaming chunks into chunks with only what is new in "text" and in the output
    logprob lists, whichever way the server streams.

    Text: with `incremental` each chunk's text is already new; otherwise it is the whole text so far, which
    must begin with the text of the chunks before (BackendError if not: the two streaming modes mixed up).
    Logprob lists: a list as long as the tokens generated so far (meta_info completion_tokens) after earlier
    chunks had entries holds them all again, and only its tail is new.
    """

    def __init__(self, incremental: bool):
        self.incremental = incremental
        self.text = ""  # the whole text so far
        self._entries_so_far = dict.fromkeys(_STREAMED_LOGPROB_LISTS, 0)

    def __call__(self, chunk: dict[str, Any]) -> dict[str, Any]:
        chunk = dict(chunk)
        meta_info = chunk["meta_info"] = dict(chunk.get("meta_info") or {})
        if self.incremental:
            self.text += chunk["text"]
        else:
            whole = chunk["text"]
            if not whole.startswith(self.text):
                raise BackendError("a streamed chunk does not continue the text so far: the server's streaming "
                                   "mode (incremental_streaming_output) is not the one it reported")
            chunk["text"], self.text = whole[len(self.text):], whole
        completion_tokens = meta_info.get("completion_tokens")
        for key in _STREAMED_LOGPROB_LISTS:
            entries = meta_info.get(key)
            if entries is None:
                continue
            seen = self._entries_so_far[key]
            if seen and len(entries) == completion_tokens:
                entries = meta_info[key] = list(entries)[seen:]
            self._entries_so_far[key] = seen + len(entries)
        return chunk


def _check_not_aborted(result: dict[str, Any]) -> dict[str, Any]:
    """The result, unless the server aborted the request (then BackendError with its reason): a program
    cannot go on from a generation that did not happen."""
    reason = result["meta_info"].get("finish_reason") or {}
    if reason.get("type") == "abort":
        raise BackendError(f"the server aborted the generation: {reason.get('message', 'no reason given')}")
    return result


def _payload(text: str, sampling_params: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    payload: dict[str, Any] = {"text": text, "sampling_params": sampling_params}
    for name in ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"):
        if options.get(name) is not None:
            payload[name] = options[name]
    return payload


def _prompt_logprobs_of(result: dict[str, Any], ids: list[int], start: int) -> list[float]:
    _check_not_aborted(result)
    entries = result["meta_info"].get("input_token_logprobs") or []
    expected = ids[start:]
    if len(entries) < len(expected):
        raise BackendError(f"the backend returned {len(entries)} prompt logprobs from position {start}, "
                           f"expected {len(expected)} (does it support return_logprob with logprob_start_len?)")
    entries = entries[:len(expected)]
    got_ids = [entry[1] for entry in entries]
    if got_ids != list(expected):
        raise BackendError(f"prompt logprobs are for tokens {got_ids}, expected {list(expected)}")
    logprobs = [entry[0] for entry in entries]
    if any(lp is None for lp in logprobs):
        raise BackendError(f"the backend returned no logprob for some prompt positions from {start}: {logprobs}")
    return [float(lp) for lp in logprobs]
