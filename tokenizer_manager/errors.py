"""Exceptions the TokenizerManager raises to callers (re-exported by the Engine and the HTTP server)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """A child process died (or the engine was shut down): pending and later requests fail with this."""


class ContextLengthExceededError(ValueError):
    """The prompt plus max_new_tokens does not fit in the model's context window (or the KV pool)."""
