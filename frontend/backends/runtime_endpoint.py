"""Run DSL programs against a radixserve server over HTTP (`POST /generate`).

    from radixserve.frontend import RuntimeEndpoint, set_default_backend
    set_default_backend(RuntimeEndpoint("http://127.0.0.1:30000", api_key=None))

The constructor asks `/get_model_info` (so a wrong URL or key fails at once). The tokenizer, needed for
`select` (token boundaries) and the roles (chat template), is loaded on first use from the server's
`tokenizer_path`, which must be readable from the client (the same machine, or a Hugging Face hub id).
A full server (503 "queue_full") is retried after its Retry-After, until `queue_wait` seconds have passed.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from typing import Any, Iterator, Optional, Union

import httpx

from radixserve.frontend.backends.base import Backend, BackendError, InvalidRequestError
from radixserve.frontend.chat_template import ChatTemplate

CONNECT_TIMEOUT_S = 10.0
_SSE_PREFIX = "data: "
_SSE_DONE = "[DONE]"


class RuntimeEndpoint(Backend):
    """A backend over the native HTTP API at `base_url` ("http://host:port"). `api_key`: the server's
    --api-key or a tenant's key. `timeout`: seconds per request (None: no limit; generation can be long)."""

    def __init__(self, base_url: str, api_key: Optional[str] = None, *, timeout: Optional[float] = None,
                 queue_wait: float = 600.0, chat_template: Union[ChatTemplate, str, None] = None):
        super().__init__(chat_template)
        self.base_url = base_url.rstrip("/")
        self.queue_wait = queue_wait
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Connections are pooled; run_batch uses many threads at once, so allow as many connections.
        self._client = httpx.Client(base_url=self.base_url, headers=headers,
                                    timeout=httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S),
                                    limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        self.model_info = self._get("/get_model_info")

    # ---- transport -------------------------------------------------------------------------------

    def _get(self, path: str) -> Any:
        with _transport_errors(self.base_url):
            response = self._client.get(path)
        _raise_for_error(response)
        return response.json()

    def _post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """POST, retrying while the server answers 503 queue_full; raises BackendError for other errors."""
        deadline = time.monotonic() + self.queue_wait
        while True:
            with _transport_errors(self.base_url):
                response = self._client.post(path, json=body)
            if not _queue_full(response) or time.monotonic() >= deadline:
                _raise_for_error(response)
                return response
            _wait_retry_after(response)

    def _request(self, payload: dict[str, Any]) -> Any:
        return self._post("/generate", payload).json()

    def _request_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        deadline = time.monotonic() + self.queue_wait
        while True:
            with _transport_errors(self.base_url), \
                    self._client.stream("POST", "/generate", json=payload) as response:
                if _queue_full(response) and time.monotonic() < deadline:
                    response.read()
                    _wait_retry_after(response)
                    continue
                if response.status_code != 200:
                    response.read()
                    _raise_for_error(response)
                for line in response.iter_lines():
                    if not line.startswith(_SSE_PREFIX):
                        continue
                    data = line[len(_SSE_PREFIX):]
                    if data == _SSE_DONE:
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise BackendError(_error_message(chunk))
                    yield chunk
                return

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        info = self.model_info.get("info") or {}
        path = info.get("tokenizer_path") or self.model_info.get("tokenizer_path")
        if not path:
            raise BackendError("the server did not say where its tokenizer is (/get_model_info tokenizer_path)")
        try:
            return AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as error:
            raise BackendError(f"cannot load the server's tokenizer from {path!r} on this machine: {error}") from None

    # ---- server control --------------------------------------------------------------------------

    def get_server_info(self) -> dict[str, Any]:
        return self._get("/get_server_info")

    def _streams_incrementally(self) -> bool:
        """The server's incremental_streaming_output, as /get_server_info reports it (at the top level, as
        SGLang does, or under "server_args"); a server that does not report it streams new text only."""
        try:
            info = self.get_server_info()
        except BackendError as error:
            if error.status_code not in (401, 403):
                raise
            info = {}  # a key that may not read the server's information: rely on the model info
        for source in (info, info.get("server_args"), self.model_info):
            if isinstance(source, dict) and source.get("incremental_streaming_output") is not None:
                return bool(source["incremental_streaming_output"])
        return True

    @property
    def model_name(self) -> str:
        return str(self.model_info.get("model_path") or self.base_url)

    def flush_cache(self) -> bool:
        with _transport_errors(self.base_url):
            response = self._client.post("/flush_cache")
        return response.status_code == 200

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "RuntimeEndpoint":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


@contextlib.contextmanager
def _transport_errors(url: str) -> Iterator[None]:
    """Connection failures and timeouts as BackendError, like every other failure of a backend."""
    try:
        yield
    except httpx.TransportError as error:
        raise BackendError(f"cannot talk to the server at {url}: {type(error).__name__}: {error}") from error


def _queue_full(response: httpx.Response) -> bool:
    if response.status_code != 503:
        return False
    try:
        response.read()
        return response.json()["error"].get("code") == "queue_full"
    except (ValueError, KeyError, TypeError, AttributeError):
        return False


def _wait_retry_after(response: httpx.Response) -> None:
    try:
        delay = float(response.headers.get("Retry-After", "1"))
    except ValueError:
        delay = 1.0
    # Jitter, so that many waiting threads do not all come back at the same instant.
    time.sleep(min(delay, 5.0) * random.uniform(0.1, 0.6))


def _error_message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    return str(body)


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code == 200:
        return
    try:
        message = _error_message(response.json())
    except ValueError:
        message = response.text
    error_type = InvalidRequestError if response.status_code == 400 else BackendError
    raise error_type(f"HTTP {response.status_code}: {message}", status_code=response.status_code)
