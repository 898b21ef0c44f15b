"""The TokenizerManager: the main process's side of the pipeline, on one asyncio event loop.

    generate_request(obj)  -> normalize (runtime/wire/request.py) unless the caller did, tokenize (on the
                              TokenizerWorker's thread) + check the whole batch (request_checks.py; ValueError:
                              nothing was sent), send one TokenizedGenerateReq per prompt and sample, then yield
                              chunks (stream=True) or the final result(s)
    _recv_loop             -> BatchTextOut from the detokenizer, routed to each request's ReqState (outputs.py)
    abort / flush_cache / get_server_info / post_training (weights, pause, memory) / mark_dead

Every method runs on the loop that called `start()`; other threads reach it through the Engine's bridge.
Abandoning a request's async generator (cancellation, aclose, break) aborts its unfinished requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional, Union

import msgspec
import zmq
import zmq.asyncio

from radixserve.runtime.wire.messages import (
    AbortReq,
    BatchTextOut,
    CacheTreeReq,
    CacheTreeReqOutput,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetServerInfoReq,
    GetServerInfoReqOutput,
    ModelInfo,
    ProcessFailed,
    ProcessReady,
    TokenizedGenerateReq,
    decode,
    encode,
    options_of,
)
from radixserve.runtime.wire.errors import EngineDeadError
from radixserve.runtime.wire.lora import LoadLoRAAdapterReq, LoRAAdapterReqOutput, UnloadLoRAAdapterReq
from radixserve.runtime.wire.request import GenerateRequest, NormalizedRequest, normalize
from radixserve.runtime.wire.sampling_params import LengthLimits, SamplingParams
from radixserve.runtime.wire.server_info import ServerInfo
from radixserve.runtime.wire.weights import CONTROL_REQUESTS, ControlReqOutput, GetWeightsByNameReqOutput
from radixserve.tokenizer_manager.outputs import handle_text_out, raise_if_failed
from radixserve.tokenizer_manager.replicas import merge_replies
from radixserve.tokenizer_manager.request_checks import tokenize_and_check
from radixserve.tokenizer_manager.state import ReqGroup, ReqState
from radixserve.tokenizer_manager.tokenize import TokenizerWorker

logger = logging.getLogger(__name__)

# Called once per finished request with its meta_info plus "tenant" (the caller's tenant id, or None), and the
# arrival times of its output chunks.
RequestObserver = Callable[[dict[str, Any], list[float]], None]


class TokenizerManager:
    """Owns the sockets to the scheduler (PUSH) and from the detokenizer (PULL) and all request state.

    model_info: the scheduler's ModelInfo (context_len, vocab_size, max_total_num_tokens, ...).
    tokenizer: used on this manager's loop thread only (token texts of logprobs); `worker` tokenizes, with a
    tokenizer instance of its own.
    """

    def __init__(self, tokenizer: Any, model_info: ModelInfo, send_socket: zmq.Socket, recv_socket: zmq.Socket,
                 worker: TokenizerWorker, incremental_streaming_output: bool = False):
        self.tokenizer = tokenizer
        self.incremental_streaming_output = incremental_streaming_output
        self.worker = worker
        self.model_info = model_info
        self.vocab_size = model_info.vocab_size
        self.limits = LengthLimits(model_info.context_len, model_info.max_total_num_tokens, model_info.page_size)
        self.send_socket = send_socket
        self._recv_socket_sync = recv_socket
        self.recv_socket = zmq.asyncio.Socket.from_socket(recv_socket)
        self.rid_to_state: dict[str, tuple[ReqState, ReqGroup]] = {}
        self.groups: set[ReqGroup] = set()
        self.rpc_futures: dict[str, asyncio.Future] = {}
        # Data parallelism: every replica answers a control request; the replies wait here until all are in.
        self.num_replicas = model_info.dp_size
        self._rpc_replies: dict[str, list[Any]] = {}
        self.dead: Optional[EngineDeadError] = None
        self.request_observer: Optional[RequestObserver] = None
        # Called with the reason when the engine fails (not on a deliberate shutdown), after the callers failed.
        self.on_fatal: Optional[Callable[[str], None]] = None
        self._recv_task: Optional[asyncio.Task] = None
        self.lora_adapters: dict[str, str] = dict(model_info.lora_adapters)  # name -> path, as last reported

    def start(self) -> None:
        """Start the receive loop on the running event loop."""
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop(), name="radixserve-recv")

    # ---- requests --------------------------------------------------------------------------------

    async def generate_request(self, obj: Union[GenerateRequest, NormalizedRequest]) -> AsyncIterator[Any]:
        """Yield streaming chunks, or once the final result (a dict, or a list for a batch or n > 1).

        Raises ValueError (nothing sent) for bad arguments, EngineDeadError if the engine is or goes down.
        """
        group = await self.submit(obj)
        async for item in self.iterate(group):
            yield item

    async def submit(self, obj: Union[GenerateRequest, NormalizedRequest]) -> ReqGroup:
        """Normalize (unless the caller did), tokenize, check and send every request of `obj`; the caller must then
        `iterate` (or `release`) the group.

        Raises ValueError before anything is sent, EngineDeadError when the engine is down.
        """
        self._check_alive()
        arrived = time.monotonic()  # the request's latencies (ttft, e2e) count its wait for the tokenizer too
        request = obj if isinstance(obj, NormalizedRequest) else normalize(obj, self.model_info)
        tokenized = await tokenize_and_check(self, request)
        self._check_alive()
        return self._submit(request, tokenized, arrived)

    async def iterate(self, group: ReqGroup) -> AsyncIterator[Any]:
        """The chunks (stream) or final result(s) of a submitted group; releases it when done or abandoned."""
        request = group.request
        token_text = self._token_text_fn(request)
        incremental = (self.incremental_streaming_output if request.incremental_stream is None
                       else request.incremental_stream)
        try:
            if request.stream:
                while True:
                    for state in await group.wait():
                        raise_if_failed(state)
                        yield state.take_chunk(token_text, incremental)
                    if group.all_finished and not group.dirty:
                        return
            else:
                while not group.all_finished:
                    for state in await group.wait():
                        raise_if_failed(state)
                results = [state.result(token_text) for state in group.states]
                yield results[0] if request.single and len(results) == 1 else results
        finally:
            self.release(group)

    def _submit(self, request: NormalizedRequest, tokenized: list[tuple[tuple[int, ...], SamplingParams]],
                arrived: float) -> ReqGroup:
        """Register a state per sample, then send: either all of the batch is queued or none of it."""
        expanded = [(prompt, sample, input_ids, prompt.sample_params(sampling, sample))
                    for prompt, (input_ids, sampling) in zip(request.prompts, tokenized) for sample in prompt.samples]
        tenant = request.tenant
        in_use = [sample.rid for _, sample, _, _ in expanded if engine_rid(tenant, sample.rid) in self.rid_to_state]
        if in_use:
            raise ValueError(f"request id(s) already in use: {', '.join(in_use[:5])}")

        states = [
            ReqState(rid=engine_rid(tenant, sample.rid), display_rid=sample.rid, user_rid=prompt.rid, tenant=tenant,
                     index=i, prompt_ids=input_ids, return_logprob=prompt.options.return_logprob,
                     logprob_start_len=prompt.options.logprob_start_len, created=arrived)
            for i, (prompt, sample, input_ids, _) in enumerate(expanded)
        ]
        group = ReqGroup(states, request)
        self.groups.add(group)
        for state, (prompt, _, input_ids, sampling) in zip(states, expanded):
            self.rid_to_state[state.rid] = (state, group)
            self._send(TokenizedGenerateReq(rid=state.rid, input_ids=input_ids, sampling_params=sampling,
                                            routed_dp_rank=request.routed_dp_rank, **options_of(prompt.options)))
        return group

    def release(self, group: ReqGroup) -> None:
        """Forget the group's states; abort those still running (the caller went away or failed). Idempotent."""
        if group not in self.groups:
            return
        self.groups.discard(group)
        for state in group.states:
            self.rid_to_state.pop(state.rid, None)
            if not state.finished and self.dead is None:
                self._send(AbortReq(rid=state.rid))

    def _token_text_fn(self, request: NormalizedRequest) -> Callable[[int], Optional[str]]:
        if not request.return_text_in_logprobs:
            return lambda token_id: None
        return lambda token_id: self.tokenizer.decode([token_id])

    def abort(self, rid: str, tenant: Optional[str] = None) -> None:
        """Abort `tenant`'s request by its id, or every sample of an n > 1 request by the caller's id.

        Its caller gets the output so far with finish_reason {"type": "abort"}. Unknown ids are ignored.
        """
        for state, _ in list(self.rid_to_state.values()):
            if (state.tenant == tenant and rid in (state.display_rid, state.user_rid)) and not state.finished:
                self._send(AbortReq(rid=state.rid))

    def num_pending_requests(self) -> int:
        return len(self.rid_to_state)

    # ---- tokenization ----------------------------------------------------------------------------

    async def encode(self, text: str) -> list[int]:
        """Token ids of `text`, tokenized on the worker's thread (ContextLengthExceededError when the text
        cannot fit the context at all)."""
        return await self.worker.encode(text, self.limits.max_sequence_tokens()[0])

    async def encode_chat(self, conversation: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        """Token ids of a conversation through the chat template, on the worker's thread (ValueError when the
        template refuses it)."""
        return await self.worker.apply_chat_template(conversation, self.limits.max_sequence_tokens()[0],
                                                     **template_kwargs)

    # ---- RPCs ------------------------------------------------------------------------------------

    async def flush_cache(self) -> bool:
        reply = await self._rpc(FlushCacheReq)
        if not reply.success:
            logger.warning("flush_cache refused: %s", reply.message)
        return reply.success

    async def get_server_info(self) -> ServerInfo:
        reply = await self._rpc(GetServerInfoReq)
        return msgspec.structs.replace(reply.info,
                                       num_pending_requests_in_tokenizer_manager=self.num_pending_requests())

    async def get_cache_tree(self, **fields: Any) -> Any:
        """The scheduler's CacheTreeSummary; `fields` are CacheTreeReq's (namespace_prefix, max_nodes, ...)."""
        return (await self._rpc(CacheTreeReq, **fields)).summary

    # With data-parallel replicas a load or unload goes to each of them; when some fail (the reply is a failure)
    # the others are rolled back, so every replica serves the same adapters: a failed load is unloaded where it
    # succeeded, a failed unload (an adapter still in use on one replica) is loaded again where it was unloaded.
    # The rollback's own refusals (not loaded / already loaded, on the replicas that failed) are expected.

    async def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> LoRAAdapterReqOutput:
        was_loaded = lora_name in self.lora_adapters
        reply = await self._rpc(LoadLoRAAdapterReq, lora_name=lora_name, lora_path=lora_path, pinned=pinned)
        if not reply.success and self.model_info.dp_size > 1 and not was_loaded:
            await self._rpc(UnloadLoRAAdapterReq, lora_name=lora_name)
        self.lora_adapters = dict(reply.loaded_adapters)
        return reply

    async def unload_lora_adapter(self, lora_name: str) -> LoRAAdapterReqOutput:
        path = self.lora_adapters.get(lora_name)
        reply = await self._rpc(UnloadLoRAAdapterReq, lora_name=lora_name)
        if not reply.success and self.model_info.dp_size > 1 and path is not None:
            await self._rpc(LoadLoRAAdapterReq, lora_name=lora_name, lora_path=path)
        self.lora_adapters = dict(reply.loaded_adapters)
        return reply

    async def post_training(self, request_type: type, **fields: Any) -> Any:
        """Send a request of runtime/wire/weights.py (`request_type`, with `fields`) to every scheduler; the reply
        (the first failure when some replica failed)."""
        if request_type not in CONTROL_REQUESTS:
            raise TypeError(f"not a post-training request: {request_type.__name__}")
        return await self._rpc(request_type, **fields)

    async def _rpc(self, request_type: type, **fields: Any) -> Any:
        self._check_alive()
        rpc_id = uuid.uuid4().hex
        future = asyncio.get_running_loop().create_future()
        self.rpc_futures[rpc_id] = future
        try:
            self._send(request_type(rpc_id=rpc_id, **fields))
            return await future
        finally:
            self.rpc_futures.pop(rpc_id, None)
            self._rpc_replies.pop(rpc_id, None)

    # ---- receiving -------------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        try:
            while True:
                message = decode(await self.recv_socket.recv())
                if isinstance(message, BatchTextOut):
                    handle_text_out(self, message)
                elif isinstance(message, (FlushCacheReqOutput, GetServerInfoReqOutput, CacheTreeReqOutput,
                                          LoRAAdapterReqOutput, ControlReqOutput, GetWeightsByNameReqOutput)):
                    self._rpc_reply(message)
                elif isinstance(message, ProcessFailed):
                    logger.error("the %s process failed:\n%s", message.process, message.error)
                    self.mark_dead(f"the {message.process} process failed (its traceback is in the server log)")
                elif not isinstance(message, ProcessReady):
                    logger.warning("unexpected message %s", type(message).__name__)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here would otherwise leave every caller waiting forever
            logger.exception("the TokenizerManager's receive loop failed")
            self.mark_dead(f"the TokenizerManager's receive loop failed: {exc!r}")

    def _rpc_reply(self, message: Any) -> None:
        future = self.rpc_futures.get(message.rpc_id)
        if future is None or future.done():
            return
        replies = self._rpc_replies.setdefault(message.rpc_id, [])
        replies.append(message)
        if len(replies) == self.num_replicas:
            future.set_result(merge_replies(replies))

    # ---- failure ---------------------------------------------------------------------------------

    def mark_dead(self, reason: str, expected: bool = False) -> None:
        """Fail every pending request and RPC with EngineDeadError; later calls fail at once.

        `expected`: a deliberate shutdown (logged quietly) rather than a failure.
        """
        if self.dead is not None:
            return
        logger.log(logging.INFO if expected else logging.ERROR, "engine stopped: %s", reason)
        self.dead = EngineDeadError(reason)
        for group in list(self.groups):
            group.fail(self.dead)
        for future in self.rpc_futures.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        if not expected and self.on_fatal is not None:
            self.on_fatal(reason)

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(*self.dead.args)

    def _send(self, message: Any) -> None:
        self.send_socket.send(encode(message))

    def shutdown(self) -> None:
        """Abort every pending request, fail its caller with EngineDeadError, close the sockets."""
        for state, _ in list(self.rid_to_state.values()):
            if not state.finished and self.dead is None:
                self._send(AbortReq(rid=state.rid))
        self.mark_dead("the engine was shut down", expected=True)
        self.close()

    def close(self) -> None:
        """Stop receiving and close the sockets (on the loop thread)."""
        if self._recv_task is not None:
            self._recv_task.cancel()
        self.worker.close()
        self.recv_socket.close(linger=0)
        self._recv_socket_sync.close(linger=0)
        self.send_socket.close(linger=0)


def engine_rid(tenant: Optional[str], rid: str) -> str:
    """The id a request has inside the engine: the caller's rid within its tenant, so equal rids of two
    tenants never collide (and a collision never tells one tenant of the other's requests). Tenant ids hold
    no "/", so the pair is recoverable; requests without a tenant keep their rid."""
    return rid if tenant is None else f"{tenant}/{rid}"
