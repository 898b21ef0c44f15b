"""Token text and bytes for logprobs, and the two OpenAI logprobs formats.

OpenAI reports each token's exact bytes (a byte-level BPE token can hold part of a UTF-8 character), so
token text is derived from the tokenizer's vocabulary, not from decoding the token alone:
- byte-level BPE (GPT-2 style, e.g. SmolLM2, Llama 3, Qwen): each character of the vocabulary entry stands
  for one byte through the printable-character table of GPT-2's byte encoder;
- SentencePiece byte fallback tokens look like `<0x0A>`; `▁` stands for a space;
- anything else (special tokens) is its vocabulary string in UTF-8.

Engine logprob entries are `(logprob, token_id, text_or_None)` tuples; top logprobs are lists of them.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Optional, Sequence

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable character table: printable Latin-1 bytes stand for themselves,
    the other 68 bytes are shifted to code points 256 and up, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table: dict[str, int] = {}
    shifted = 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + shifted)] = byte
            shifted += 1
    return table


_BYTE_LEVEL = _byte_level_decoder()


def _uses_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


class TokenTexts:
    """Per-token bytes and display text of one tokenizer (cached: the vocabulary never changes)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._byte_level = _uses_byte_level(tokenizer)
        self.token_bytes = lru_cache(maxsize=65536)(self._token_bytes)

    def _token_bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(int(token_id))
        if piece is None:
            return b""
        if piece in getattr(self._tokenizer, "all_special_tokens", ()):
            return piece.encode("utf-8")
        if self._byte_level and all(ch in _BYTE_LEVEL for ch in piece):
            return bytes(_BYTE_LEVEL[ch] for ch in piece)
        match = _BYTE_FALLBACK.match(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


def chat_logprobs(
    texts: TokenTexts,
    token_logprobs: Sequence[Sequence[Any]],
    top_logprobs: Optional[Sequence[Sequence[Sequence[Any]]]],
    num_top: int,
) -> dict[str, Any]:
    """The chat format: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}."""

    def entry(logprob: float, token_id: int) -> dict[str, Any]:
        raw = texts.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    content = []
    for i, (logprob, token_id, *_) in enumerate(token_logprobs):
        item = entry(logprob, token_id)
        tops = top_logprobs[i] if top_logprobs is not None and i < len(top_logprobs) else []
        item["top_logprobs"] = [entry(lp, tid) for lp, tid, *_ in (tops or [])[:num_top]]
        content.append(item)
    return {"content": content}


def completion_logprobs(
    texts: TokenTexts,
    token_logprobs: Sequence[Sequence[Any]],
    top_logprobs: Optional[Sequence[Optional[Sequence[Sequence[Any]]]]],
    num_top: int,
    text_offset: int,
) -> dict[str, Any]:
    """The completions format: parallel lists tokens / token_logprobs / top_logprobs / text_offset.

    Each position's top_logprobs holds the `num_top` most likely tokens and always the chosen token itself (so
    up to num_top + 1 entries, and the chosen token alone for logprobs=0, as OpenAI and vLLM do), for prompt
    (echo) and generated positions alike. `token_logprobs` entries may carry a None logprob (the first prompt
    token when echoing: nothing precedes it); its top_logprobs is None."""
    tokens: list[str] = []
    logprobs: list[Optional[float]] = []
    tops: list[Optional[dict[str, float]]] = []
    offsets: list[int] = []
    for i, (logprob, token_id, *_) in enumerate(token_logprobs):
        text = texts.text(token_id)
        tokens.append(text)
        logprobs.append(logprob)
        offsets.append(text_offset)
        text_offset += len(text)
        if logprob is None:
            tops.append(None)
            continue
        entries = top_logprobs[i] if top_logprobs is not None and i < len(top_logprobs) else None
        top = {texts.text(tid): lp for lp, tid, *_ in (entries or [])[:num_top]}
        top.setdefault(text, logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}
