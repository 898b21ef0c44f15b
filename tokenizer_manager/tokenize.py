"""Text -> token ids (and chat templates) on a thread of their own, with a tokenizer of its own.

Tokenizing a long prompt or rendering a long conversation takes long enough to stall an event loop (a 20 MB
prompt took ~20 s), and a Hugging Face fast tokenizer must not be used by two threads at once (its Rust core
is borrowed mutably while encoding). So the TokenizerManager awaits this worker: one thread, owning the one
tokenizer instance it uses, so calls queue rather than overlap and no event loop ever runs them.

Before tokenizing, a text far beyond the context is refused by its length alone: no token of the vocabulary
spells more than `max_chars_per_token` characters, so a text longer than `limit * max_chars_per_token`
characters cannot fit `limit` tokens, and tokenizing it would only waste the worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from typing import Any, Optional

from radixserve.runtime.wire.errors import ContextLengthExceededError


def load_chat_template(value: Optional[str]) -> Optional[str]:
    """`--chat-template`: a path to a Jinja file, or the Jinja template itself (None: the tokenizer's own)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither an existing file nor a Jinja template")
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

    def check_text_length(self, text: str, limit: int) -> None:
        """Refuse a text that cannot fit `limit` tokens, without tokenizing it."""
        if len(text) > limit * self.max_chars_per_token:
            raise ContextLengthExceededError(
                f"the prompt has {len(text)} characters, more than {limit} tokens (the model's limit) can "
                f"hold: no token spells more than {self.max_chars_per_token} characters")

    async def encode(self, text: str, limit: int) -> list[int]:
        self.check_text_length(text, limit)
        return await self._run(lambda: list(self._tokenizer.encode(text)))

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
        self._pool.shutdown(wait=False, cancel_futures=True)
