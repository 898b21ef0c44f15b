"""The offline Engine: `from radixserve import Engine`.

    engine = Engine()                                   # the embedded SmolLM2-135M-Instruct, on CPU here
    engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
    offset = 0
    for chunk in engine.generate("Hi", {"max_new_tokens": 8}, stream=True):
        print(chunk["text"][offset:], end=""); offset = len(chunk["text"])
    engine.shutdown()                                   # or `with Engine() as engine: ...`

The Engine starts the scheduler and detokenizer processes and runs the TokenizerManager on its own event loop
in a daemon thread. Sync methods block on that loop from any thread (a Jupyter cell included, whose own loop
is simply blocked meanwhile); async methods await it from any running loop. Nothing needs nest_asyncio.

Results: a single request returns {"text", "output_ids", "meta_info": {"id", "prompt_tokens",
"completion_tokens", "cached_tokens", "finish_reason", "e2e_latency", "ttft", [logprobs]}}; a batch (or n > 1)
returns a list, prompt-major (prompt i's samples at i*n .. i*n+n-1). Streaming chunks have the same keys plus
"index" (the position in that list); as in SGLang, "text", "output_ids" and the output logprobs hold everything
so far (read new text as `chunk["text"][offset:]`), or only what is new with incremental_streaming_output=True.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import weakref
from typing import Any, AsyncIterator, Callable, Iterator, Optional, Union

import msgspec
import zmq

from radixserve.runtime.wire.cache_tree import CacheTreeSummary
from radixserve.runtime.wire.ipc import IpcPaths, make_pull, make_push
from radixserve.runtime import pooling
from radixserve.runtime.launch import ChildProcesses, primary_model_info, resolve_for_launch
from radixserve.runtime.loop_thread import LoopThread
from radixserve.runtime.post_training import PostTrainingCalls
from radixserve.runtime.serving_engine import RequestObserver
from radixserve.runtime.wire.messages import ModelInfo
from radixserve.runtime.wire.lora import LoRAAdapterReqOutput
from radixserve.runtime.wire.server_args import ServerArgs, make_server_args
from radixserve.runtime.wire.server_info import ServerInfo
from radixserve.runtime.wire.errors import EngineDeadError
from radixserve.runtime.wire.request import SERVER_FIELDS, GenerateRequest, NormalizedRequest
from radixserve.tokenizer_manager.manager import TokenizerManager
from radixserve.tokenizer_manager.tokenize import TokenizerWorker, load_chat_template

logger = logging.getLogger(__name__)

Prompt = Union[str, list[str], None]
Params = Union[dict, list[dict], None]


class _Resources:
    """Everything a running Engine owns, closed in reverse order of creation. Holds no reference to the
    Engine itself, so it can be the Engine's weakref finalizer (run on shutdown, garbage collection or exit)."""

    def __init__(self) -> None:
        self.ipc: Optional[IpcPaths] = None
        self.zmq_ctx: Optional[zmq.Context] = None
        self.sockets: list[zmq.Socket] = []
        self.children: Optional[ChildProcesses] = None
        self.loop_thread: Optional[LoopThread] = None
        self.tokenizer_manager: Optional[TokenizerManager] = None

    def close(self) -> None:
        tm, loop_thread = self.tokenizer_manager, self.loop_thread
        if tm is not None and loop_thread is not None and loop_thread.thread.is_alive():

            async def stop_requests() -> None:
                tm.shutdown()

            try:
                loop_thread.call(stop_requests(), timeout=5.0)
            except Exception:
                logger.exception("error while stopping pending requests")
        if self.children is not None:
            self.children.stop()
        if loop_thread is not None:
            loop_thread.loop.call_soon_threadsafe(loop_thread.loop.stop)
            if not loop_thread.on_loop():
                loop_thread.thread.join(timeout=5.0)
                if not loop_thread.thread.is_alive():
                    loop_thread.loop.close()
        for socket in self.sockets:
            socket.close(linger=0)
        if self.zmq_ctx is not None:
            self.zmq_ctx.term()
        if self.ipc is not None:
            self.ipc.remove()


class Engine(PostTrainingCalls):
    """An in-process LLM engine (see the module docstring). Keyword arguments are ServerArgs fields. The
    post-training calls (weight updates, memory release, pause) are runtime/post_training.py's.

    Raises ValueError for unknown or invalid server arguments, EngineStartupError (with the child's traceback)
    when a child process fails to start.
    """

    def __init__(self, model_path: Optional[str] = None, **server_args: Any):
        self.server_args: ServerArgs = make_server_args(model_path, **server_args)
        _configure_logging(self.server_args.log_level)
        self._resources = _Resources()
        # Called once, from a helper thread, with the reason when the engine fails for good (see _on_fatal).
        self.on_death: Optional[Callable[[str], None]] = None
        self._finalizer = weakref.finalize(self, self._resources.close)
        try:
            self._start()
        except BaseException:
            self._finalizer()
            raise

    def _start(self) -> None:
        from radixserve.runtime.wire.tokenizer_files import server_tokenizer

        res = self._resources
        child_args = resolve_for_launch(self.server_args)
        res.ipc = IpcPaths.create()
        res.zmq_ctx = zmq.Context()
        recv_socket = make_pull(res.zmq_ctx, res.ipc.detokenizer_to_tokenizer)  # bound before any child starts
        send_socket = make_push(res.zmq_ctx, res.ipc.tokenizer_to_scheduler)
        res.sockets = [recv_socket, send_socket]
        res.children = ChildProcesses(child_args, res.ipc)
        res.children.start()
        self.tokenizer = server_tokenizer(child_args.tokenizer_path, child_args)  # while the children load
        infos = res.children.wait_ready(recv_socket)
        self.model_info: ModelInfo = msgspec.structs.replace(primary_model_info(infos, child_args),
                                                            tokenizer_path=child_args.tokenizer_path)

        res.loop_thread = LoopThread()

        # One tokenizer per thread that uses one: this Engine's caller, the manager's loop, the tokenizing worker.
        worker = TokenizerWorker(copy.deepcopy(self.tokenizer), load_chat_template(self.server_args.chat_template))
        loop_tokenizer = copy.deepcopy(self.tokenizer)

        async def make_tokenizer_manager() -> TokenizerManager:
            tm = TokenizerManager(loop_tokenizer, self.model_info, send_socket, recv_socket, worker,
                                  incremental_streaming_output=self.server_args.incremental_streaming_output)
            tm.start()
            return tm

        res.tokenizer_manager = res.loop_thread.call(make_tokenizer_manager())
        self._tm = res.tokenizer_manager
        self._loop = res.loop_thread
        tm, loop = self._tm, self._loop.loop

        def on_death(name: str, exitcode: Optional[int]) -> None:
            reason = f"the {name} process died unexpectedly (exit code {exitcode})"
            loop.call_soon_threadsafe(tm.mark_dead, reason)

        tm.on_fatal = self._on_fatal
        res.children.start_supervisor(on_death)
        info = self.model_info
        logger.info("engine ready: model %s, %d KV slots, context %d, %s %s", info.model_path,
                    info.max_total_num_tokens, info.context_len, info.device, info.dtype)

    # ---- generation ------------------------------------------------------------------------------

    def generate(self, prompt: Prompt = None, sampling_params: Params = None, **fields: Any,
                 ) -> Union[dict, list[dict], Iterator[dict]]:
        """Generate for one prompt (a str, or token ids as `input_ids=`) or a batch (a list of them).

        `fields` are GenerateRequest's (runtime/wire/request.py), in SGLang's names: `input_ids`, `rid`,
        `return_logprob`, `logprob_start_len`, `top_logprobs_num`, `return_text_in_logprobs`, `stream`,
        `cache_salt`, `priority` (orders requests with --enable-priority-scheduling, docs/fair-share.md),
        `lora_path` (the LoRA adapter to run under, one for all prompts or one per prompt; None: the base model,
        docs/lora.md) and `data_parallel_rank` (the replica to run on with dp_size > 1; None: the controller
        decides). Returns the result (a dict, or a list for a batch or n > 1), or with stream=True an iterator
        of chunks. Raises ValueError for bad arguments before anything is queued, EngineDeadError when a child
        process died.
        """
        self._check_open()
        request = _request(prompt, sampling_params, fields)
        if request.stream:
            return self._loop.stream(lambda: self._tm.submit(request), self._tm.iterate)
        return self._loop.call(self._collect(request))

    async def async_generate(self, prompt: Prompt = None, sampling_params: Params = None, **fields: Any,
                             ) -> Union[dict, list[dict], AsyncIterator[dict]]:
        """`generate` for async callers: await it for the result, or (stream=True) for an async iterator."""
        self._check_open()
        request = _request(prompt, sampling_params, fields)
        if request.stream:
            return await self._loop.stream_async(lambda: self._tm.submit(request), self._tm.iterate)
        return await self._loop.call_async(self._collect(request))

    async def generate_request(self, obj: Union[GenerateRequest, NormalizedRequest]) -> AsyncIterator[Any]:
        """Chunks (obj.stream) or the one final result of `obj`, from any event loop (the HTTP server's).

        Bad arguments raise ValueError at the first `__anext__`, before anything is queued. Closing or
        cancelling the iteration aborts the unfinished requests.
        """
        self._check_open()
        stream = await self._loop.stream_async(lambda: self._tm.submit(obj), self._tm.iterate)
        try:
            async for item in stream:
                yield item
        finally:
            await stream.aclose()

    async def _collect(self, obj: GenerateRequest) -> Any:
        async with contextlib.aclosing(self._tm.generate_request(obj)) as results:
            async for result in results:
                return result
        raise RuntimeError("no result")  # pragma: no cover - generate_request always yields once

    # ---- pooling (runtime/pooling.py, docs/embeddings.md) -------------------------------------------

    def encode(self, prompt: Union[str, list[str], list[int], list[list[int]]], dimensions: Optional[int] = None,
               **fields: Any) -> Union[dict, list[dict]]:
        """Embeddings of one prompt (a str, or token ids) or a batch: `{"embedding", "meta_info"}` per prompt (a dict
        for one prompt, else a list), L2-normalized; `dimensions` truncates them (Matryoshka) and normalizes again.
        A sequence classifier returns its logits as the embedding. `fields`: GenerateRequest's `rid`, `cache_salt`,
        `priority`, `lora_path`. Raises ValueError when the model serves no embeddings or for bad input."""
        self._check_open()
        single = isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int))
        results = self._loop.call(self._pool(pooling.embed_request(self._tm.model_info,
                                                                   pooling.as_prompts(prompt, "prompt"), **fields)))
        for result in results:
            result["embedding"] = pooling.truncate_embedding(result["embedding"], dimensions)
        return results[0] if single else results

    def rerank(self, query: Union[str, list[int]], documents: list[Union[str, list[int]]], top_n: Optional[int] = None,
               return_documents: bool = False) -> list[dict]:
        """The documents by relevance to `query`, best first: `{"index", "relevance_score"}` (and `document` with
        `return_documents`), the first `top_n` of them. Needs an embedding model or a sequence classifier."""
        self._check_open()
        model = self._tm.model_info

        async def run() -> list[dict]:
            request = await pooling.rerank_request(model, query, documents, self._tm.encode)
            return await self._pool(request)

        vectors = [result["embedding"] for result in self._loop.call(run())]
        return pooling.rank_documents(pooling.relevance_scores(model, vectors), documents, top_n, return_documents)

    def score(self, query: Union[str, list[int]], items: list[Union[str, list[int]]], label_token_ids: list[int],
              apply_softmax: bool = False, item_first: bool = False) -> list[list[float]]:
        """SGLang's score: per item, the probabilities of `label_token_ids` as the next token after query + item
        (item + query with `item_first`), renormalized over the labels with `apply_softmax`. Needs a generative
        model."""
        self._check_open()

        async def run() -> list[dict]:
            request = await pooling.score_request(query, items, label_token_ids, item_first, self._tm.encode)
            return await self._pool(request)

        return [pooling.label_probabilities(result["embedding"], apply_softmax) for result in self._loop.call(run())]

    async def _pool(self, request: GenerateRequest) -> list[dict]:
        results = await self._collect(request)
        return results if isinstance(results, list) else [results]

    # ---- tokenization ----------------------------------------------------------------------------

    async def async_encode(self, text: str) -> list[int]:
        """Token ids of `text`, tokenized off the caller's loop (on the engine's tokenizer thread)."""
        self._check_open()
        return await self._loop.call_async(self._tm.encode(text))

    async def async_encode_chat(self, conversation: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        """Token ids of a conversation through the chat template (`--chat-template`, else the model's), off the
        caller's loop. Raises ValueError when the model has no template or the template refuses the messages."""
        self._check_open()
        return await self._loop.call_async(self._tm.encode_chat(conversation, **template_kwargs))

    # ---- control ---------------------------------------------------------------------------------

    def abort(self, rid: str, tenant: Optional[str] = None) -> None:
        """Abort a request (or all samples of an n > 1 request) by id; its caller gets finish_reason abort.
        `tenant`: the tenant the request was made for (the HTTP server's); rids are unique per tenant."""
        self._check_open()
        self._loop.loop.call_soon_threadsafe(self._tm.abort, rid, tenant)

    def flush_cache(self) -> bool:
        """Drop the radix cache (only when idle; returns False when the scheduler refused)."""
        self._check_open()
        return self._loop.call(self._tm.flush_cache())

    async def async_flush_cache(self) -> bool:
        self._check_open()
        return await self._loop.call_async(self._tm.flush_cache())

    # ---- LoRA adapters (SGLang's names; docs/lora.md) ----------------------------------------------
    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> LoRAAdapterReqOutput:
        """Load the PEFT adapter in folder `lora_path` as `lora_name`; the reply says whether it worked."""
        self._check_open()
        return self._loop.call(self._tm.load_lora_adapter(lora_name, lora_path, pinned))

    async def async_load_lora_adapter(self, lora_name: str, lora_path: str,
                                      pinned: bool = False) -> LoRAAdapterReqOutput:
        self._check_open()
        return await self._loop.call_async(self._tm.load_lora_adapter(lora_name, lora_path, pinned))

    def unload_lora_adapter(self, lora_name: str) -> LoRAAdapterReqOutput:
        """Unload an adapter (refused while a request of it is queued or running) and free its cached KV."""
        self._check_open()
        return self._loop.call(self._tm.unload_lora_adapter(lora_name))

    async def async_unload_lora_adapter(self, lora_name: str) -> LoRAAdapterReqOutput:
        self._check_open()
        return await self._loop.call_async(self._tm.unload_lora_adapter(lora_name))

    @property
    def lora_adapters(self) -> dict[str, str]:
        """The loaded LoRA adapters, name -> path."""
        return dict(self._tm.lora_adapters)

    # ---- post-training (runtime/post_training.py; docs/rl.md) -------------------------------------
    def _post_training(self, request_type: type, **fields: Any) -> Any:
        self._check_open()
        return self._loop.call(self._tm.post_training(request_type, **fields))

    async def async_post_training(self, request_type: type, **fields: Any) -> Any:
        """The schedulers' merged reply to a request of runtime/wire/weights.py, from a running event loop."""
        self._check_open()
        return await self._loop.call_async(self._tm.post_training(request_type, **fields))

    def get_server_info(self) -> dict[str, Any]:
        """The scheduler's statistics: memory, cache hit rate, queue sizes, throughput, plus model_info (the JSON
        of /get_server_info)."""
        self._check_open()
        return self._loop.call(self._tm.get_server_info()).to_dict()

    async def async_get_server_info(self) -> dict[str, Any]:
        return (await self.async_server_info()).to_dict()

    async def async_server_info(self) -> ServerInfo:
        """`get_server_info` as the typed report (runtime/wire/server_info.py), from a running event loop."""
        self._check_open()
        return await self._loop.call_async(self._tm.get_server_info())

    def _on_fatal(self, reason: str) -> None:
        """The engine failed for good (a child died, or the receive loop broke); runs on the loop thread
        after every pending request has failed. Stop the surviving children at once, so none goes on
        computing abandoned requests, then tell `on_death` (the HTTP server exits on it). Later calls keep
        raising EngineDeadError until `shutdown()`."""
        children, callback = self._resources.children, self.on_death

        def stop() -> None:
            if children is not None:
                children.stop()
            if callback is not None:
                callback(reason)

        threading.Thread(target=stop, name="radixserve-engine-failed", daemon=True).start()

    def get_cache_tree(self, namespace: Optional[str] = None, max_depth: int = 0, max_nodes: int = 200,
                       with_token_ids: bool = False, rid: Optional[str] = None) -> Any:
        """A summary of the radix tree per namespace (a CacheTreeSummary; see runtime/wire/cache_tree.py), the
        path of request `rid` marked. Raises ValueError for out-of-range limits."""
        self._check_open()
        return self._loop.call(self._tm.get_cache_tree(namespace=namespace, max_depth=max_depth,
                                                       max_nodes=max_nodes, with_token_ids=with_token_ids, rid=rid))

    async def async_get_cache_tree(self, **fields: Any) -> CacheTreeSummary:
        """`get_cache_tree` from a running event loop; `fields` are CacheTreeReq's (namespace_prefix too)."""
        self._check_open()
        return await self._loop.call_async(self._tm.get_cache_tree(**fields))

    def is_healthy(self) -> bool:
        """False once a child process died or the engine was shut down."""
        return self._finalizer.alive and self._tm.dead is None and self._resources.children.all_alive()

    @property
    def request_observer(self) -> Optional[RequestObserver]:
        """Called as observer(meta_info, token_times) once per finished request, on the engine's loop thread."""
        return self._tm.request_observer

    @request_observer.setter
    def request_observer(self, observer: Optional[RequestObserver]) -> None:
        self._tm.request_observer = observer

    def shutdown(self) -> None:
        """Abort pending requests (their callers get EngineDeadError), stop the children, remove the sockets.

        Idempotent; also runs when the Engine is garbage collected and at interpreter exit.
        """
        self._finalizer()

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise EngineDeadError("the engine was shut down")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()


def _request(prompt: Prompt, sampling_params: Params, fields: dict[str, Any]) -> GenerateRequest:
    """The GenerateRequest of `Engine.generate`'s arguments (the prompt is its `text`). The fields the server sets
    from an API key are not the caller's: they are unknown keywords here, as any other."""
    for name in fields:
        if name in SERVER_FIELDS or name == "text":
            raise TypeError(f"generate() got an unexpected keyword argument {name!r}")
    try:
        return GenerateRequest(text=prompt, sampling_params=sampling_params, **fields)
    except TypeError as error:  # msgspec's "Unexpected keyword argument 'x'"
        raise TypeError(f"generate() got an unexpected keyword argument: {error}") from None


def _configure_logging(level: str) -> None:
    """Give radixserve's loggers a handler and level unless the application configured its own."""
    package_logger = logging.getLogger("radixserve")
    package_logger.setLevel(level.upper())
    if not package_logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s [engine] %(levelname)s %(name)s: %(message)s"))
        package_logger.addHandler(handler)


__all__ = ["Engine", "EngineDeadError", "GenerateRequest"]
