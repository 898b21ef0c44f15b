"""Request bodies of the HTTP API as pydantic models: OpenAI's fields, plus the extras this server adds.

Validation is strict (a string is not a number, `"true"` is not a boolean), rejects NaN and infinities,
and rejects unknown top-level fields with 400 like OpenAI does. OpenAI fields that this server accepts but
ignores, because they cannot change the generated text: `user`, `store`, `metadata`, `service_tier`. Every
other field either works or is a 400. Tool calling (`tools`, `tool_choice`, `parallel_tool_calls`, assistant
`tool_calls`, `tool` messages) is described in protocol_tools.py and docs/tools.md.

Extras (SGLang's names): `top_k` (0, as vLLM has it, is no limit, like -1), `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`,
`skip_special_tokens`, `cache_salt`, `separate_reasoning`, chat's `continue_final_message` / `add_generation_prompt` /
`chat_template_kwargs`, `stream_options.continuous_usage_stats`, and the structured-output constraints `regex` and `ebnf` (besides OpenAI's
`response_format`, which both routes take; at most one of the three). vLLM's: `structured_outputs` (the same
constraints under vLLM's names), `spaces_between_special_tokens`, chat `echo`, and roles of the template's own
besides OpenAI's. The native `/generate` route takes
SGLang's `sampling_params` dict as it is: `SamplingParams.from_request` checks it. SGLang's and vLLM's other
extensions are accepted at their default and refused with a 400 naming the feature otherwise
(extension_fields.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, TypeVar, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from radixserve.runtime.http.extension_fields import OPENAI_LABELS, OPENAI_UNSUPPORTED, absorb
from radixserve.runtime.http.errors import validation_error
from radixserve.runtime.http.openai.protocol_tools import Tool, ToolCallIn, ToolChoice, Tools

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_STOP_SEQUENCES = 32
MAX_N = 128
MAX_TOP_LOGPROBS = 20


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


ModelT = TypeVar("ModelT", bound=StrictModel)


def parse_request(model: type[ModelT], raw: bytes) -> ModelT:
    """Validate a raw JSON body; any problem (bad JSON, types, ranges, unknown fields) is a 400 APIError."""
    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as error:
        raise validation_error(error) from None


Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
Stop = Union[NonEmptyStr, Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP_SEQUENCES)], None]
LogitBias = Optional[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]]]


def stop_list(stop: Union[str, list[str], None]) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def parse_logit_bias(bias: Optional[dict[str, float]], param: str = "logit_bias") -> Optional[dict[int, float]]:
    """JSON object keys are strings; token ids must be decimal integers."""
    if not bias:
        return None
    parsed: dict[int, float] = {}
    for key, value in bias.items():
        if not key.isdigit() or len(key) > 19:
            raise ValueError(f"{param} keys must be token ids (non-negative integers), got {key!r}")
        parsed[int(key)] = float(value)
    return parsed


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's and SGLang's: usage so far in every chunk too


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs`: one constraint, the same as one of radixserve's own (`json`: a JSON schema as
    response_format's json_schema; `json_object`: any JSON object; `regex`; `choice`: exactly one of the strings;
    `grammar`: an EBNF grammar as `ebnf`). vLLM's tuning knobs are accepted at their default and refused by name
    otherwise: xgrammar, the one backend here, always runs without them."""

    json_schema: Union[dict[str, Any], str, None] = Field(None, alias="json")
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[Annotated[list[str], Field(min_length=1)]] = None
    grammar: Optional[str] = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None
    structural_tag: Optional[str] = None

    @model_validator(mode="after")
    def _one_constraint(self) -> "StructuredOutputs":
        for knob in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                     "whitespace_pattern", "structural_tag"):
            if getattr(self, knob):
                raise ValueError(f"structured_outputs.{knob} is not supported (xgrammar, the only grammar backend "
                                 f"here, runs with its defaults); leave it out")
        given = [name for name in ("json", "json_object", "regex", "choice", "grammar")
                 if getattr(self, "json_schema" if name == "json" else name)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of json, json_object, regex, choice and grammar; "
                             f"got {', '.join(given) or 'none'}")
        return self


class OpenAISamplingFields(StrictModel):
    """Fields shared by chat and completions requests."""

    model: Optional[str] = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    logit_bias: LogitBias = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    seed: Optional[Seed] = None
    stop: Stop = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[Annotated[float, Field(ge=0.0, le=2.0)]] = None
    top_p: Optional[Annotated[float, Field(ge=0.0, le=1.0)]] = None
    # Accepted and ignored: none of them changes the output.
    user: Optional[str] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    # Extras. The sampling values left None are unset: the model's defaults fill them (--sampling-defaults).
    top_k: Optional[Annotated[int, Field(ge=-1, le=INT64_MAX)]] = None
    min_p: Optional[Annotated[float, Field(ge=0.0, le=1.0)]] = None
    repetition_penalty: Optional[Annotated[float, Field(gt=0.0, le=2.0)]] = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0
    stop_token_ids: Annotated[list[TokenId], Field(max_length=256)] = []
    skip_special_tokens: bool = True
    cache_salt: Optional[Annotated[str, Field(max_length=256)]] = None
    priority: Optional[Annotated[int, Field(ge=-INT64_MAX, le=INT64_MAX)]] = None  # --enable-priority-scheduling
    lora_path: Optional[str] = None  # SGLang's: a LoRA adapter's name (or give it as `model`)
    # SGLang's two names for the data-parallel replica to run on (sglang-router --dp-aware sends one).
    data_parallel_rank: Optional[Annotated[int, Field(ge=0, le=1 << 16)]] = None
    routed_dp_rank: Optional[Annotated[int, Field(ge=0, le=1 << 16)]] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    structured_outputs: Optional[StructuredOutputs] = None  # vLLM's
    # vLLM's (and SGLang's sampling parameter of that name): the detokenizer's, as on /generate. Fast tokenizers (the
    # only kind here, and vLLM's default) join special tokens as they are either way.
    spaces_between_special_tokens: bool = True

    @property
    def dp_rank(self) -> Optional[int]:
        return self.data_parallel_rank if self.routed_dp_rank is None else self.routed_dp_rank

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, bias: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        parse_logit_bias(bias)
        return bias

    @model_validator(mode="before")
    @classmethod
    def _extension_fields(cls, data: Any) -> Any:
        """SGLang's and vLLM's extensions without a feature here pass at their default (extension_fields.py)."""
        return absorb(data, OPENAI_UNSUPPORTED, OPENAI_LABELS)

    @model_validator(mode="after")
    def _check_stream_options(self) -> "OpenAISamplingFields":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage so far in every chunk (continuous_usage_stats, with include_usage, as vLLM does)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    # Keys SGLang's and vLLM's clients add to messages (reasoning_content, ...) are ignored, as those servers do.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    # OpenAI's roles, or any other the chat template knows (vLLM passes such roles to the template as they are).
    role: Annotated[str, Field(min_length=1)]
    content: Union[str, Annotated[list[TextContentPart], Field(min_length=1)], None] = None
    name: Optional[str] = None
    # Sent back by clients that replay a previous assistant message; harmless only when empty.
    refusal: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None
    function_call: None = None
    audio: None = None
    annotations: Optional[list[Any]] = None

    @model_validator(mode="after")
    def _check_content(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for {self.role} messages")
        if self.refusal:
            raise ValueError("assistant refusals are not supported in the input")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("tool messages need a tool_call_id, and only they may have one")
        return self

    def text(self) -> str:
        """The message content as one string (text parts joined by newlines)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _check(self) -> "ResponseFormat":
        if self.type == "json_schema":
            if not self.json_schema or not isinstance(self.json_schema.get("schema", {}), dict):
                raise ValueError("response_format json_schema needs a json_schema object with a schema")
        elif self.json_schema is not None:
            raise ValueError("json_schema is only allowed when type is json_schema")
        return self


class ChatCompletionRequest(OpenAISamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]] = None
    max_tokens: Optional[Annotated[int, Field(ge=0, le=INT64_MAX)]] = None
    max_completion_tokens: Optional[Annotated[int, Field(ge=0, le=INT64_MAX)]] = None
    response_format: Optional[ResponseFormat] = None
    tools: Optional[Tools] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: bool = True
    separate_reasoning: bool = True
    # SGLang's: reasoning text streams as it is generated (true, the only mode here; false would hold it back).
    stream_reasoning: bool = True
    # Chat template controls (SGLang's and vLLM's): continue_final_message renders the last (assistant)
    # message open, for the model to continue it (assistant prefill).
    continue_final_message: bool = False
    add_generation_prompt: Optional[bool] = None  # None: true, or false with continue_final_message
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # vLLM's: the reply's content starts with the last message's when that message is the assistant's (the one
    # the model continues, with continue_final_message or add_generation_prompt false).
    echo: bool = False

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.stream and not self.stream_reasoning:
            raise ValueError("stream_reasoning false is not supported: reasoning text streams as it is generated")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise ValueError("continue_final_message continues the last message; it cannot be combined "
                                 "with add_generation_prompt=true")
            if self.messages[-1].role != "assistant":
                raise ValueError("continue_final_message needs the last message to be the assistant's")
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _unreserved_template_kwargs(cls, kwargs: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        reserved = sorted(set(kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        return kwargs

    @field_validator("tools")
    @classmethod
    def _distinct_tools(cls, tools: Optional[list[Tool]]) -> Optional[list[Tool]]:
        if tools and len({tool.function.name for tool in tools}) != len(tools):
            raise ValueError("tools must have distinct function names")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice: Optional[ToolChoice], info: ValidationInfo) -> Optional[ToolChoice]:
        tools = info.data.get("tools") or []
        if choice is not None and choice != "none" and not tools:
            raise ValueError("tool_choice other than none needs tools")
        if choice is not None and not isinstance(choice, str):
            names = [tool.function.name for tool in tools]
            if choice.function.name not in names:
                raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools "
                                 f"({', '.join(names)})")
        return choice

    @property
    def tool_choice_mode(self) -> str:
        """none, auto, required, or named (tool_choice is a function); OpenAI's default is auto with tools."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice if isinstance(self.tool_choice, str) else "named"

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the chat template rendering."""
        add_generation_prompt = (not self.continue_final_message if self.add_generation_prompt is None
                                 else self.add_generation_prompt)
        return {**(self.chat_template_kwargs or {}), "add_generation_prompt": add_generation_prompt,
                "continue_final_message": self.continue_final_message}

    @property
    def max_new_tokens(self) -> Optional[int]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "chat_template", "tokenize", "return_dict", "return_tensors",
                                      "add_generation_prompt", "continue_final_message", "padding", "truncation",
                                      "max_length", "tools", "documents"})

PromptType = Union[
    str,
    Annotated[list[str], Field(min_length=1)],
    Annotated[list[TokenId], Field(min_length=1)],
    Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)],
]


class CompletionRequest(OpenAISamplingFields):
    prompt: PromptType
    best_of: Optional[Annotated[int, Field(ge=1, le=MAX_N)]] = None
    echo: bool = False
    logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]] = None
    max_tokens: Optional[Annotated[int, Field(ge=0, le=INT64_MAX)]] = 16
    suffix: Optional[Literal[""]] = None
    response_format: Optional[ResponseFormat] = None

    @model_validator(mode="after")
    def _check_completion(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of different from n is not supported")
        return self

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompt as a list of single prompts (text or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]
