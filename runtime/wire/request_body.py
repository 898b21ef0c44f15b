"""Native `/generate`'s JSON body as the wire's GenerateRequest (request.py), with the errors a client can act on.

    request = decode_json(raw)   # RequestFieldError / compat.UnsupportedFieldError, `field` naming the field

SGLang's fields without a feature here pass when they ask for nothing (compat.py), null means the default for the
fields that have one, and a field that neither GenerateRequest nor the tables know is refused, as are the fields
only the server sets. msgspec checks the types and bounds GenerateRequest's annotations give.
"""

from __future__ import annotations

import msgspec

from radixserve.runtime.wire.compat import NATIVE_LABELS, NATIVE_UNSUPPORTED, absorb, asks_for_nothing
from radixserve.runtime.wire.request import (
    MAX_BATCH,
    PER_PROMPT_FIELDS,
    SERVER_FIELDS,
    GenerateRequest,
    RequestFieldError,
)

_NULL_IS_DEFAULT = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "stream")


def decode_json(raw: bytes) -> GenerateRequest:
    """Native `/generate`'s body as a GenerateRequest; RequestFieldError (or compat's UnsupportedFieldError, both
    naming the field) for a body that is not one (see the module docstring)."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as error:
        raise RequestFieldError(f"The request body is not valid JSON: {error}") from None
    except RecursionError:  # msgspec's decoder refuses nesting deeper than it recurses
        raise RequestFieldError("The request body is not valid JSON: nested too deeply.") from None
    if not isinstance(body, dict):
        raise RequestFieldError("The request body must be a JSON object.")
    body = absorb(body, NATIVE_UNSUPPORTED, NATIVE_LABELS)
    if asks_for_nothing(body.get("lora_path")):
        body.pop("lora_path", None)  # SGLang's clients send null (or [null] per prompt) for the base model
    body = {name: value for name, value in body.items() if value is not None or name not in _NULL_IS_DEFAULT}
    for name in body:
        if name in SERVER_FIELDS:
            raise _unknown_field(name)
    try:
        request = msgspec.convert(body, GenerateRequest)
    except msgspec.ValidationError as error:
        raise _validation_error(str(error)) from None
    _check_body_shape(request)
    return request


def _check_body_shape(request: GenerateRequest) -> None:
    """What a JSON body must get right beyond its fields' types (the Engine's callers get more latitude)."""
    if (request.text is None) == (request.input_ids is None):
        raise RequestFieldError("give exactly one of text and input_ids")
    size = None if request.is_single else len(request.text if request.text is not None else request.input_ids)
    if size is not None and size > MAX_BATCH:
        raise RequestFieldError(f"a batch holds at most {MAX_BATCH} prompts, got {size}",
                                "text" if request.text is not None else "input_ids")
    for name in PER_PROMPT_FIELDS:
        value = getattr(request, name)
        if isinstance(value, list):
            if size is None:
                raise RequestFieldError(f"{name} is a list but the request is not a batch", name)
            if len(value) != size:
                raise RequestFieldError(f"{name} has {len(value)} entries for a batch of {size}", name)
        elif name == "rid" and value is not None and size is not None:
            raise RequestFieldError("a batch needs a list of rids", name)


def _unknown_field(name: str) -> RequestFieldError:
    return RequestFieldError(f"Unrecognized request argument supplied: {name}", name)


def _validation_error(message: str) -> RequestFieldError:
    """msgspec's "Expected `int` >= 0 - at `$.input_ids[0]`" as "input_ids[0]: Expected `int` >= 0"."""
    text, _, path = message.partition(" - at `")
    if text.startswith("Object contains unknown field `") and not path:
        return _unknown_field(text.split("`")[1])
    field = path.rstrip("`").removeprefix("$").removeprefix(".") or None
    return RequestFieldError(f"{field}: {text}" if field else text, field)
