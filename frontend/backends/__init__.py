"""Backends the DSL runs programs on: RuntimeEndpoint (HTTP) and EngineBackend (an in-process Engine)."""

from radixserve.frontend.backends.base import Backend, BackendError, InvalidRequestError, ModalityNotSupportedError
from radixserve.frontend.backends.engine_backend import EngineBackend
from radixserve.frontend.backends.runtime_endpoint import RuntimeEndpoint

__all__ = ["Backend", "BackendError", "InvalidRequestError", "ModalityNotSupportedError", "EngineBackend",
           "RuntimeEndpoint"]
