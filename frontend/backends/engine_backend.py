"""Run DSL programs on an in-process radixserve Engine.

    from radixserve import Engine
    from radixserve.frontend import set_default_backend
    engine = Engine()
    set_default_backend(engine)          # wraps it in an EngineBackend

Uses only the Engine's public API (`generate`, `tokenizer`, `get_server_info`, `flush_cache`). The Engine's
sync methods may be called from any thread, so branches and batch programs run concurrently and their
requests batch in the scheduler. The Engine stays owned by the caller: closing the backend does not shut it
down.
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Any, Iterator, Union

from radixserve.frontend.backends.base import Backend
from radixserve.frontend.chat_template import ChatTemplate

_tokenizer_copies: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_copies_lock = threading.Lock()
_ENGINE_ARGS = ("sampling_params", "input_ids", "return_logprob", "logprob_start_len", "top_logprobs_num")


class EngineBackend(Backend):
    """A backend over `engine` (a radixserve Engine, or anything with its generate/tokenizer API)."""

    def __init__(self, engine: Any, chat_template: Union[ChatTemplate, str, None] = None):
        super().__init__(chat_template)
        self.engine = engine

    def _call(self, payload: dict[str, Any], stream: bool) -> Any:
        arguments = {name: payload[name] for name in _ENGINE_ARGS if name in payload}
        return self.engine.generate(payload.get("text"), stream=stream, **arguments)

    def _request(self, payload: dict[str, Any]) -> Any:
        result = self._call(payload, stream=False)
        if payload.get("return_text_in_logprobs"):
            for one in result if isinstance(result, list) else [result]:
                self._add_token_texts(one["meta_info"])
        return result

    def _request_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        for chunk in self._call(payload, stream=True):
            if payload.get("return_text_in_logprobs"):
                self._add_token_texts(chunk["meta_info"])
            yield chunk

    def _add_token_texts(self, meta_info: dict[str, Any]) -> None:
        """Fill the text of each logprob entry, as `/generate` does for return_text_in_logprobs (the Engine's
        generate has no such option; the texts are the tokenizer's decoding of each id)."""
        def with_text(entries: list) -> list:
            return [(logprob, token_id, self.decode([token_id])) for logprob, token_id, _ in entries]

        for key in ("input_token_logprobs", "output_token_logprobs"):
            if meta_info.get(key):
                meta_info[key] = with_text(meta_info[key])
        for key in ("input_top_logprobs", "output_top_logprobs"):
            if meta_info.get(key):
                meta_info[key] = [with_text(top) if top else top for top in meta_info[key]]

    def _load_tokenizer(self) -> Any:
        # A copy: the Engine's TokenizerManager uses its own tokenizer object on another thread, and a Hugging
        # Face fast tokenizer must not be used from two threads at once. One copy per engine, however many
        # backends wrap it (`run(backend=engine)` wraps it each time).
        with _copies_lock:
            try:
                return _tokenizer_copies[self.engine]
            except (KeyError, TypeError):
                pass
        tokenizer = copy.deepcopy(self.engine.tokenizer)
        with _copies_lock:
            try:
                _tokenizer_copies[self.engine] = tokenizer
            except TypeError:  # an engine-like object that cannot be weakly referenced
                pass
        return tokenizer

    def get_server_info(self) -> dict[str, Any]:
        return self.engine.get_server_info()

    def _streams_incrementally(self) -> bool:
        # An Engine without the setting (this version) streams only the new text.
        setting = getattr(getattr(self.engine, "server_args", None), "incremental_streaming_output", None)
        return True if setting is None else bool(setting)

    @property
    def model_name(self) -> str:
        info = getattr(self.engine, "model_info", None)  # the scheduler's ModelInfo
        return str(getattr(info, "model_path", None) or "the engine's model")

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()
