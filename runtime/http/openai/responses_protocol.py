"""The body of OpenAI's `POST /v1/responses` as pydantic models.

`input` is a string (one user message) or a list of items: messages (`role` and `content`, a string or
`input_text` / `output_text` parts; `type: "message"` may be left out), `function_call` items (the model's earlier
calls, replayed) and `function_call_output` items (their results); `reasoning` items handed back are accepted
and left out of the prompt, as the chat templates drop earlier reasoning. `tools` are function tools only (the
hosted tools, web or file search and the like, are a 400). `text.format` is text, json_object or json_schema.
Fields that cannot change the output (`metadata`, `user`, `safety_identifier`, `service_tier`, `include` of
nothing, `reasoning`'s effort and summary) are accepted and ignored. `prompt_cache_key` with
`prompt_cache_retention` retains the conversation's prefix in the radix cache (in_memory: 10 minutes, 24h: a day)
after each turn; the key alone asks for nothing more, since every prefix is cached anyway; what this server cannot do (background runs, `truncation: "auto"`, stored prompts, conversations) is a
400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, model_validator

from radixserve.runtime.http.openai.protocol import StrictModel
from radixserve.runtime.http.openai.protocol_tools import MAX_TOOLS, FunctionName


class _Item(StrictModel):
    # Items the client hands back from an earlier response carry output-only keys (annotations, logprobs).
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class TextPart(_Item):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[TextPart]]
    id: Optional[str] = None
    status: Optional[str] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: FunctionName
    arguments: str
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: Union[str, list[TextPart]]
    id: Optional[str] = None
    status: Optional[str] = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(part.text for part in self.output)


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    id: Optional[str] = None


def _item_type(value: Any) -> str:
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]], Discriminator(_item_type)]


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: FunctionName
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class NamedFunction(StrictModel):
    type: Literal["function"]
    name: FunctionName


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> "TextFormat":
        if (self.type == "json_schema") != (self.schema_ is not None):
            raise ValueError("text.format has a schema exactly when its type is json_schema")
        return self


class TextConfig(StrictModel):
    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None  # accepted and ignored


class Reasoning(StrictModel):
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None


class ResponsesRequest(StrictModel):
    model: Optional[str] = None
    input: Union[str, Annotated[list[InputItem], Field(min_length=1)]]
    instructions: Optional[str] = None
    tools: Optional[Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedFunction, None] = None
    parallel_tool_calls: bool = True
    max_output_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    temperature: Optional[Annotated[float, Field(ge=0.0, le=2.0)]] = None
    top_p: Optional[Annotated[float, Field(ge=0.0, le=1.0)]] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[Reasoning] = None
    store: bool = True
    previous_response_id: Optional[Annotated[str, Field(min_length=1)]] = None
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    truncation: Literal["disabled"] = "disabled"
    background: Literal[False] = False
    include: Annotated[list[str], Field(max_length=0)] = []
    # Accepted and ignored: none of them changes the output.
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    service_tier: Optional[str] = None
    # A session whose prefix is retained (radix_cache/retention.py) when a retention is given; alone, a hint only.
    prompt_cache_key: Optional[Annotated[str, Field(min_length=1, max_length=256)]] = None
    prompt_cache_retention: Optional[Literal["in_memory", "24h"]] = None

    @model_validator(mode="after")
    def _check(self) -> "ResponsesRequest":
        names = [tool.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools must have distinct names")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not names:
            raise ValueError("tool_choice other than none needs tools")
        if isinstance(choice, NamedFunction) and choice.name not in names:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
        if self.prompt_cache_retention is not None and self.prompt_cache_key is None:
            raise ValueError("prompt_cache_retention keeps a session's prefix: give its prompt_cache_key too")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def items(self) -> list[Any]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)
