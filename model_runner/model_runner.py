"""The ModelRunner: loads the model, sizes and owns the KV memory, and executes forward batches.

It knows nothing of requests, the scheduler or the server: it is given a `ForwardBatch` whose KV slots are
already allocated and recorded in `req_to_token`, and returns logits.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from typing import TYPE_CHECKING, Optional

import torch

from radixserve.kernels import cpu_build
from radixserve.model_runner.attention import AttentionBackend, create_attention_backend
from radixserve.model_runner.batch_invariant import check_gpu_deterministic, use_batch_invariant_linears
from radixserve.model_runner.cpu import dispatch
from radixserve.model_runner.fused_decode import use_fused_decode_layers
from radixserve.model_runner.cpu.gguf_linear import use_gguf_blocks
from radixserve.model_runner.cpu.packed import pack_cpu_linears
from radixserve.model_runner.loader.gguf_blocks import source_gguf
from radixserve.model_runner.cpu.small_batch import pack_small_batch_linears, small_batch_packing_pays
from radixserve.model_runner.forward_batch import ForwardBatch
from radixserve.model_runner.loader import dummy_weights, iter_weights
from radixserve.model_runner.memory_occupation import MemoryOccupation
from radixserve.model_runner.memory_plan import MemoryPlan, graph_bytes, margin_bytes, profile_step_memory
from radixserve.model_runner.lora.setup import create_lora_manager
from radixserve.model_runner.model_config import ModelConfig
from radixserve.model_runner.models import get_model_class
from radixserve.model_runner.pooling import PoolingSpec, pool_hidden, pooled_rows
from radixserve.model_runner.quantization import QuantizedWeightLoader, quantization_method, quantize_model
from radixserve.model_runner.parallel import (HeadLayout, ReplicaPlacement, check_ep_divides, join_tp_group,
                                              min_over_ranks)
from radixserve.model_runner.runner_config import RunnerConfig
from radixserve.model_runner.state_memory import make_state_pool, plan_state_pool
from radixserve.model_runner.swa_memory import plan_swa_memory
from radixserve.model_runner.weight_update import WeightUpdater
from radixserve.radix_cache.pool import KV_CACHE_DTYPES, KVAllocator, ReqToTokenPool, TokenToKVPool
from radixserve.radix_cache.swa_pool import SWAKVAllocator, SWAKVPool
from radixserve.runtime.wire.dist_secret import load_dist_secret

if TYPE_CHECKING:
    from radixserve.model_runner.cuda_graph import CudaGraphRunner
    from radixserve.runtime.wire.model_files import ModelFiles

logger = logging.getLogger(__name__)

GiB = 1 << 30
# CPU KV pool: this share of the currently available RAM, at most CPU_KV_MAX_BYTES and 64 full contexts.
CPU_KV_RAM_FRACTION = 0.25
CPU_KV_MAX_BYTES = 1 * GiB
CPU_KV_MAX_CONTEXTS = 64
# The share of the device for weights + KV when the start-up profile fails (held on an H100 80GB with Llama-3.1-8B).
FALLBACK_MEM_FRACTION = 0.80
CPU_DEFAULT_MAX_RUNNING_REQUESTS = 128
# Request rows beyond max_running_requests, so rows for the next batch can be taken while the current
# batch still holds its own (overlap scheduling).
SPARE_REQUEST_ROWS = 8


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


def default_max_running(kv_tokens: int) -> int:
    """The request limit on a GPU when none is given: a row per 512 KV tokens, between 32 and 1024."""
    return min(1024, max(32, kv_tokens // 512))


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
        self.model = self._load_model(config.model)

        self.max_total_num_tokens, self.max_running_requests = self._size_memory()
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
        """The requested backend; when none was requested and the device default (flashinfer on CUDA)
        cannot run here, fall back to triton, then torch_native, with a warning (not with a
        --prefill-attention-backend, which only the flashinfer backend honours)."""
        name = self.config.attention_backend
        prefill = self.config.prefill_attention_backend
        if not self.is_causal:
            # Only the reference backend attends both ways (an encoder's prompt is one extend, never a prefix).
            if name != "torch_native" and not self.config.attention_backend_fallback:
                raise ValueError(f"{self.model_config.architecture} attends both ways, which only the torch_native "
                                 f"attention backend runs; drop --attention-backend {name}")
            return create_attention_backend("torch_native", self)
        if prefill is not None and name != "flashinfer":
            raise ValueError(f"--prefill-attention-backend {prefill} picks the flashinfer backend's extend kernels, "
                             f"and this {self.device.type} runs the {name} attention backend")
        if not self.config.attention_backend_fallback:
            return create_attention_backend(name, self)
        candidates = [name] + [n for n in ("triton", "torch_native") if n != name]
        for i, candidate in enumerate(candidates):
            try:
                return create_attention_backend(candidate, self)
            except ValueError as exc:
                if i == len(candidates) - 1:
                    raise
                logger.warning("attention backend %s unavailable (%s); trying %s", candidate, exc, candidates[i + 1])
        raise AssertionError("unreachable")

    def _create_cuda_graph_runner(self) -> Optional["CudaGraphRunner"]:
        """Capture decode CUDA graphs on CUDA unless `disable_cuda_graph`; None on the CPU, when disabled, or
        when the attention backend cannot be captured (decode then runs eagerly)."""
        # LoRA batches vary per step in which adapters they use; decode runs eagerly then.
        # A model that only pools never decodes.
        # Hybrid models decode eagerly: their state reads and writes are not captured yet.
        if (self.device.type != "cuda" or self.config.disable_cuda_graph or self.lora_manager is not None
                or not self.pooling.is_generation or self.model_config.is_hybrid):
            return None
        if self.model_config.sliding_windows and not self.attn_backend.graphs_apply_windows:
            logger.info("decode runs eagerly: the %s attention backend's graphs do not apply sliding windows",
                        self.config.attention_backend)
            return None
        from radixserve.model_runner.cuda_graph import create_cuda_graph_runner

        return create_cuda_graph_runner(self)

    def _resolve_kv_cache_dtype(self) -> torch.dtype:
        name = self.config.kv_cache_dtype
        return self.dtype if name == "auto" else KV_CACHE_DTYPES[name]

    def _resolve_context_len(self) -> int:
        config = self.model_config
        context_len = self.config.context_length or config.max_position_embeddings
        if self.config.context_length and context_len > config.max_position_embeddings:
            logger.warning("context_length %d exceeds the model's max_position_embeddings %d",
                           context_len, config.max_position_embeddings)
        return context_len

    def _load_model(self, files: ModelFiles) -> torch.nn.Module:
        model_class = get_model_class(self.model_config.architecture)
        # Build on the meta device (no memory, no random init), then allocate on the target device once.
        with torch.device("meta"):
            model = model_class(self.model_config, max_positions=self.context_len, tp=self.tp)
        model = model.to(self.dtype)
        method = quantization_method(self.config.quantization, self.model_config.hf_config, self.dtype)
        if method is not None:  # FP8 / 4-bit linears (model_runner/quantization/), swapped in before allocation
            quantize_model(model, method)
            logger.info("quantized linears: %s", method.describe())
        model = model.to_empty(device=self.device)
        if files.load_format == "dummy":
            shapes = model.hf_weight_shapes() if hasattr(model, "hf_weight_shapes") else None
            weights = dummy_weights(self.model_config, self.config.random_seed, self.dtype, self.device, shapes)
        else:
            weights = iter_weights(files.model_dir, lazy=self.tp.size > 1)
        with torch.no_grad():
            if method is None:
                model.load_weights(weights)
            else:
                dense = files.load_format == "dummy" or "quantization_config" not in self.model_config.hf_config
                QuantizedWeightLoader(model, method, dense, self.device).load(weights)
                if self.device.type == "cuda":  # the 16-bit tensors quantized at load leave the allocator's cache
                    torch.cuda.empty_cache()
        model.eval().requires_grad_(False)
        if self.config.quantization == "gguf":
            gguf_path = source_gguf(files.model_dir)
            if gguf_path is None or files.load_format == "dummy":
                raise ValueError(f"quantization 'gguf' computes on a GGUF file's blocks; {files.source} is not a GGUF "
                                 "file loaded with its weights")
            # before packing: the float linears left (and those kept for prefill) are packed as usual
            use_gguf_blocks(model, gguf_path, self.config.gguf_activations, keep_float=self.config.gguf_keep_float)
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            # the weights are final now; see model_runner/cpu/packed.py. A model that only pools never runs its LM head.
            pack_cpu_linears(model, self.cpu_kernels, lm_head=self.pooling.is_generation)
        elif self.device.type == "cpu" and self.dtype == torch.float32:
            packed = small_batch_packing_pays(model, self.config.speculative)
            pack_small_batch_linears(model, self.cpu_kernels, packed=packed,  # see model_runner/cpu/small_batch.py
                                     lm_head=self.pooling.is_generation)
        elif self.device.type == "cuda" and self.config.deterministic:
            use_batch_invariant_linears(model)  # see model_runner/batch_invariant.py
        if self.config.quantization == "gguf" and use_fused_decode_layers(model):
            logger.info("decode batches of a few tokens run every layer in one call (model_runner/fused_decode.py)")
        return model

    def _size_memory(self) -> tuple[int, int]:
        """(usable KV token slots rounded down to whole pages, max running requests); logs the memory plan."""
        args, config = self.config, self.model_config
        bytes_per_token = TokenToKVPool.bytes_per_token(
            config.num_kv_layers, self.head_layout.num_kv_heads, config.head_dim, self.kv_cache_dtype
        )
        if config.layer_kv_shapes:  # per-layer shapes are served on one rank (models/gemma4.py)
            bytes_per_token = TokenToKVPool.bytes_per_token_of(config.layer_kv_shapes, self.kv_cache_dtype)
        row_bytes = self.context_len * 4  # one int32 req_to_token row
        plan: Optional[MemoryPlan] = None
        if args.max_total_tokens is not None:
            budget_tokens = args.max_total_tokens
        elif self.device.type == "cuda" and args.mem_fraction_static is None:
            try:
                plan = self._profiled_plan(bytes_per_token, row_bytes)
                budget_tokens = plan.kv_tokens
            except Exception:  # a start-up that cannot profile still serves, on the fixed share
                logger.exception("profiling the step memory failed; the KV pool takes --mem-fraction-static %.2f",
                                 FALLBACK_MEM_FRACTION)
                self._reset_after_profile()
                budget_tokens = self._kv_budget_bytes(bytes_per_token, FALLBACK_MEM_FRACTION) // bytes_per_token
        else:
            budget_tokens = self._kv_budget_bytes(bytes_per_token) // bytes_per_token

        if args.max_running_requests is not None:
            max_running = args.max_running_requests
        elif self.device.type == "cpu":
            max_running = CPU_DEFAULT_MAX_RUNNING_REQUESTS
        elif plan is not None:
            max_running = min(self._profiled_max_running, default_max_running(budget_tokens))
        else:
            max_running = default_max_running(budget_tokens)
        if args.max_total_tokens is None and plan is None and self.device.type == "cuda":
            # The request table lives in the same memory as the KV pool.
            rows_bytes = (max_running + SPARE_REQUEST_ROWS) * row_bytes
            budget_tokens -= -(-rows_bytes // bytes_per_token)

        self.state_slots, state_bytes = 0, 0
        if config.is_hybrid:  # the state pool comes out of the same budget as the KV pool
            # --max-total-tokens sizes the KV pool alone; a budget from memory is shared with the states.
            from_memory = args.max_total_tokens is None
            max_running, self.state_slots, state_bytes = plan_state_pool(
                config, max_running, SPARE_REQUEST_ROWS, args, self.dtype,
                budget_tokens * bytes_per_token if from_memory else None)
            if from_memory:
                budget_tokens -= -(-state_bytes // bytes_per_token)
            logger.info("state pool: %d slots (%d request rows, %d snapshots), %.1f MiB", self.state_slots,
                        max_running + SPARE_REQUEST_ROWS, self.state_slots - max_running - SPARE_REQUEST_ROWS,
                        state_bytes / (1 << 20))

        # Every rank schedules the same batches, so every rank's pool must hold what the smallest one holds.
        budget_tokens = min_over_ranks(budget_tokens, self.tp_cpu_group)
        total = budget_tokens // self.page_size * self.page_size
        if total < self.page_size:
            raise RuntimeError(
                f"not enough memory for the KV cache ({budget_tokens} tokens); lower the model size, raise "
                "mem_fraction_static or set max_total_tokens"
            )
        if self.device.type == "cuda":
            if plan is None:
                source = ("max_total_tokens" if args.max_total_tokens is not None
                          else f"mem_fraction_static={args.mem_fraction_static or FALLBACK_MEM_FRACTION}")
                plan = MemoryPlan(torch.cuda.get_device_name(self.device),
                                  torch.cuda.get_device_properties(self.device).total_memory,
                                  torch.cuda.memory_allocated(self.device), total * bytes_per_token, total,
                                  source=source)
            else:
                plan = dataclasses.replace(plan, kv=total * bytes_per_token, kv_tokens=total)
            plan = dataclasses.replace(plan, state_pool=state_bytes)
            self.memory_plan = plan
            logger.info("%s", plan.describe())
        return total, max_running

    def _profiled_plan(self, bytes_per_token: int, row_bytes: int) -> MemoryPlan:
        """The KV pool from what the profiled steps leave (model_runner/memory_plan.py); sets
        `_profiled_max_running`, the request limit the steps were profiled with."""
        args = self.config
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        # The request limit follows the pool's size; profile with the largest the pool could give.
        provisional = (free - margin_bytes(total)) // bytes_per_token
        max_running = args.max_running_requests or default_max_running(provisional)
        if self.model_config.is_hybrid:  # the request limit the recurrent states leave room for
            max_running = plan_state_pool(self.model_config, max_running, SPARE_REQUEST_ROWS, args, self.dtype,
                                          free - margin_bytes(total))[0]
        self._profiled_max_running = max_running
        step = profile_step_memory(self, max_running, self._create_attention_backend)
        graph_bs = 0
        if not args.disable_cuda_graph and not args.enable_lora:
            from radixserve.model_runner.cuda_graph import choose_graph_max_batch_size

            graph_bs = choose_graph_max_batch_size(args.cuda_graph_max_bs, total, max_running)
        torch.cuda.synchronize(self.device)
        free = torch.cuda.mem_get_info(self.device)[0]
        plan = MemoryPlan(
            device_name=torch.cuda.get_device_name(self.device), total=total, weights=weights, kv=0, kv_tokens=0,
            activations=max(step.prefill, step.decode), workspace=step.workspace,
            cuda_graphs=graph_bytes(self, graph_bs, step),
            request_table=(max_running + SPARE_REQUEST_ROWS) * row_bytes, margin=margin_bytes(total))
        kv_bytes = max(0, free - plan.reserve)
        return dataclasses.replace(plan, kv=kv_bytes, kv_tokens=kv_bytes // bytes_per_token)

    def _reset_after_profile(self) -> None:
        for name in ("attn_backend", "req_to_token_pool", "allocator", "token_to_kv_pool"):
            self.__dict__.pop(name, None)
        self.model.set_attention_backend(None)
        torch.cuda.empty_cache()

    def _kv_budget_bytes(self, bytes_per_token: int, fraction: Optional[float] = None) -> int:
        """Bytes the KV pool may take: on CUDA what `--mem-fraction-static` leaves after the loaded weights (the
        default is the profiled plan instead, see `_profiled_plan`); on CPU a share of the available RAM, capped
        (a CPU serves few tokens per second, so a bigger pool only costs memory)."""
        fraction = self.config.mem_fraction_static if fraction is None else fraction
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            # mem_fraction_static is the share of the whole device for weights + KV; weights are loaded.
            return int(free - total * (1.0 - fraction))
        import psutil

        fraction = fraction if fraction is not None else CPU_KV_RAM_FRACTION
        return int(min(psutil.virtual_memory().available * fraction, CPU_KV_MAX_BYTES,
                       CPU_KV_MAX_CONTEXTS * self.context_len * bytes_per_token))
