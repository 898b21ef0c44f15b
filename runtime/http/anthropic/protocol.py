"""The Anthropic Messages API's request bodies as pydantic models (`POST /v1/messages`, `/v1/messages/count_tokens`).

Content is a string or a list of blocks: `text` (either role), `tool_use` (the assistant's earlier calls),
`tool_result` (the user's answers to them) and `thinking` / `redacted_thinking` (the assistant's earlier
reasoning, handed back to the template as reasoning content). Images and documents are a 400: the served models
read text only. `cache_control` on a block is Anthropic's cache breakpoint; the radix cache keeps every prefix
anyway, so it asks for nothing more. `output_config.format` (a JSON schema) constrains the text as the chat route's
`response_format` does. `temperature`, `top_p` and `top_k` are taken (the current SDK sends them in `extra_body`).
Fields that cannot change the output (`metadata`, `service_tier`, `speed`, `inference_geo`, `diagnostics`,
`user_profile_id`, `workspace_id`, `container`, `output_config.effort`) are accepted and ignored; any other unknown
field is a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from radixserve.runtime.http.openai.protocol import MAX_STOP_SEQUENCES, StrictModel
from radixserve.runtime.http.openai.protocol_tools import MAX_TOOLS, FunctionName


class CacheControl(StrictModel):
    type: Literal["ephemeral"]
    ttl: Optional[Literal["5m", "1h"]] = None


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: Optional[CacheControl] = None
    citations: Optional[list[Any]] = None


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: FunctionName
    input: dict[str, Any]
    cache_control: Optional[CacheControl] = None


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: Union[str, list[TextBlock], None] = None
    is_error: bool = False
    cache_control: Optional[CacheControl] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(block.text for block in self.content)


class ThinkingBlock(StrictModel):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(StrictModel):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
                         Field(discriminator="type")]


class Message(StrictModel):
    role: Literal["user", "assistant"]
    content: Union[str, Annotated[list[ContentBlock], Field(min_length=1)]]

    @model_validator(mode="after")
    def _blocks_of_role(self) -> "Message":
        if isinstance(self.content, str):
            return self
        allowed = {"user": {"text", "tool_result"},
                   "assistant": {"text", "tool_use", "thinking", "redacted_thinking"}}[self.role]
        for block in self.content:
            if block.type not in allowed:
                raise ValueError(f"{self.role} messages may not hold {block.type} blocks")
        return self

    def blocks(self) -> list[Any]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


class Tool(StrictModel):
    # Anthropic's own tools (bash, text editor, web search) carry a `type`; only custom tools run here.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    name: FunctionName
    description: Optional[str] = None
    input_schema: dict[str, Any]
    type: Optional[Literal["custom"]] = None
    cache_control: Optional[CacheControl] = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[FunctionName] = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_for_tool(self) -> "ToolChoice":
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice names a tool exactly when its type is tool")
        return self


class Thinking(StrictModel):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    display: Optional[Literal["summarized", "omitted"]] = None


class OutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]


class OutputConfig(StrictModel):
    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = None  # accepted and ignored
    format: Optional[OutputFormat] = None


class Metadata(BaseModel):
    model_config = ConfigDict(extra="allow")
    user_id: Optional[str] = None


class CountTokensRequest(StrictModel):
    """`/v1/messages/count_tokens`: the prompt part of a Messages request."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Union[str, list[TextBlock], None] = None
    tools: Optional[Annotated[list[Tool], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None

    @model_validator(mode="after")
    def _check_tools(self) -> "CountTokensRequest":
        names = [tool.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools must have distinct names")
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise ValueError(f"tool_choice {choice.type} needs tools")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
        return self

    def system_text(self) -> Optional[str]:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "\n".join(block.text for block in self.system)


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: Optional[Annotated[list[Annotated[str, Field(min_length=1)]],
                                       Field(max_length=MAX_STOP_SEQUENCES)]] = None
    stream: bool = False
    temperature: Optional[Annotated[float, Field(ge=0.0, le=1.0)]] = None
    top_p: Optional[Annotated[float, Field(ge=0.0, le=1.0)]] = None
    top_k: Optional[Annotated[int, Field(ge=1)]] = None
    output_config: Optional[OutputConfig] = None
    # A breakpoint at the end of the prompt (automatic caching): the radix cache keeps every prefix anyway.
    cache_control: Optional[CacheControl] = None
    # Accepted and ignored: none of them changes the output.
    metadata: Optional[Metadata] = None
    service_tier: Optional[Literal["auto", "standard_only"]] = None
    speed: Optional[Literal["standard", "fast"]] = None
    inference_geo: Optional[str] = None
    diagnostics: Optional[dict[str, Any]] = None
    user_profile_id: Optional[str] = None
    workspace_id: Optional[str] = None
    container: Optional[str] = None
