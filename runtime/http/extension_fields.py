"""SGLang's and vLLM's request fields on the HTTP routes: the tables and the rule live in the wire
(`runtime/wire/compat.py`); this module turns a refusal into the 400 the client sees."""

from __future__ import annotations

from typing import Any

from radixserve.runtime.http.errors import APIError, bad_request
from radixserve.runtime.wire.compat import (  # noqa: F401 - the routes' names for the tables
    NATIVE_LABELS,
    NATIVE_UNSUPPORTED,
    OPENAI_LABELS,
    OPENAI_UNSUPPORTED,
    UnsupportedFieldError,
)
from radixserve.runtime.wire.compat import absorb as absorb_fields


def absorb(body: Any, unsupported: dict[str, str], labels: frozenset[str], where: str = "") -> Any:
    """`compat.absorb`, with a refusal as a 400 naming the field and the feature."""
    try:
        return absorb_fields(body, unsupported, labels, where)
    except UnsupportedFieldError as error:
        raise unsupported_field(error) from None


def unsupported_field(error: UnsupportedFieldError) -> APIError:
    return bad_request(str(error), param=error.field, code="unsupported_feature")
