"""The rules that merge data-parallel replicas' reports field by field (runtime/wire/server_info.py says which
field takes which): summed, summed per struct, or kept once with a logged warning when the replicas disagree.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence, TypeVar

import msgspec

logger = logging.getLogger(__name__)

S = TypeVar("S", bound=msgspec.Struct)


def _sum(parts: Sequence[Any], name: str) -> Any:
    return sum(getattr(part, name) for part in parts)


def _summed(cls: type[S], parts: Sequence[S], **kept: Any) -> S:
    """A `cls` whose fields are the sums of the parts' (except those given in `kept`)."""
    return cls(**{name: _sum(parts, name) for name in cls.__struct_fields__ if name not in kept}, **kept)


def _kept_once(values: Sequence[Any], what: str = "", exclude: Sequence[str] = ()) -> Any:
    """The first value, after checking that the others equal it (structs: field by field, but those in
    `exclude`). A disagreement is logged, not raised: a report must still be given while replicas of two
    deployments serve side by side."""
    first = values[0]
    if isinstance(first, msgspec.Struct) and exclude:
        for name in first.__struct_fields__:
            if name not in exclude:
                _kept_once([getattr(value, name) for value in values], name)
        return first
    differing = [value for value in values[1:] if value != first]
    if differing:
        logger.warning("replicas report different %s (%r and %r); showing the first replica's", what or "values",
                       first, differing[0])
    return first
