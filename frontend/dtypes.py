"""Typed generation: `gen(dtype=int)`, `gen_int()`, `gen_string()` as regex constraints (SGLang's dtypes).

A dtype becomes a regex the output must match, so the value parses as that type:

| dtype | output | parse with |
|---|---|---|
| int   | an optional sign and digits, e.g. `-42` | `int(value)` |
| float | a decimal number, optionally with an exponent, e.g. `3.14`, `1e-3` | `float(value)` |
| bool  | `True` or `False` | `value == "True"` |
| str   | a double-quoted string without `"`, `\\` or control characters inside: `"Paris"` | `json.loads(value)` |

Numbers may be followed by spaces or a newline, and for int and float a space and a newline are added to the
stop strings, so the model ends a number the natural way and the stop string is not part of the value (as in
SGLang). When a gen has both a dtype and a regex, the dtype wins, with a warning (as in SGLang).
"""

from __future__ import annotations

from typing import Any, Optional

_NUMBER_END = "[ \\n]*"
REGEX_INT = "[+-]?[0-9]+" + _NUMBER_END
REGEX_FLOAT = "[+-]?([0-9]+\\.?[0-9]*|\\.[0-9]+)([eE][+-]?[0-9]+)?" + _NUMBER_END
REGEX_BOOL = "(True|False)"
REGEX_STR = '"[^"\\\\\\x00-\\x1f]*"'
REGEX_STRING = REGEX_STR  # SGLang's older name

NUMBER_STOPS = (" ", "\n")

_BY_NAME = {"int": REGEX_INT, "float": REGEX_FLOAT, "bool": REGEX_BOOL, "str": REGEX_STR}
_TYPES = {int: "int", float: "float", bool: "bool", str: "str"}


def dtype_name(dtype: Any) -> Optional[str]:
    """The dtype as one of "int", "float", "bool", "str" (given as the type or its name); None for None.
    ValueError for anything else."""
    if dtype is None:
        return None
    name = _TYPES.get(dtype, dtype) if isinstance(dtype, type) else dtype
    if name not in _BY_NAME:
        raise ValueError(f"unsupported dtype {dtype!r}: use int, float, bool or str (or their names)")
    return name


def dtype_regex(name: str) -> str:
    return _BY_NAME[name]


def dtype_stops(name: str) -> tuple[str, ...]:
    """Stop strings a dtype adds to the gen's own: a number ends at a space or newline."""
    return NUMBER_STOPS if name in ("int", "float") else ()
