"""`RunnerConfig`: the server arguments that shape a ModelRunner, resolved once and frozen.

`RunnerConfig.from_server_args` is the one place that reads `ServerArgs` for the runner: the device and dtypes are
resolved there, and the model's files are located (a GGUF was converted at launch, runtime/model_files.py), so the
runner receives paths. Two runners built from equal configs are interchangeable (the test driver shares them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from radixserve.model_runner.cpu.gguf_default import resolved_quantization
from radixserve.runtime.wire.model_files import ModelFiles, locate_model
from radixserve.runtime.wire.server_args import ServerArgs


@dataclass(frozen=True)
class RunnerConfig:
    # Model and numbers
    model: ModelFiles
    device: str  # "cpu" or "cuda"
    dtype: str  # float32, bfloat16 or float16
    kv_cache_dtype: str  # one of ServerArgs' KV_CACHE_DTYPES; auto: the model's dtype
    context_length: Optional[int]  # None: the model's max_position_embeddings
    random_seed: int  # of the dummy weights
    cpu_kernels: str  # --cpu-kernels (runtime/wire/cpu_kernels.py)

    # Memory
    mem_fraction_static: Optional[float]
    max_total_tokens: Optional[int]
    max_running_requests: Optional[int]
    page_size: int
    # The largest prefill batch the scheduler forms, profiled at start-up on a GPU (memory_plan.py).
    chunked_prefill_size: Optional[int]  # resolved: None when chunking is off
    max_prefill_tokens: int
    enable_mixed_chunk: bool

    # Kernels
    attention_backend: str  # resolved
    attention_backend_fallback: bool  # no backend asked for: another may stand in where the default cannot run
    prefill_attention_backend: Optional[str]
    decode_attention_backend: str  # resolved; the attention backend's own name where decode stays on it
    decode_attention_default: bool  # no --decode-attention-backend: larger decode batches stay on the other backend
    disable_cascade_attn: bool
    disable_cuda_graph: bool
    cuda_graph_max_bs: Optional[int]

    # Parallelism
    tp_size: int
    ep_size: int  # a divisor of tp_size (model_runner/parallel.py: ExpertShard)
    nnodes: int
    dp_size: int
    dist_init_addr: Optional[str]
    dist_timeout: float

    # LoRA and speculation
    enable_lora: bool
    lora_paths: tuple[str, ...]  # "name=path" (ServerArgs has normalised every accepted form)
    max_lora_rank: Optional[int]
    max_loras_per_batch: int
    speculative: bool  # verify steps of many rows: the float32 CPU linears keep a packed copy
    deterministic: bool = False  # batch-invariant kernels (--enable-deterministic-inference; model_runner/cpu/dispatch.py)
    cpu_thread_governor: bool = True  # fewer threads beside busy processes (model_runner/cpu/thread_governor.py)
    # The file holding a tensor-parallel group's shared secret (runtime/wire/dist_secret.py; None: the environment's,
    # if any); read by each rank when it joins, never kept in a config
    dist_auth_secret_file: Optional[str] = None

    # Pooling (model_runner/pooling.py)
    is_embedding: bool = False
    pooling_method: Optional[str] = None

    # Quantized weights: "gguf" (a GGUF's linears on its own blocks, model_runner/cpu/gguf_linear.py) or None; resolved
    # (unasked, a GGUF model on an AVX-512 CPU runs on its blocks: model_runner/cpu/gguf_default.py)
    quantization: Optional[str] = None
    gguf_activations: str = "float32"  # the blocks' activations: float32 or int8 (gguf_linear.py)
    gguf_keep_float: bool = False  # blocks chosen by default keep the float projections for prefill rows

    # Hybrid models' state pool (model_runner/state_memory.py): total slots (None: sized from the budget) and the
    # recurrent state's dtype
    max_mamba_cache_size: Optional[int] = None
    mamba_ssm_dtype: str = "float32"

    # Sliding-window models (model_runner/swa_memory.py): window slots per full slot, or one slot space for all layers
    swa_full_tokens_ratio: float = 0.8
    disable_hybrid_swa_memory: bool = False

    @classmethod
    def from_server_args(cls, args: ServerArgs, model: Optional[ModelFiles] = None) -> "RunnerConfig":
        """The runner's part of `args`; `model`: the model's files when the caller has them, else located from
        `args` (without converting anything)."""
        if model is None:
            model = locate_model(args.model_path, args.load_format, args.model_cache_dir)
        quantization = resolved_quantization(args, model)
        return cls(
            model=model, device=args.resolved_device(), dtype=args.resolved_dtype(),
            kv_cache_dtype=args.kv_cache_dtype, context_length=args.context_length, random_seed=args.random_seed,
            cpu_kernels=args.cpu_kernels,
            mem_fraction_static=args.mem_fraction_static, max_total_tokens=args.max_total_tokens,
            max_running_requests=args.max_running_requests, page_size=args.page_size,
            chunked_prefill_size=args.resolved_chunked_prefill_size(), max_prefill_tokens=args.max_prefill_tokens,
            enable_mixed_chunk=args.enable_mixed_chunk,
            attention_backend=args.resolved_attention_backend(),
            attention_backend_fallback=args.attention_backend is None and args.prefill_attention_backend is None,
            prefill_attention_backend=args.prefill_attention_backend,
            decode_attention_backend=args.resolved_decode_attention_backend(),
            decode_attention_default=args.decode_attention_backend is None,
            disable_cascade_attn=args.disable_cascade_attn,
            disable_cuda_graph=args.disable_cuda_graph, cuda_graph_max_bs=args.cuda_graph_max_bs,
            tp_size=args.tp_size, ep_size=args.ep_size, nnodes=args.nnodes, dp_size=args.dp_size, dist_init_addr=args.dist_init_addr,
            dist_timeout=args.dist_timeout,
            enable_lora=args.lora_enabled(), lora_paths=tuple(args.lora_paths or ()), max_lora_rank=args.max_lora_rank,
            max_loras_per_batch=args.max_loras_per_batch, speculative=args.speculative_algorithm is not None,
            is_embedding=args.is_embedding, pooling_method=args.pooling_method,
            deterministic=args.enable_deterministic_inference, cpu_thread_governor=not args.disable_cpu_thread_governor,
            dist_auth_secret_file=args.dist_auth_secret_file,
            quantization=quantization, gguf_activations=args.gguf_activations,
            gguf_keep_float=quantization == "gguf" and args.quantization is None,
            max_mamba_cache_size=args.max_mamba_cache_size, mamba_ssm_dtype=args.mamba_ssm_dtype,
            swa_full_tokens_ratio=args.swa_full_tokens_ratio, disable_hybrid_swa_memory=args.disable_hybrid_swa_memory,
        )
