"""The tool-calling fields of a chat request, as pydantic models (OpenAI's shapes).

`tools` are function definitions; `tool_choice` is "none", "auto", "required" or `{"type": "function",
"function": {"name": ...}}`; assistant messages may carry `tool_calls`, and `tool` messages answer them.
Cross-field rules that OpenAI states (a named choice must name a given tool; "required" needs tools) are
checked by `ChatCompletionRequest`; a parameters schema is checked where it is compiled (tool_grammar.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
MAX_TOOLS = 128


class ToolSchemaError(ValueError):
    """A tool's parameters are not a JSON schema the call grammar can enforce (the message names the tool)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class FunctionDefinition(_Strict):
    name: FunctionName
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None

    def parameters_schema(self) -> dict[str, Any]:
        """The arguments' JSON schema (no parameters: an object with no properties)."""
        if self.parameters is None:
            return {"type": "object", "properties": {}}
        return self.parameters


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]
Tools = Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)]


class FunctionCallIn(_Strict):
    name: FunctionName
    arguments: str


class ToolCallIn(_Strict):
    """An earlier assistant call replayed by the client."""

    id: Annotated[str, Field(min_length=1)]
    type: Literal["function"]
    function: FunctionCallIn
