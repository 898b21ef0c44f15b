"""Text -> token ids (and chat templates) on a thread of their own, with a tokenizer of its own.

Tokenizing a long prompt or rendering a long conversation takes long enough to stall an event loop (a 20 MB
prompt took ~20 s), and a Hugging Face fast tokenizer must not be used by two threads at once (its Rust core
is borrowed mutably while encoding). So the TokenizerManager awaits this worker: one thread, owning the one
tokenizer instance it uses, so calls queue rather than overlap and no event loop ever runs them.

Prompts that arrive while the worker is busy are encoded together, in one `encode_batch` call whose Rust core
spreads the texts over the machine's cores: a burst of long prompts (a thousand requests sent at once) is then
tokenized in parallel rather than one after another, and none waits for the whole queue before it.

Before tokenizing, a text far beyond the context is refused by its length alone: no token of the vocabulary
spells more than `max_chars_per_token` characters, so a text longer than `limit * max_chars_per_token`
characters cannot fit `limit` tokens, and tokenizing it would only waste the worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from typing import Any, Optional

from radixserve.runtime.wire.errors import ContextLengthExceededError, EngineDeadError
from radixserve.tokenizer_manager.chat_templates import BUILTIN_CHAT_TEMPLATES


def load_chat_template(value: Optional[str]) -> Optional[str]:
    """`--chat-template`: a path to a Jinja file, the Jinja template itself, or the name of a built-in template
    (chat_templates.py; a file of that name wins). None: the tokenizer's own."""
    if value is None:
        return None
    if value in BUILTIN_CHAT_TEMPLATES and not os.path.isfile(value):
        return BUILTIN_CHAT_TEMPLATES[value]
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither an existing file, a Jinja template nor a built-in "
                         f"template ({', '.join(BUILTIN_CHAT_TEMPLATES)})")
    return value


def max_chars_per_token(tokenizer: Any) -> int:
    """An upper bound on the characters one token stands for: the longest entry of the vocabulary (byte-level
    entries spell each byte with one character, so they are never shorter than the text they decode to)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


class TokenizerWorker:
    def __init__(self, tokenizer: Any, chat_template: Optional[str] = None) -> None:
        """`tokenizer` becomes this worker's own: nobody else may use that instance afterwards."""
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.max_chars_per_token = max_chars_per_token(tokenizer)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixserve-tokenize")
        self._lock = threading.Lock()
        self._queued: list[tuple[str, asyncio.Future]] = []  # texts waiting for the next batch encode
        self.num_encode_calls = 0  # tokenizer calls made for `encode` (fewer than texts when they batch)
        self._closed = False

    def check_text_length(self, text: str, limit: int) -> None:
        """Refuse a text that cannot fit `limit` tokens, without tokenizing it."""
        if len(text) > limit * self.max_chars_per_token:
            raise ContextLengthExceededError(
                f"the prompt has {len(text)} characters, more than {limit} tokens (the model's limit) can "
                f"hold: no token spells more than {self.max_chars_per_token} characters")

    async def encode(self, text: str, limit: int) -> list[int]:
        self.check_text_length(text, limit)
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._closed:
                raise EngineDeadError("the engine is shut down")
            self._queued.append((text, future))
            first = len(self._queued) == 1
        if first:  # a batch is open: the job it schedules takes every text queued by the time it runs
            self._pool.submit(self._encode_queued)
        return await future

    def _encode_queued(self) -> None:
        """On the worker thread: encode every queued text (together when several) and resolve their futures."""
        with self._lock:
            batch, self._queued = self._queued, []
        texts = [text for text, _ in batch]
        self.num_encode_calls += 1
        try:
            if len(texts) == 1:
                results: list[Any] = [list(self._tokenizer.encode(texts[0]))]
            else:
                results = [list(ids) for ids in self._tokenizer(texts)["input_ids"]]
        except Exception:  # noqa: BLE001 - find the text that fails; the others still get their ids
            results = []
            for text in texts:
                try:
                    results.append(list(self._tokenizer.encode(text)))
                except Exception as error:  # noqa: BLE001 - the caller gets it
                    results.append(error)
        for (_, future), result in zip(batch, results):
            future.get_loop().call_soon_threadsafe(_resolve, future, result)

    async def apply_chat_template(self, conversation: list[dict[str, Any]], limit: int,
                                  **template_kwargs: Any) -> list[int]:
        """Token ids of `conversation` through the chat template (the server's `--chat-template` if given, else
        the tokenizer's), ending with the assistant's turn opener unless the caller says otherwise.

        Raises ValueError when the model has no chat template or the template rejects the conversation."""
        self.check_text_length("".join(str(turn.get("content") or "") for turn in conversation), limit)

        def render() -> list[int]:
            if self.chat_template is None and not getattr(self._tokenizer, "chat_template", None):
                raise ValueError("this model has no chat template; send a plain prompt, or start the server with "
                                 "--chat-template")
            template_kwargs.setdefault("add_generation_prompt", True)
            try:
                encoded = self._tokenizer.apply_chat_template(
                    conversation, chat_template=self.chat_template, tokenize=True, return_dict=True,
                    **template_kwargs)
            except Exception as error:  # the template itself refuses (e.g. roles must alternate)
                raise ValueError(f"the chat template rejected the messages: {error}") from error
            return list(encoded["input_ids"])

        return await self._run(render)

    async def _run(self, work: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    def close(self) -> None:
        """Stop the worker; texts still queued fail with EngineDeadError (their callers never wait forever)."""
        with self._lock:
            self._closed = True
            queued, self._queued = self._queued, []
        self._pool.shutdown(wait=False, cancel_futures=True)
        for _, future in queued:
            future.get_loop().call_soon_threadsafe(_resolve, future, EngineDeadError("the engine is shut down"))


def _resolve(future: asyncio.Future, result: Any) -> None:
    if future.done():  # the caller went away
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
