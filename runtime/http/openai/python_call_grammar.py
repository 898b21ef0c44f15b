"""EBNF for one call in the pythonic tool-call format, `name(key=value, ...)`, with every value a Python literal
constrained by the tool's JSON schema.

The values are what `tool_parsers/pythonic.py` reads back with `ast`: strings in double or single quotes
(`maxLength` / `minLength` count characters, an escape being one), integers and floats (bounds are enforced by
xgrammar's own JSON-schema grammar of the number, whose spelling Python shares), `True` / `False` / `None`,
lists and dicts (`{"key": value}`) built the same way, `enum` / `const` as the exact literals. Keyword
arguments and dict keys come in the schema's property order; required ones must be present, others may be left
out, and undeclared ones are not allowed (xgrammar's strict reading of JSON schema), except that an object
schema with no properties takes any dict (of `additionalProperties` values). `$ref` to local `$defs` /
`definitions` is followed (recursively if need be). Keywords that a grammar cannot enforce here (`allOf`,
`not`, `patternProperties`, ...) are refused with a ToolSchemaError rather than silently dropped.
"""

from __future__ import annotations

import json
import keyword
import re
from typing import Any, Callable, Optional

from radixserve.runtime.http.openai.protocol_tools import ToolSchemaError

UNSUPPORTED = ("allOf", "not", "if", "then", "else", "patternProperties", "prefixItems", "contains", "uniqueItems",
               "propertyNames", "dependentRequired", "dependentSchemas", "unevaluatedProperties", "minProperties",
               "maxProperties", "multipleOf")
_NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_RULE_DEFINITION = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\s*::=", re.MULTILINE)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CHAR = r"""[^\0-\x1f{quote}\\] | "\\" [\"\\'nrtbf]"""

ANY_RULES = {
    "py_any": "py_string | py_number | \"True\" | \"False\" | \"None\" | py_list | py_dict",
    "py_string": "\"\\\"\" py_dq_char* \"\\\"\" | \"'\" py_sq_char* \"'\"",
    "py_dq_char": _CHAR.format(quote='\\"'),
    "py_sq_char": _CHAR.format(quote="'"),
    "py_number": "\"-\"? (\"0\" | [1-9] [0-9]*) (\".\" [0-9]+)? ([eE] [+\\-]? [0-9]+)?",
    "py_integer": "\"-\"? (\"0\" | [1-9] [0-9]*)",
    "py_list": "\"[\" (py_any (\", \" py_any)*)? \"]\"",
    "py_dict": "\"{\" (py_string \": \" py_any (\", \" py_string \": \" py_any)*)? \"}\"",
}


def ebnf_string(text: str) -> str:
    """`text` as an EBNF string literal (xgrammar reads JSON's escapes)."""
    return json.dumps(text, ensure_ascii=False)


def python_literal(value: Any) -> list[str]:
    """The spellings of `value` as a Python literal that the grammar allows (a string in either quote)."""
    if isinstance(value, bool) or value is None:
        return [repr(value)]
    if isinstance(value, str):
        double = json.dumps(value, ensure_ascii=False)
        single = "'" + double[1:-1].replace("\\\"", "\"").replace("'", "\\'") + "'"
        return [double, single]
    if isinstance(value, (int, float)):
        return [json.dumps(value)]
    if isinstance(value, list):
        return ["[" + ", ".join(python_literal(item)[0] for item in value) + "]"]
    if isinstance(value, dict):
        return ["{" + ", ".join(f"{python_literal(str(k))[0]}: {python_literal(v)[0]}" for k, v in value.items())
                + "}"]
    raise ToolSchemaError(f"enum or const value {value!r} is not a JSON value")


def embed_grammar(ebnf: str, prefix: str) -> tuple[str, dict[str, str]]:
    """The rules of grammar `ebnf` with its rule names prefixed (so several fit in one grammar), and its root."""
    defined = set(_RULE_DEFINITION.findall(ebnf))
    out: list[str] = []
    i = 0
    while i < len(ebnf):
        char = ebnf[i]
        if char in "\"[":  # string literals and character classes hold no rule names
            close = '"' if char == '"' else "]"
            j = i + 1
            while j < len(ebnf) and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i:j + 1])
            i = j + 1
            continue
        match = _IDENTIFIER.match(ebnf, i)
        if match and (i == 0 or not (ebnf[i - 1].isalnum() or ebnf[i - 1] == "_")):
            word = match.group(0)
            # xgrammar's basic_* rules are the same in every JSON grammar: shared, not copied
            out.append(prefix + word if word in defined and not word.startswith("basic_") else word)
            i = match.end()
            continue
        out.append(char)
        i += 1
    rules = {}
    for line in "".join(out).splitlines():
        if "::=" in line:
            name, body = line.split("::=", 1)
            rules[name.strip()] = body.strip()
        elif line.strip():  # a rule continued over several lines
            rules[name.strip()] += " " + line.strip()
    return prefix + "root", rules


class PythonCallGrammar:
    """Builds the rules of calls to a set of tools; `ebnf()` is the grammar whose root is one call."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = {}
        self._refs: dict[str, str] = {}
        self._root_schema: dict[str, Any] = {}

    def _add(self, hint: str, body: str) -> str:
        name = f"{hint}_{len(self.rules)}"
        self.rules[name] = body
        return name

    def _any(self) -> str:
        self.rules.update(ANY_RULES)
        return "py_any"

    def call(self, name: str, schema: dict[str, Any], where: str) -> str:
        """A rule for `name(<keyword arguments of schema>)`."""
        self._root_schema, self._refs = schema, {}
        if not name.isidentifier() or keyword.iskeyword(name):
            raise ToolSchemaError(f"{where}: {name!r} cannot be the name of a function in a pythonic call")
        properties = schema.get("properties") or {}
        for key in properties:
            if not key.isidentifier() or keyword.iskeyword(key):
                raise ToolSchemaError(f"{where}: property {key!r} cannot be a keyword argument of a pythonic call")
        self._check(schema, where)
        body = self._members(properties, set(schema.get("required") or ()), where,
                             lambda key: ebnf_string(f"{key}="))
        return self._add("call", f"{ebnf_string(name + '(')} {body} \")\"")

    def ebnf(self, call_rules: list[str]) -> str:
        lines = [f"root ::= {' | '.join(call_rules)}"] + [f"{name} ::= {body}" for name, body in self.rules.items()]
        return "\n".join(lines)

    def _check(self, schema: dict[str, Any], where: str) -> None:
        for key in UNSUPPORTED:
            if key in schema:
                raise ToolSchemaError(f"{where}: {key!r} is not supported in pythonic tool calls")

    def _members(self, properties: dict[str, Any], required: set[str], where: str,
                 label: Callable[[str], str]) -> str:
        """Properties in order, the required ones present, separated by ", " (a rule); `label` spells a key."""
        items = [(f"{label(key)} {self.value(schema, f'{where}.{key}')}", key in required)
                 for key, schema in properties.items()]
        # tail_i: members i.. each with its leading ", "; head_i: members i.., the first present one without it.
        tail, head = '""', '""'
        for text, is_required in reversed(items):
            after = tail
            tail = self._add("tail", f'", " {text} {after}' if is_required else f'", " {text} {after} | {after}')
            head = self._add("head", f"{text} {after}" if is_required else f"{text} {after} | {head}")
        return head

    def value(self, schema: Any, where: str) -> str:
        """A rule (or inline expression) for one value of `schema`."""
        if schema is True or schema == {}:
            return self._any()
        if not isinstance(schema, dict):
            raise ToolSchemaError(f"{where}: a schema must be an object")
        self._check(schema, where)
        if "$ref" in schema:
            return self._ref(schema["$ref"], where)
        if "const" in schema:
            return self._add("const", " | ".join(ebnf_string(s) for s in python_literal(schema["const"])))
        if "enum" in schema:
            options = [ebnf_string(s) for value in schema["enum"] for s in python_literal(value)]
            return self._add("enum", " | ".join(options) if options else '""')
        for combinator in ("anyOf", "oneOf"):
            if combinator in schema:
                return self._add("any_of", " | ".join(self.value(option, f"{where}.{combinator}[{i}]")
                                                      for i, option in enumerate(schema[combinator])))
        kind = schema.get("type")
        if isinstance(kind, list):
            return self._add("types", " | ".join(self.value({**schema, "type": k}, where) for k in kind))
        if kind is None:
            return self._any()
        if kind == "boolean":
            return self._add("bool", '"True" | "False"')
        if kind == "null":
            return '"None"'
        if kind == "string":
            return self._string(schema, where)
        if kind in ("integer", "number"):
            return self._number(schema, kind)
        if kind == "array":
            return self._array(schema, where)
        if kind == "object":
            return self._object(schema, where)
        raise ToolSchemaError(f"{where}: unknown type {kind!r}")

    def _string(self, schema: dict[str, Any], where: str) -> str:
        if "pattern" in schema or "format" in schema:
            return self._delegate(schema)  # xgrammar's JSON string: the same spelling for Python
        low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
        count = f"{{{low}, {int(high)}}}" if high is not None else ("*" if low == 0 else f"{{{low}, -1}}")
        self.rules.update(ANY_RULES)
        return self._add("string", f"\"\\\"\" py_dq_char{count} \"\\\"\" | \"'\" py_sq_char{count} \"'\"")

    def _number(self, schema: dict[str, Any], kind: str) -> str:
        if any(bound in schema for bound in _NUMBER_BOUNDS):
            return self._delegate(schema)
        self.rules.update(ANY_RULES)
        return "py_integer" if kind == "integer" else "py_number"

    def _delegate(self, schema: dict[str, Any]) -> str:
        """xgrammar's grammar of a JSON leaf (a bounded number, a string with a pattern or format)."""
        import xgrammar

        try:
            leaf = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        except (RuntimeError, ValueError, TypeError) as error:
            raise ToolSchemaError(str(error).strip().splitlines()[0]) from None
        root, rules = embed_grammar(str(leaf), f"leaf{len(self.rules)}_")
        self.rules.update(rules)
        return root

    def _array(self, schema: dict[str, Any], where: str) -> str:
        item = self.value(schema.get("items", True), f"{where}.items")
        low, high = int(schema.get("minItems", 0)), schema.get("maxItems")
        if high is not None and int(high) < low:
            raise ToolSchemaError(f"{where}: maxItems is below minItems")
        more_low = max(low - 1, 0)
        more = f"{{{more_low}, {int(high) - 1}}}" if high is not None else f"{{{more_low}, -1}}"
        filled = f"\"[\" {item} (\", \" {item}){more} \"]\""
        if high is not None and int(high) == 0:
            return '"[]"'
        return self._add("list", filled if low > 0 else f"{filled} | \"[]\"")

    def _object(self, schema: dict[str, Any], where: str) -> str:
        properties = schema.get("properties") or {}
        if not properties and schema.get("additionalProperties", True) not in (False, None):
            additional = schema.get("additionalProperties", True)
            value = self.value(additional if isinstance(additional, dict) else True, f"{where}.*")
            self.rules.update(ANY_RULES)
            entry = f"py_string \": \" {value}"
            return self._add("dict", f"\"{{\" ({entry} (\", \" {entry})*)? \"}}\"")
        body = self._members(properties, set(schema.get("required") or ()), where,
                             lambda key: "(" + " | ".join(ebnf_string(s + ": ") for s in python_literal(key)) + ")")
        return self._add("dict", f"\"{{\" {body} \"}}\"")

    def _ref(self, ref: Any, where: str) -> str:
        if not isinstance(ref, str) or not re.fullmatch(r"#/(\$defs|definitions)/[^/]+", ref):
            raise ToolSchemaError(f"{where}: only local $ref to #/$defs/... is supported, got {ref!r}")
        if ref not in self._refs:
            section, name = ref[2:].split("/", 1)
            target = (self._root_schema.get(section) or {}).get(name)
            if target is None:
                raise ToolSchemaError(f"{where}: $ref {ref!r} names no definition")
            rule = self._add("ref", '""')
            self._refs[ref] = rule
            self.rules[rule] = self.value(target, ref)
        return self._refs[ref]


def python_calls_grammar(tools: list[tuple[str, dict[str, Any]]], where: Optional[list[str]] = None) -> str:
    """EBNF whose root is one pythonic call of any of `tools` (name, parameters schema)."""
    builder = PythonCallGrammar()
    labels = where or [f"tools[{i}].function.parameters" for i in range(len(tools))]
    calls = [builder.call(name, schema, label) for (name, schema), label in zip(tools, labels)]
    return builder.ebnf(calls)
