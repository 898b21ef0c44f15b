"""Early validation of structured-output grammars, so a bad one is a ValueError before anything is queued.

`check_grammar(kind, text)` parses the grammar with xgrammar exactly as the scheduler will compile it, but
without the tokenizer-dependent part (the token masks), which is what makes compilation slow; parsing
takes well under a millisecond for typical schemas. Results are memoised, so a server that sees the same
schema again and again parses it once. The scheduler still compiles on its own and fails only the request
if that fails (e.g. a grammar whose masks cannot be built).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Optional

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")
# xgrammar prefixes its messages with "[time] file.cc:line: "; the rest names the problem.
_XGRAMMAR_LOCATION = re.compile(r"^\s*\[[0-9:. ]+\]\s*\S+:\d+:\s*")
_CACHE_ENTRIES = 1024


def check_grammar(kind: str, text: str) -> None:
    """Raise ValueError ("invalid <kind>: <what is wrong>") unless `text` is a valid `kind` grammar."""
    if kind not in GRAMMAR_KINDS:
        raise ValueError(f"unknown grammar kind {kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}")
    error = _grammar_error(kind, text)
    if error is not None:
        raise ValueError(error)


@functools.lru_cache(maxsize=_CACHE_ENTRIES)
def _grammar_error(kind: str, text: str) -> Optional[str]:
    import xgrammar

    try:
        if kind == "json_schema":
            try:
                json.loads(text)
            except json.JSONDecodeError as error:
                return f"invalid json_schema: not valid JSON ({error})"
            xgrammar.Grammar.from_json_schema(text, any_whitespace=False)
        elif kind == "regex":
            xgrammar.Grammar.from_regex(text)
        else:
            xgrammar.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, TypeError) as error:
        return grammar_error_message(kind, error)
    return None


def grammar_error_message(kind: str, error: BaseException) -> str:
    """A one-line message naming what is wrong with a `kind` grammar, from xgrammar's exception."""
    lines = str(error).strip().splitlines()
    detail = _XGRAMMAR_LOCATION.sub("", lines[0]) if lines else type(error).__name__
    return f"invalid {kind}: {detail}"
