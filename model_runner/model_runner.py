"""The ModelRunner: loads the model, sizes and owns the KV memory, and executes forward batches.

It knows nothing of requests, the scheduler or the server: it is given a `ForwardBatch` whose KV slots are
already allocated and recorded in `req_to_token`, and returns logits. Its construction reads as the order of
start-up; the model's building and loading is model_runner/model_loading.py, the choice of the KV pool's size and
the request limit model_runner/memory_sizing.py.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING, Optional

import torch

from radixserve.kernels import cpu_build
from radixserve.model_runner.attention import AttentionBackend, create_attention_backend
from radixserve.model_runner.batch_invariant import check_gpu_deterministic
from radixserve.model_runner.cpu import dispatch
from radixserve.model_runner.forward_batch import ForwardBatch
from radixserve.model_runner.memory_occupation import MemoryOccupation
from radixserve.model_runner.memory_sizing import SPARE_REQUEST_ROWS, size_memory
from radixserve.model_runner.lora.setup import create_lora_manager
from radixserve.model_runner.model_config import ModelConfig
from radixserve.model_runner.model_loading import load_model
from radixserve.model_runner.models import get_model_class
from radixserve.model_runner.pooling import PoolingSpec, pool_hidden, pooled_rows
from radixserve.model_runner.parallel import HeadLayout, ReplicaPlacement, check_ep_divides, join_tp_group
from radixserve.model_runner.runner_config import RunnerConfig
from radixserve.model_runner.state_memory import make_state_pool
from radixserve.model_runner.swa_memory import plan_swa_memory
from radixserve.model_runner.weight_update import WeightUpdater
from radixserve.radix_cache.pool import KV_CACHE_DTYPES, KVAllocator, ReqToTokenPool, TokenToKVPool
from radixserve.radix_cache.swa_pool import SWAKVAllocator, SWAKVPool
from radixserve.runtime.wire.dist_secret import load_dist_secret

if TYPE_CHECKING:
    from radixserve.model_runner.cuda_graph import CudaGraphRunner

logger = logging.getLogger(__name__)


def require_batch_invariant_kernels(device: str) -> None:
    """Deterministic inference runs batch-invariant kernels from the first batch on: on the CPU radixserve's C++
    kernels (model_runner/cpu/dispatch.py; waits for them to load), on a GPU Triton's (model_runner/batch_invariant.py).
    RuntimeError where they cannot load, ValueError on another device."""
    if str(device).startswith("cuda"):
        if importlib.util.find_spec("triton") is None:
            raise RuntimeError("--enable-deterministic-inference on a GPU runs Triton kernels; triton is not installed")
        return
    if not str(device).startswith("cpu"):
        raise ValueError(f"--enable-deterministic-inference runs on the CPU or a CUDA GPU; this engine runs on {device}")
    cpu_build.start_background_build()
    if not cpu_build.wait():
        raise RuntimeError("--enable-deterministic-inference needs radixserve's CPU kernels, which did not load here "
                           "(the log of radixserve.kernels.cpu_build says why)")


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    """Model weights, KV pools and the attention backend of one device.

    Attributes the scheduler uses: `model_config`, `device`, `dtype`, `context_len`, `vocab_size`,
    `max_total_num_tokens` (usable KV slots), `max_running_requests`, `req_to_token_pool`, `allocator`,
    `token_to_kv_pool`, `attn_backend`, `page_size`, `cuda_graph_runner` (None unless decode runs in
    CUDA graphs), `weights` (updates while serving) and `memory` (release and resume).
    """

    def __init__(self, config: RunnerConfig, tp_rank: int = 0, dp_rank: int = 0) -> None:
        """With `config.tp_size > 1`, joins the tensor-parallel group at `config.dist_init_addr` as rank `tp_rank`
        (every rank constructs its runner at the same time) and holds that rank's shard. `dp_rank`: the
        data-parallel replica, which takes this host's devices (or cores) after the replicas before it."""
        self.config = config
        self.cpu_kernels = dispatch.choose(config.cpu_kernels, batch_invariant=config.deterministic)
        cpu_build.set_enabled(self.cpu_kernels.enabled)  # before any weight is packed for the kernels
        if config.deterministic:
            require_batch_invariant_kernels(config.device)
        self.tp_rank = tp_rank
        self.dp_rank = dp_rank
        self.model_dir = config.model.model_dir
        self.model_config = ModelConfig.from_path(self.model_dir)
        if config.deterministic and str(config.device).startswith("cuda"):
            check_gpu_deterministic(self.model_config)
        # Before joining, so that a layout that cannot work fails on every rank without waiting for the others.
        check_ep_divides(self.model_config.moe.num_experts if self.model_config.moe else None, config.tp_size,
                         config.ep_size)
        tp_context = join_tp_group(config.tp_size, tp_rank, config.dist_init_addr or "", config.device,
                                   config.dist_timeout, config.tp_size // config.nnodes,
                                   ReplicaPlacement(dp_rank, config.dp_size), config.ep_size,
                                   load_dist_secret(config.dist_auth_secret_file) if config.tp_size > 1 else None)
        self.device, self.tp, self.tp_cpu_group = tp_context.device, tp_context.tp, tp_context.cpu_group
        if self.device.type == "cpu":
            dispatch.log_once(self.cpu_kernels)
        self.dtype = _DTYPES[config.dtype]
        self.kv_cache_dtype = self._resolve_kv_cache_dtype()
        self.page_size = config.page_size

        self.vocab_size = self.model_config.vocab_size
        self.context_len = self._resolve_context_len()
        self.head_layout = HeadLayout.of(self.model_config.num_attention_heads,
                                         self.model_config.num_key_value_heads, self.tp)
        model_class = get_model_class(self.model_config.architecture)
        if self.model_config.is_hybrid and config.speculative:
            raise ValueError(f"speculative decoding would have to roll back {self.model_config.architecture}'s "
                             "recurrent states, which is not implemented; drop --speculative-algorithm")
        self.is_causal = getattr(model_class, "is_causal", True)
        self.pooling = PoolingSpec.of(self.model_dir, self.model_config.hf_config, self.is_causal,
                                      self.model_config.architecture.endswith("ForSequenceClassification"),
                                      config.is_embedding, config.pooling_method)
        self.model = load_model(self, config.model)  # model_runner/model_loading.py

        # Also sets `state_slots` and, on a GPU, `memory_plan` (model_runner/memory_sizing.py).
        self.max_total_num_tokens, self.max_running_requests = size_memory(self)
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running_requests + SPARE_REQUEST_ROWS, self.context_len, self.device
        )
        shape = self.model_config
        layer_shapes = list(shape.layer_kv_shapes or [(self.head_layout.num_kv_heads, shape.head_dim)]
                            * shape.num_kv_layers)
        # Sliding-window models: the window layers' KV in a slot space of its own (model_runner/swa_memory.py).
        self.swa_memory = plan_swa_memory(shape, config, self.max_total_num_tokens, layer_shapes, self.kv_cache_dtype)
        if self.swa_memory is not None:
            self.max_total_num_tokens = self.swa_memory.full_tokens
            self.allocator = SWAKVAllocator(self.swa_memory.full_tokens, self.swa_memory.window_tokens, self.device)
            self.token_to_kv_pool = SWAKVPool(
                self.swa_memory.full_tokens, self.swa_memory.window_tokens, self.swa_memory.layer_windows,
                self.head_layout.num_kv_heads, shape.head_dim, self.kv_cache_dtype, self.allocator.full_to_window,
                self.device, shape.layer_kv_shapes or None,
            )
        else:
            self.allocator = KVAllocator(self.max_total_num_tokens, self.page_size, self.device)
            self.token_to_kv_pool = TokenToKVPool(
                self.max_total_num_tokens, self.page_size, shape.num_kv_layers, self.head_layout.num_kv_heads,
                shape.head_dim, self.kv_cache_dtype, self.device, shape.layer_kv_shapes or None,
            )
        # Hybrid models: the linear layers' states, one working slot per request row plus the tree's snapshots.
        self.state_pool = (make_state_pool(shape, self.req_to_token_pool.size, self.state_slots, self.config,
                                           self.dtype, self.device) if shape.is_hybrid else None)
        if self.state_pool is not None:
            self.model.set_state_pool(self.state_pool)
        self.attn_backend = self._create_attention_backend()
        self.attn_backend.warm_up(self.kv_cache_dtype)
        self.model.set_attention_backend(self.attn_backend)
        self.lora_manager = create_lora_manager(self) if config.enable_lora else None
        self.cuda_graph_runner = self._create_cuda_graph_runner()
        self.weights = WeightUpdater(self)  # weight updates while serving (model_runner/weight_update.py)
        self.memory = MemoryOccupation(self)  # memory release and resume (model_runner/memory_occupation.py)
        logger.info(
            "model %s loaded on %s (%s); KV pool %d tokens, %d running requests, context %d",
            shape.architecture, self.device, self.dtype, self.max_total_num_tokens,
            self.max_running_requests, self.context_len,
        )

    # ---- execution -------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, use_cuda_graph: bool = True) -> torch.Tensor:
        """Float32 logits `[num logits positions, vocab]` of the batch (see `ForwardBatch.logits_indices`);
        writes the batch's new K/V into the pool as a side effect.

        A DECODE batch replays a captured CUDA graph when one fits (unless `use_cuda_graph` is False); its
        logits then live in the graph's output buffer, which the next decode step overwrites: consume them
        (sample) before the next forward.
        """
        if (use_cuda_graph and self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(batch)
                and not self.attn_backend.prefers_eager(batch)):
            return self.cuda_graph_runner.replay(batch)
        return self.model.compute_logits(self._hidden_states(batch), batch)

    @torch.inference_mode()
    def forward_pooled(self, batch: ForwardBatch, entries: torch.Tensor) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """An EXTEND or MIXED batch some of whose entries pool (`entries`: their batch indices, int64 on the device):
        the logits `forward` gives (None for a model that does not generate), and each pooling entry's share of its
        vector `[len(entries), D]` float32 (model_runner/pooling.py), through the classification head of a
        classifier (D = its labels; else the hidden size)."""
        method = self.pooling.method or "last"
        # A model that only pools reads no other row: its last layer computes the pooled rows alone (a LoRA batch's
        # adapters are laid out per token, so it computes them all).
        rows = None
        if (not self.pooling.is_generation and getattr(self.model, "selects_rows", False)
                and self.lora_manager is None):
            rows = pooled_rows(batch, entries, method)
        hidden = self._hidden_states(batch, rows)
        pooled = pool_hidden(hidden, batch, entries, method, selected=rows is not None)
        if "classify" in self.pooling.kinds:
            pooled = self.model.classify(pooled.to(hidden.dtype)).float()
        logits = self.model.compute_logits(hidden, batch) if self.pooling.is_generation else None
        return logits, pooled

    def _hidden_states(self, batch: ForwardBatch, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        batch.causal = self.is_causal
        if self.token_to_kv_pool.window_map is not None:
            batch.window_cache_loc = batch.window_write_slots()
        self.attn_backend.plan(batch)
        if self.lora_manager is not None:
            self.lora_manager.prepare(batch)
        if rows is None:
            return self.model(batch.input_ids, batch.positions, batch)
        return self.model(batch.input_ids, batch.positions, batch, rows)

    def sync_sampled(self, next_token_ids: torch.Tensor) -> torch.Tensor:
        """Rank 0's sampled ids on every rank (in place), so random sampling cannot make ranks diverge."""
        return self.tp.broadcast_from_first(next_token_ids)

    # ---- set-up ----------------------------------------------------------------------------------
    def _create_attention_backend(self) -> AttentionBackend:
        """The requested backend, with decode batches on `--decode-attention-backend` where that names another
        (model_runner/attention/hybrid.py; by default on CUDA, triton's decode beside flashinfer's extends)."""
        name, backend = self._create_main_attention_backend()
        decode = self.config.decode_attention_backend
        if not self.is_causal or decode == name:
            return backend
        if self.config.decode_attention_default and name != self.config.attention_backend:
            return backend  # the default could not run here: decode stays on the backend that stood in
        from radixserve.model_runner.attention.hybrid import DEFAULT_DECODE_MAX_BATCH, HybridAttentionBackend

        limit = DEFAULT_DECODE_MAX_BATCH if self.config.decode_attention_default else None
        logger.info("decode batches%s run on the %s attention backend, the others on %s",
                    f" of up to {limit} requests" if limit else "", decode, name)
        return HybridAttentionBackend(backend, create_attention_backend(decode, self), limit)

    def _create_main_attention_backend(self) -> tuple[str, AttentionBackend]:
        """The requested backend and its name; when none was requested and the device default (flashinfer on CUDA)
        cannot run here, fall back to triton, then torch_native, with a warning (not with a
        --prefill-attention-backend, which only the flashinfer backend honours)."""
        name = self.config.attention_backend
        prefill = self.config.prefill_attention_backend
        if not self.is_causal:
            # Only the reference backend attends both ways (an encoder's prompt is one extend, never a prefix).
            if name != "torch_native" and not self.config.attention_backend_fallback:
                raise ValueError(f"{self.model_config.architecture} attends both ways, which only the torch_native "
                                 f"attention backend runs; drop --attention-backend {name}")
            return "torch_native", create_attention_backend("torch_native", self)
        if prefill is not None and name != "flashinfer":
            raise ValueError(f"--prefill-attention-backend {prefill} picks the flashinfer backend's extend kernels, "
                             f"and this {self.device.type} runs the {name} attention backend")
        if not self.config.attention_backend_fallback:
            return name, create_attention_backend(name, self)
        candidates = [name] + [n for n in ("triton", "torch_native") if n != name]
        if name == "flashinfer" and self.model_config.sliding_windows and self._decode_in_graphs():
            # flashinfer's decode graphs attend to every key, so a model with windows would decode eagerly there
            # (gpt-oss-20b at batch 1 on an H100: 20.9 ms a step against 4.2 ms in triton's graphs)
            logger.info("sliding-window layers: decode runs in CUDA graphs on the triton attention backend "
                        "(--attention-backend flashinfer keeps flashinfer, decoding eagerly)")
            candidates = ["triton", "flashinfer", "torch_native"]
        for i, candidate in enumerate(candidates):
            try:
                return candidate, create_attention_backend(candidate, self)
            except ValueError as exc:
                if i == len(candidates) - 1:
                    raise
                logger.warning("attention backend %s unavailable (%s); trying %s", candidate, exc, candidates[i + 1])
        raise AssertionError("unreachable")

    def _decode_in_graphs(self) -> bool:
        """Whether decode runs in CUDA graphs, the attention backend aside: on CUDA unless disabled, without
        LoRA (whose batches vary per step in which adapters they use), for a model that generates, not a hybrid
        (its state reads and writes are not captured yet)."""
        return (self.device.type == "cuda" and not self.config.disable_cuda_graph and not self.config.enable_lora
                and self.pooling.is_generation and not self.model_config.is_hybrid)

    def _create_cuda_graph_runner(self) -> Optional["CudaGraphRunner"]:
        """Capture decode CUDA graphs on CUDA unless `disable_cuda_graph`; None on the CPU, when disabled, or
        when the attention backend cannot be captured (decode then runs eagerly)."""
        if not self._decode_in_graphs():
            return None
        if self.model_config.sliding_windows and not self.attn_backend.graphs_apply_windows:
            logger.info("decode runs eagerly: the %s attention backend's graphs do not apply sliding windows",
                        self.config.attention_backend)
            return None
        from radixserve.model_runner.cuda_graph import create_cuda_graph_runner

        return create_cuda_graph_runner(self)

    def _resolve_kv_cache_dtype(self) -> torch.dtype:
        """`--kv-cache-dtype`; auto: the model's dtype, except float16 under a GGUF's blocks on the CPU (llama.cpp's
        default too): the blocks' float32 activations then keep their greedy ids (docs/quantization.md), and decode
        steps read half the bytes of their keys and values."""
        name = self.config.kv_cache_dtype
        if name == "auto" and self.config.quantization == "gguf" and self.device.type == "cpu" \
                and self.dtype == torch.float32:
            return torch.float16
        return self.dtype if name == "auto" else KV_CACHE_DTYPES[name]

    def _resolve_context_len(self) -> int:
        config = self.model_config
        context_len = self.config.context_length or config.max_position_embeddings
        if self.config.context_length and context_len > config.max_position_embeddings:
            logger.warning("context_length %d exceeds the model's max_position_embeddings %d",
                           context_len, config.max_position_embeddings)
        return context_len
