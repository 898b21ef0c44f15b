"""vLLM's utility routes: `/version`, `/ping`, `/tokenize` and `/detokenize`, in vLLM's shapes.

- `GET /version`: `{"version": ...}`, radixserve's.
- `GET|POST /ping`: 200 while the server is up, as `/health` (SageMaker's probe; open like `/health`).
- `POST /tokenize`: `{"prompt": ...}` (with `add_special_tokens`, default true: the ids /v1/completions feeds the
  model) or `{"messages": [...]}` (through the chat template, as /v1/chat/completions renders them; with
  `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`, `tools`; `add_special_tokens`, default
  false, tokenizes the rendered text as a prompt) -> `{"count", "max_model_len", "tokens", "token_strs"}`
  (`token_strs` with `return_token_strs`).
- `POST /detokenize`: `{"tokens": [...]}` -> `{"prompt": text}`.

`model` is checked as on the OpenAI routes (openai/serving_common.py::check_model).
"""

from __future__ import annotations

from typing import Annotated, Any, Optional, Union

import orjson
from pydantic import Field, RootModel, model_validator
from starlette.requests import Request
from starlette.responses import Response

import radixserve
from radixserve.runtime.http.access import Access, access_router
from radixserve.runtime.http.errors import bad_request
from radixserve.runtime.http.generation import engine_error, json_response
from radixserve.runtime.http.openai.protocol import (RESERVED_TEMPLATE_KWARGS, ChatMessage, StrictModel, TokenId,
                                                     parse_request)
from radixserve.runtime.http.openai.serving_chat import encode_chat
from radixserve.runtime.http.openai.serving_common import check_model
from radixserve.runtime.http.openai.tool_calling import conversation_of
from radixserve.runtime.http.state import ServerState
from radixserve.tokenizer_manager.tokenize import load_chat_template


class TokenizePromptRequest(StrictModel):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(StrictModel):
    model: Optional[str] = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM's default for chat: the template writes the special tokens itself
    return_token_strs: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None

    @model_validator(mode="after")
    def _check(self) -> "TokenizeChatRequest":
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message continues the last message; set add_generation_prompt false")
        reserved = sorted(set(self.chat_template_kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        return self


class TokenizeRequest(RootModel[Union[TokenizePromptRequest, TokenizeChatRequest]]):
    """/tokenize's body as the OpenAPI schema documents it: one of the two forms (the route picks by `messages`)."""


class DetokenizeRequest(StrictModel):
    model: Optional[str] = None
    tokens: list[TokenId]


router = access_router(Access.PUBLIC)  # /version, /ping: vLLM's probes, open like /health
protected = access_router(Access.TENANT)


def _state(request: Request) -> ServerState:
    return request.app.state.server


@router.get("/version")
async def version() -> Response:
    return json_response({"version": radixserve.__version__})


@router.get("/ping")
@router.post("/ping")
async def ping() -> Response:
    return Response(status_code=200)


@protected.post("/tokenize")
async def tokenize(request: Request) -> Response:
    state = _state(request)
    raw = await request.body()
    try:
        decoded = orjson.loads(raw)
    except orjson.JSONDecodeError:
        decoded = None  # parse_request says what is wrong with it
    chat = isinstance(decoded, dict) and "messages" in decoded
    body: Union[TokenizePromptRequest, TokenizeChatRequest]
    body = parse_request(TokenizeChatRequest if chat else TokenizePromptRequest, raw)
    check_model(state, body.model)
    if isinstance(body, TokenizeChatRequest):
        kwargs = {**(body.chat_template_kwargs or {}), "add_generation_prompt": body.add_generation_prompt,
                  "continue_final_message": body.continue_final_message}
        if body.tools is not None:
            kwargs["tools"] = body.tools
        if body.add_special_tokens:
            tokens = _chat_with_special_tokens(state, conversation_of(body.messages), kwargs)
        else:  # the ids /v1/chat/completions feeds the model
            tokens = await encode_chat(state, body.messages, **kwargs)
    elif body.add_special_tokens:
        try:
            tokens = await state.engine.async_encode(body.prompt)
        except ValueError as error:
            raise engine_error(state, error, param="prompt") from None
    else:
        tokens = list(state.tokenizer.encode(body.prompt, add_special_tokens=False))
    token_strs = state.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return json_response({"count": len(tokens), "max_model_len": state.context_len, "tokens": tokens,
                          "token_strs": token_strs})


def _chat_with_special_tokens(state: ServerState, conversation: list[dict[str, Any]],
                              template_kwargs: dict[str, Any]) -> list[int]:
    """vLLM's `add_special_tokens` with messages: the rendered conversation tokenized as a prompt is (a BOS token
    added where the tokenizer adds one)."""
    try:
        text = state.tokenizer.apply_chat_template(
            conversation, chat_template=load_chat_template(state.server_args.chat_template), tokenize=False,
            **template_kwargs)
    except Exception as error:  # the template itself refuses (e.g. roles must alternate)
        raise bad_request(f"the chat template rejected the messages: {error}", param="messages") from None
    return list(state.tokenizer.encode(text, add_special_tokens=True))


@protected.post("/detokenize")
async def detokenize(request: Request) -> Response:
    state = _state(request)
    body = parse_request(DetokenizeRequest, await request.body())
    check_model(state, body.model)
    unknown = [token for token in body.tokens if token >= state.vocab_size]
    if unknown:
        raise bad_request(f"tokens {unknown[:8]} are not in the vocabulary (size {state.vocab_size})", param="tokens")
    return json_response({"prompt": state.tokenizer.decode(body.tokens)})


router.include_router(protected)
