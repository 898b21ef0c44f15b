"""Exceptions the TokenizerManager raises to callers (re-exported by the Engine and the HTTP server)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """A child process died (or the engine was shut down): pending and later requests fail with this."""


class ContextLengthExceededError(ValueError):
    """The prompt plus max_new_tokens does not fit in the model's context window (or the KV pool)."""


class RequestFailedError(Exception):
    """The engine could not finish a request (the others go on); `status_code` is its HTTP status."""

    status_code = 500


class InvalidRequestError(RequestFailedError, ValueError):
    """The request cannot be served as asked (e.g. its constraints allow no token): the caller's to fix."""

    status_code = 400


class RequestInternalError(RequestFailedError, RuntimeError):
    """An internal fault failed this one request; the engine keeps serving the others."""


def request_failed(message: str, status_code: int) -> RequestFailedError:
    """The exception of a request that finished with an error status."""
    error = InvalidRequestError(message) if 400 <= status_code < 500 else RequestInternalError(message)
    error.status_code = status_code
    return error
