"""Server arguments: the one typed configuration object.

The CLI, the Engine and the HTTP server all build a `ServerArgs`; defaults live here once. This module is
light (no torch, no FastAPI) so every process may import it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from radixserve.runtime.wire import sglang_flags
from radixserve.runtime.wire.attention_backends import ATTENTION_BACKENDS, PREFILL_ATTENTION_BACKENDS, device_refusal
from radixserve.runtime.wire.cpu_kernels import CPU_KERNEL_NAMES, parse_cpu_kernels
from radixserve.runtime.wire.dist_secret import SECRET_ENV, load_dist_secret
from radixserve.runtime.wire.heap import parse_gc_threshold
from radixserve.runtime.wire.lora import parse_lora_paths
from radixserve.runtime.wire.pooling import POOLING_METHODS
from radixserve.runtime.wire.sampling_params import RequestLimits
from radixserve.runtime.wire.quantization import QUANTIZATION_ALIASES, check_quantization
from radixserve.runtime.wire.speculative_args import check_speculative_args, resolved_num_draft_tokens  # noqa: F401

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # SGLang's (and vLLM's) other names
# SGLang's names: fp8_e4m3 / fp8_e5m2 store K and V as float8 (scale 1), read back in the model's dtype.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "bf16", "float16", "fp8_e4m3", "fp8_e5m2")
EVICTION_POLICIES = ("lru", "lfu")
DEFAULT_MAX_QUEUED_REQUESTS = 1024
HICACHE_WRITE_POLICIES = ("write_through", "write_back")
SAMPLING_BACKENDS = ("pytorch",)  # SGLang also has "flashinfer"; radixserve has no FlashInfer sampling path
# SGLang's names; runtime/http/openai/tool_parsers and runtime/http/openai/reasoning.py implement each one.
TOOL_CALL_PARSERS = ("hermes", "qwen25", "llama3", "mistral", "pythonic")
REASONING_PARSERS = ("qwen3", "deepseek-r1")
SAMPLING_DEFAULTS = ("model", "openai")
# How the data-parallel controller picks a replica (runtime/data_parallel/policy.py); minimum_tokens is SGLang's
# name for the least outstanding tokens.
LOAD_BALANCE_METHODS = ("cache_aware", "round_robin", "shortest_queue", "minimum_tokens")
DIST_AUTH_SECRET_HELP = ("a file (this user's, mode 600) holding the secret every node of a multi-node "
                         "tensor-parallel group shares; the rendezvous admits only connections that prove they hold "
                         f"it. Required with --nnodes > 1, unless ${SECRET_ENV} holds the secret")
CPU_KERNELS_HELP = (f"auto: radixserve's C++ CPU kernels where this CPU runs them; torch: torch's ops only; "
                    f"auto,-NAME,... : auto without the named ones ({', '.join(CPU_KERNEL_NAMES)})")


@dataclass
class ServerArgs:
    # Model and tokenizer
    model_path: Optional[str] = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    tokenizer_path: Optional[str] = None
    tokenizer_mode: str = "auto"  # SGLang's; "auto" (the fast tokenizer) is the only mode
    # Lets the tokenizer run code shipped with the checkpoint (Hugging Face's trust_remote_code). Models are always
    # radixserve's own implementations, so no model code from the checkpoint runs either way.
    trust_remote_code: bool = False
    load_format: str = "auto"
    model_cache_dir: Optional[str] = None  # GGUF conversions; default ~/.cache/radixserve
    served_model_name: Optional[str] = None
    chat_template: Optional[str] = None
    tool_call_parser: Optional[str] = None  # one of TOOL_CALL_PARSERS: how tool calls are read from model text
    reasoning_parser: Optional[str] = None  # one of REASONING_PARSERS: how <think> text is split off
    context_length: Optional[int] = None
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES; auto: the model's dtype
    device: str = "auto"  # auto: cuda when available, else cpu
    cpu_kernels: str = field(default="auto", metadata={"help": CPU_KERNELS_HELP})
    random_seed: int = 0

    # Memory
    # None: on a GPU the KV pool takes what the profiled start-up steps leave (model_runner/memory_plan.py).
    mem_fraction_static: Optional[float] = None
    max_total_tokens: Optional[int] = None
    page_size: int = 1

    # Scheduling
    max_running_requests: Optional[int] = None
    max_prefill_tokens: int = 16384
    chunked_prefill_size: Optional[int] = None  # None: device default; -1 disables chunking
    enable_mixed_chunk: bool = False
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    disable_overlap_schedule: Optional[bool] = None  # None: overlap on a GPU, not on the CPU (see below)
    max_queued_requests: Optional[int] = None  # None: DEFAULT_MAX_QUEUED_REQUESTS; beyond it, 503 + Retry-After
    max_sequences_per_request: int = 1024  # prompts x n of one HTTP request; more is a 400
    # Fair share across tenants and per-request priority (scheduler/fair_share.py, docs/fair-share.md).
    disable_fair_share: bool = False  # True: admission ignores tenants (policy order, then priority)
    disable_fair_share_preemption: bool = False  # True: a tenant under its share waits for a free row
    enable_priority_scheduling: bool = False  # SGLang's: order requests of one tenant by their `priority`
    schedule_low_priority_values_first: bool = False  # smaller priority values first (default: larger)
    default_priority_value: Optional[int] = None  # priority of a request without one (None: 0)
    abort_on_priority_when_disabled: bool = False  # a request with a priority fails (400) without the above

    # Radix cache
    disable_radix_cache: bool = False
    radix_eviction_policy: str = "lru"
    # Hierarchical cache (SGLang's HiCache flags): evicted KV is demoted to host memory (and disk) and loaded back.
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0  # host tier size as a multiple of the device KV pool
    hicache_size: float = 0.0  # host tier size in GB (1e9 bytes); overrides hicache_ratio when > 0
    hicache_write_policy: str = "write_through"
    hicache_storage_dir: Optional[str] = None  # a disk tier under the host tier, in this folder

    # LoRA adapters (SGLang's flags; docs/lora.md). lora_paths: "name=path", "path" (named by its path) or a JSON
    # object {"lora_name": ..., "lora_path": ...}; the Engine also takes a dict name -> path.
    enable_lora: Optional[bool] = None  # None: on when lora_paths are given
    lora_paths: Optional[list[str]] = None
    max_lora_rank: Optional[int] = None  # None: the largest rank of lora_paths (16 without any)
    max_loras_per_batch: int = 8  # distinct adapters in one batch (the device pool's slots)

    # Kernels
    attention_backend: Optional[str] = None  # None: flashinfer on CUDA, cpu (the C++ kernel) on the CPU
    # SGLang's flag, for the flashinfer backend's extend kernels: None picks FA3 for long extends on Hopper (compiled
    # at start-up) and FA2 for the rest; "flashinfer" FA2 for every extend (nothing FA3 to compile); "fa3" FA3 for
    # every extend (Hopper only)
    prefill_attention_backend: Optional[str] = None
    # SGLang's flag: the backend of decode batches, the attention backend keeping the rest. None: the attention backend
    # asked for, or with none, on CUDA triton's split-KV decode beside flashinfer's extends (attention/hybrid.py)
    decode_attention_backend: Optional[str] = None
    sampling_backend: Optional[str] = None  # None: "pytorch", the only one
    grammar_backend: Optional[str] = None  # None: "xgrammar", the only one (structured output)
    disable_cuda_graph: bool = False
    # FlashInfer decode reads a cached prefix shared by several running requests once per step (vLLM's flag name)
    disable_cascade_attn: bool = False
    cuda_graph_max_bs: Optional[int] = None  # None: 1024 on a GPU of >= 64 GiB, else 256 (model_runner/cuda_graph.py)
    tp_size: int = 1  # tensor-parallel ranks, one scheduler process each (docs/parallelism.md)
    # expert-parallel ranks of a mixture of experts inside the TP group (a divisor of tp_size): each holds E/ep_size
    # of the routed experts, split over tp_size/ep_size ranks by intermediate features
    ep_size: int = 1
    dist_init_addr: Optional[str] = None  # "host:port" of the TP group's rendezvous; None: a free local port
    dist_timeout: float = 600.0  # seconds a collective may wait for a peer before the group fails
    nnodes: int = 1  # hosts the TP group spans; node k > 0 runs only its ranks (runtime/tp_node.py)
    node_rank: int = 0
    dp_size: int = 1  # data-parallel replicas, each a scheduler (or TP group) with its own KV pool and tree
    load_balance_method: str = "cache_aware"  # one of LOAD_BALANCE_METHODS
    # cache_aware: a prefix match shorter than this share of the prompt goes to the least loaded replica ...
    dp_cache_threshold: float = 0.5
    # ... and so does every request while the busiest replica's load exceeds both the idlest's + abs and
    # the idlest's x rel (outstanding requests; sglang-router's balance thresholds).
    dp_balance_abs_threshold: int = 32
    dp_balance_rel_threshold: float = 1.5

    # HTTP server
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: Optional[str] = None
    tenants_file: Optional[str] = None
    admin_api_key: Optional[str] = None  # needed for /flush_cache, /metrics, the whole /get_server_info
    graceful_shutdown_timeout: float = 30.0  # SIGTERM: seconds in-flight requests may finish before abort
    max_request_bytes: int = 32 * 1024 * 1024  # larger request bodies get 413
    # Native /generate and Engine streams: False sends the whole text (and output_ids, logprobs) so far in each
    # chunk, as SGLang does by default; True sends only what is new. OpenAI streams are deltas either way.
    incremental_streaming_output: bool = False
    stream_interval: int = 1  # a streaming request is sent every N new tokens (its first and last always at once)
    # Unset temperature/top_p/top_k/min_p/repetition_penalty: "model" takes them from the model's
    # generation_config.json, "openai" uses the neutral values (temperature 1, top_p 1, ...).
    sampling_defaults: str = "model"

    # Logging and checks
    log_level: str = "info"
    decode_log_interval: int = 40
    # Python's cyclic collector in the serving processes (runtime/wire/heap.py): SGLang's 1-3 thresholds (None:
    # a young threshold of heap.YOUNG_THRESHOLD), and a warning logged for any collection longer than this (0: off).
    gc_threshold: Optional[list[int]] = None
    gc_warning_threshold_secs: float = 0.0
    enable_metrics: bool = True
    check_invariants_when_idle: bool = True
    watchdog_timeout: float = 300.0  # seconds one scheduler step may take (scheduler/watchdog.py)
    skip_server_warmup: bool = False

    # Speculative decoding (SGLang's flags; runtime/wire/speculative_args.py says which values are honoured)
    speculative_algorithm: Optional[str] = None  # "NGRAM" or "STANDALONE"; None: off
    speculative_draft_model_path: Optional[str] = None  # STANDALONE's draft model
    speculative_num_draft_tokens: Optional[int] = None  # verified chain length (drafts + 1); None: 6
    speculative_num_steps: Optional[int] = None  # drafts per step; num_draft_tokens - 1 when both are given
    speculative_eagle_topk: Optional[int] = None  # must be 1 (chains)
    speculative_ngram_min_match_window_size: int = 1  # shortest suffix an n-gram proposal must match
    speculative_ngram_max_match_window_size: int = 12  # longest suffix tried
    speculative_ngram_min_bfs_breadth: int = 1  # must be 1 (chains)
    speculative_ngram_max_bfs_breadth: int = 1  # must be 1 (chains)
    speculative_ngram_match_type: str = "BFS"

    # Pooling models: embeddings, classification, rerank and score (runtime/wire/pooling.py, docs/embeddings.md)
    is_embedding: bool = False  # serve a decoder as an embedding model (encoders and classifiers are detected)
    # last, mean or cls; None: the model's sentence-transformers pooling config, else last (decoders) / cls (encoders)
    pooling_method: Optional[str] = None
    # Retained sessions (prompt_cache_key + prompt_cache_retention; radix_cache/retention.py): tokens each tenant
    # may retain (None: a quarter of the KV pool; with --enable-hierarchical-cache, where sessions are then kept on the
    # host tier, 3/8 of it); all tenants together retain at most half of the pool (3/4 of the host tier).
    retention_quota_tokens: Optional[int] = None
    # Post-training (docs/rl.md): the weight version reported until the first update (SGLang's --weight-version), and
    # batch-invariant kernels: one request gives the same bits alone, in any batch and after cache hits (CPU)
    weight_version: str = "default"
    enable_deterministic_inference: bool = False
    # Security (docs/security.md): request headers, adapter loading over HTTP, grammar compilation
    max_header_bytes: int = 64 * 1024  # request line + headers; more gets 431
    grammar_compile_timeout: float = 30.0  # seconds a structured-output request waits for its grammar, then fails
    max_request_n: int = 128  # n (and best_of) of one prompt; more is a 400
    max_stop_strings: int = 32  # stop strings of one request
    max_stop_string_length: int = 1024  # characters of one stop string
    max_logit_bias_tokens: int = 1024  # logit_bias entries of one request
    lora_adapter_dir: Optional[str] = None  # /load_lora_adapter loads only from under this folder; None: refused
    # Quantized weights (SGLang's --quantization names; runtime/wire/quantization.py says which values run)
    # None: the runner's choice (model_runner/cpu/gguf_default.py: today the model's dtype everywhere); "none": the
    # model's dtype; "gguf": a GGUF's linears on its own blocks (CPU)
    quantization: Optional[str] = None
    # Hybrid linear-attention models (docs/hybrid.md): state slots in all, running and snapshots (None: from the budget)
    max_mamba_cache_size: Optional[int] = None
    mamba_ssm_dtype: str = "float32"  # the recurrent states' dtype: float32, bfloat16 or float16
    # CPU threads (model_runner/cpu/thread_governor.py): keep every forward step on the whole thread team instead of
    # measuring, beside other busy processes, whether fewer threads are faster
    disable_cpu_thread_governor: bool = False
    # Sliding-window models (docs/sliding_window.md): window-layer slots per full slot; or every layer keeps every token
    swa_full_tokens_ratio: float = 0.8
    disable_hybrid_swa_memory: bool = False
    # Authenticated rendezvous across hosts (runtime/wire/dist_secret.py, docs/security.md)
    dist_auth_secret_file: Optional[str] = field(default=None, metadata={"help": DIST_AUTH_SECRET_HELP})
    # GGUF blocks on the CPU (model_runner/cpu/gguf_linear.py): their activations, float32 or int8 per block of 32 as
    # llama.cpp rounds them (faster; another function: greedy tokens may change)
    gguf_activations: str = "float32"

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(self.load_format in LOAD_FORMATS, f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        check(self.dtype in DTYPES,
              f"dtype must be one of {DTYPES} (or {', '.join(DTYPE_ALIASES)}), got {self.dtype!r}")
        check(self.kv_cache_dtype in KV_CACHE_DTYPES,
              f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        check(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
              f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        check(self.tool_call_parser is None or self.tool_call_parser in TOOL_CALL_PARSERS,
              f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        check(self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS,
              f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")
        check(self.page_size >= 1, f"page_size must be >= 1, got {self.page_size}")
        check(self.tokenizer_mode == "auto",
              f"tokenizer_mode must be 'auto' (radixserve runs fast tokenizers only), got {self.tokenizer_mode!r}")
        check(self.grammar_backend in (None, "xgrammar"),
              f"grammar_backend must be 'xgrammar' (the only one), got {self.grammar_backend!r}")
        check(self.stream_interval >= 1, f"stream_interval must be >= 1, got {self.stream_interval}")
        check(self.schedule_policy in SCHEDULE_POLICIES,
              f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        check(self.radix_eviction_policy in EVICTION_POLICIES,
              f"radix_eviction_policy must be one of {EVICTION_POLICIES}, got {self.radix_eviction_policy!r}")
        check(self.hicache_write_policy in HICACHE_WRITE_POLICIES,
              f"hicache_write_policy must be one of {HICACHE_WRITE_POLICIES}, got {self.hicache_write_policy!r}")
        check(self.hicache_ratio > 0, f"hicache_ratio must be positive, got {self.hicache_ratio}")
        check(self.hicache_size >= 0, f"hicache_size must be >= 0 GB, got {self.hicache_size}")
        check(not (self.enable_hierarchical_cache and self.disable_radix_cache),
              "enable_hierarchical_cache needs the radix cache; drop disable_radix_cache")
        check(self.enable_hierarchical_cache or (self.hicache_storage_dir is None and self.hicache_size == 0),
              "hicache_storage_dir and hicache_size need enable_hierarchical_cache")
        check(self.attention_backend is None or self.attention_backend in ATTENTION_BACKENDS,
              f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        refusal = device_refusal(self.attention_backend, "cpu" if self.resolved_device() == "cpu" else "cuda")
        check(refusal is None, refusal)  # here, before any process starts and loads the model
        check(self.prefill_attention_backend in (None, *PREFILL_ATTENTION_BACKENDS),
              f"prefill_attention_backend must be flashinfer (FlashInfer's FA2 kernels for every extend) or fa3 "
              f"(its FA3 kernels, Hopper GPUs), got {self.prefill_attention_backend!r}")
        check(self.prefill_attention_backend is None or self.attention_backend in (None, "flashinfer"),
              f"prefill_attention_backend picks the flashinfer backend's extend kernels; the "
              f"{self.attention_backend} attention backend has its own")
        check(self.decode_attention_backend is None or self.decode_attention_backend in ATTENTION_BACKENDS,
              f"decode_attention_backend must be one of {ATTENTION_BACKENDS}, got {self.decode_attention_backend!r}")
        refusal = device_refusal(self.decode_attention_backend, "cpu" if self.resolved_device() == "cpu" else "cuda")
        check(refusal is None, refusal and f"decode_attention_backend: {refusal}")
        check(not (self.enable_deterministic_inference
                   and self.decode_attention_backend not in (None, self.resolved_attention_backend())),
              f"enable_deterministic_inference decodes on the {self.resolved_attention_backend()} backend's "
              "row-invariant kernel; drop decode_attention_backend")
        check(not (self.prefill_attention_backend == "fa3" and self.kv_cache_dtype != "auto"),
              "prefill_attention_backend fa3 reads a KV cache in the model's dtype; drop kv_cache_dtype or use "
              "flashinfer")
        check(self.mem_fraction_static is None or 0.0 < self.mem_fraction_static < 1.0,
              f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        check(self.max_total_tokens is None or self.max_total_tokens > 0,
              f"max_total_tokens must be positive, got {self.max_total_tokens}")
        check(self.max_running_requests is None or self.max_running_requests > 0,
              f"max_running_requests must be positive, got {self.max_running_requests}")
        check(self.max_prefill_tokens > 0, f"max_prefill_tokens must be positive, got {self.max_prefill_tokens}")
        check(self.chunked_prefill_size is None or self.chunked_prefill_size == -1 or self.chunked_prefill_size > 0,
              f"chunked_prefill_size must be positive or -1, got {self.chunked_prefill_size}")
        check(self.context_length is None or self.context_length > 0,
              f"context_length must be positive, got {self.context_length}")
        check(self.schedule_conservativeness > 0, "schedule_conservativeness must be positive")
        check(self.sampling_backend is None or self.sampling_backend in SAMPLING_BACKENDS,
              f"sampling_backend {self.sampling_backend!r} is not available: radixserve samples with PyTorch only "
              f"(use one of {SAMPLING_BACKENDS} or leave it unset)")
        parse_cpu_kernels(self.cpu_kernels)  # raises ValueError, naming what is accepted
        check(self.watchdog_timeout > 0, f"watchdog_timeout must be positive, got {self.watchdog_timeout}")
        check(self.tp_size >= 1, f"tp_size must be >= 1, got {self.tp_size}")
        check(self.ep_size >= 1 and self.tp_size % self.ep_size == 0,
              f"ep_size {self.ep_size} does not divide tp_size {self.tp_size}: the expert-parallel ranks are ranks "
              "of the tensor-parallel group")
        check(self.nnodes >= 1 and 0 <= self.node_rank < self.nnodes,
              f"node_rank must be in 0..nnodes-1, got node_rank {self.node_rank} with nnodes {self.nnodes}")
        check(self.tp_size % self.nnodes == 0,
              f"tp_size {self.tp_size} must be a multiple of nnodes {self.nnodes} (the same ranks on every node)")
        check(self.nnodes == 1 or self.dist_init_addr is not None,
              "nnodes > 1 needs dist_init_addr HOST:PORT (node 0's address, reachable from every node)")
        check(self.dist_init_addr is None or self.dist_init_addr.rpartition(":")[2].isdigit(),
              f"dist_init_addr must be HOST:PORT, got {self.dist_init_addr!r}")
        check(self.dp_size >= 1, f"dp_size must be >= 1, got {self.dp_size}")
        check(self.load_balance_method in LOAD_BALANCE_METHODS,
              f"load_balance_method must be one of {LOAD_BALANCE_METHODS}, got {self.load_balance_method!r}")
        check(0.0 <= self.dp_cache_threshold <= 1.0,
              f"dp_cache_threshold must be in [0, 1], got {self.dp_cache_threshold}")
        check(self.dp_balance_abs_threshold >= 0 and self.dp_balance_rel_threshold >= 1.0,
              "dp_balance_abs_threshold must be >= 0 and dp_balance_rel_threshold >= 1")
        check(self.dp_size == 1 or self.nnodes == 1,
              "dp_size > 1 runs its replicas on this host; across hosts put one server per host behind "
              "sglang-router (docs/parallelism.md)")
        check(0 < self.port < 65536, f"port must be in 1..65535, got {self.port}")
        check(self.api_key is None or self.tenants_file is None, "give either api_key or tenants_file, not both")
        check(self.max_queued_requests is None or self.max_queued_requests >= 0,
              f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        check(self.max_sequences_per_request > 0,
              f"max_sequences_per_request must be positive, got {self.max_sequences_per_request}")
        check(self.sampling_defaults in SAMPLING_DEFAULTS,
              f"sampling_defaults must be one of {SAMPLING_DEFAULTS}, got {self.sampling_defaults!r}")
        check(self.max_request_bytes > 0, f"max_request_bytes must be positive, got {self.max_request_bytes}")
        check(self.graceful_shutdown_timeout >= 0,
              f"graceful_shutdown_timeout must be >= 0, got {self.graceful_shutdown_timeout}")
        check(self.max_loras_per_batch >= 1, f"max_loras_per_batch must be >= 1, got {self.max_loras_per_batch}")
        check(self.max_lora_rank is None or self.max_lora_rank >= 1,
              f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        check(not (self.enable_lora is False and self.lora_paths), "lora_paths need LoRA: drop --no-enable-lora")
        if self.lora_paths is not None:
            self.lora_paths = parse_lora_paths(self.lora_paths)
        check(not self.lora_enabled() or self.tp_size == 1, "LoRA adapters need tp_size 1")
        check(not self.lora_enabled() or not self.enable_hierarchical_cache,
              "LoRA adapters need the one-tier radix cache: drop enable_hierarchical_cache")
        check(self.log_level.lower() in ("debug", "info", "warning", "error", "critical"),
              f"unknown log_level {self.log_level!r}")
        if self.gc_threshold is not None:
            self.gc_threshold = parse_gc_threshold(self.gc_threshold)
        check(self.gc_warning_threshold_secs >= 0,
              f"gc_warning_threshold_secs must be >= 0, got {self.gc_warning_threshold_secs}")
        check_speculative_args(self)
        check(self.pooling_method is None or self.pooling_method in POOLING_METHODS,
              f"pooling_method must be one of {POOLING_METHODS}, got {self.pooling_method!r}")
        # Retained sessions
        check(self.retention_quota_tokens is None or self.retention_quota_tokens >= 0,
              f"retention_quota_tokens must be >= 0, got {self.retention_quota_tokens}")

        check(bool(self.weight_version), "weight_version must not be empty")
        if self.enable_deterministic_inference:
            check(self.tp_size == 1, "enable_deterministic_inference needs tp_size 1 (the sharded linears' sums "
                                     "are not batch-invariant)")
            if self.resolved_device() == "cpu":
                check(self.cpu_kernels != "torch", "enable_deterministic_inference runs every linear through "
                                                   "radixserve's CPU kernel: drop --cpu-kernels torch")
                check(self.attention_backend in (None, "cpu"),
                      "enable_deterministic_inference runs the cpu attention backend (its fixed split) on the CPU")
            else:
                check(self.attention_backend in (None, "triton"),
                      "enable_deterministic_inference runs the triton attention backend (every row as a decode row, "
                      "one split) on a GPU")
                check(self.quantization is None, "enable_deterministic_inference runs every linear through its "
                                                 "batch-invariant bfloat16/float32 GEMM: drop --quantization")
                check(not self.lora_enabled(), "enable_deterministic_inference on a GPU does not cover LoRA adapters "
                                            "(their batched GEMMs are not batch-invariant)")
        # Security
        check(self.max_header_bytes >= 1024, f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")
        check(self.grammar_compile_timeout > 0,
              f"grammar_compile_timeout must be positive, got {self.grammar_compile_timeout}")
        for limit in ("max_request_n", "max_stop_strings", "max_stop_string_length", "max_logit_bias_tokens"):
            check(getattr(self, limit) >= 1, f"{limit} must be >= 1, got {getattr(self, limit)}")
        check(self.lora_adapter_dir is None or os.path.isdir(self.lora_adapter_dir),
              f"lora_adapter_dir {self.lora_adapter_dir!r} is not a folder")
        # Quantized weights
        self.quantization = QUANTIZATION_ALIASES.get(self.quantization, self.quantization)
        check_quantization(self.quantization, self.resolved_device(), self.resolved_dtype(), self.tp_size,
                           True if self.model_path is None or self.model_path.endswith(".gguf") else None)
        check(self.quantization != "gguf" or self.cpu_kernels != "torch",
              "quantization 'gguf' runs on radixserve's C++ CPU kernels, which cpu_kernels 'torch' turns off")
        check(self.quantization in (None, "none") or not self.lora_enabled(),
              f"LoRA adapters apply to float weights; drop quantization {self.quantization!r}")
        # Hybrid linear-attention models
        check(self.max_mamba_cache_size is None or self.max_mamba_cache_size >= 2,
              f"max_mamba_cache_size must be >= 2, got {self.max_mamba_cache_size}")
        check(self.mamba_ssm_dtype in ("float32", "bfloat16", "float16"),
              f"mamba_ssm_dtype must be float32, bfloat16 or float16, got {self.mamba_ssm_dtype!r}")
        # Sliding-window models
        check(0.0 < self.swa_full_tokens_ratio <= 1.0,
              f"swa_full_tokens_ratio must be in (0, 1] (window slots per full slot), got {self.swa_full_tokens_ratio}")
        # Authenticated rendezvous across hosts: the secret is read here only to check it (never kept)
        check(load_dist_secret(self.dist_auth_secret_file) is not None or self.nnodes == 1,
              "nnodes > 1 needs the group's shared secret: give --dist-auth-secret-file PATH (a file only its owner "
              f"can read) or set {SECRET_ENV}, with the same secret on every node (docs/security.md)")
        # GGUF blocks on the CPU
        check(self.gguf_activations in ("float32", "int8"),
              f"gguf_activations must be float32 or int8, got {self.gguf_activations!r}")
        check(self.gguf_activations == "float32" or self.quantization == "gguf",
              "gguf_activations int8 rounds the activations of a GGUF's own blocks: it needs --quantization gguf")

    # ---- resolved values -------------------------------------------------------------------------
    def lora_enabled(self) -> bool:
        return bool(self.enable_lora) or bool(self.lora_paths)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        try:
            import torch
        except ImportError:  # pragma: no cover - torch is a dependency
            return "cpu"
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.resolved_device() == "cpu" else "bfloat16"

    def resolved_attention_backend(self) -> str:
        if self.attention_backend is not None:
            return self.attention_backend
        if self.resolved_device() == "cpu":
            return "cpu"
        return "triton" if self.enable_deterministic_inference else "flashinfer"

    def resolved_decode_attention_backend(self) -> str:
        """The backend of decode batches: the one asked for; with none, the attention backend asked for, or with
        neither, on CUDA triton beside flashinfer (its decode measured faster and needs no host planning per step;
        model_runner/attention/hybrid.py) and elsewhere the device's default."""
        if self.decode_attention_backend is not None:
            return self.decode_attention_backend
        backend = self.resolved_attention_backend()
        return "triton" if backend == "flashinfer" and self.attention_backend is None else backend

    def resolved_overlap_schedule(self) -> bool:
        """Whether the overlap scheduler runs. By default only on a GPU: there it hides the host's work
        behind the device's; on the CPU the model's kernels and the scheduler share the same cores, and
        running them in two threads measured 15-30% slower than one after the other."""
        if self.disable_overlap_schedule is not None:
            return not self.disable_overlap_schedule
        return self.resolved_device() != "cpu"

    def request_limits(self) -> RequestLimits:
        return RequestLimits(max_request_n=self.max_request_n, max_stop_strings=self.max_stop_strings,
                             max_stop_string_length=self.max_stop_string_length,
                             max_logit_bias_tokens=self.max_logit_bias_tokens)

    def resolved_max_queued_requests(self) -> int:
        """Sequences that may wait beyond the running ones before new requests get 503 (with Retry-After)."""
        return DEFAULT_MAX_QUEUED_REQUESTS if self.max_queued_requests is None else self.max_queued_requests

    def resolved_chunked_prefill_size(self, generates: bool = True) -> Optional[int]:
        """Tokens per prefill chunk, or None when chunking is off. The CPU's default chunk is small so that running
        requests decode between a long prompt's chunks; a model that only pools (`generates` False) decodes
        nothing, and its batches take the GPU's default: fewer, larger matmuls and parallel regions."""
        if self.chunked_prefill_size == -1:
            return None
        if self.chunked_prefill_size is not None:
            return self.chunked_prefill_size
        return 512 if self.resolved_device() == "cpu" and generates else 8192

    # ---- CLI -------------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        for f in fields(ServerArgs):
            flags = [sglang_flags.flag_of(f.name), *sglang_flags.ALIASES.get(f.name, ())]
            default = f.default if f.default is not dataclasses.MISSING else None
            kind = _field_type(f)
            help_text = " ".join(filter(None, (f.metadata.get("help"), f"(default: {default})")))
            if kind is bool:  # --flag sets it, --no-flag clears it (so flags that default to on can be turned off)
                parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default,
                                    help=help_text)
            elif kind is list:  # --flag A B C
                parser.add_argument(*flags, nargs="*", default=default, help=help_text)
            else:
                parser.add_argument(*flags, type=kind, default=default, help=help_text)
        parser.add_argument("--model", dest="model_path", help="alias of --model-path")
        taken = {option for action in parser._actions for option in action.option_strings}
        sglang_flags.add_cli_args(parser, taken)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        """Raises ValueError for SGLang flags radixserve cannot honour (runtime/wire/sglang_flags.py)."""
        sglang_flags.check_cli_args(args)
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _field_type(f: dataclasses.Field) -> type:
    annotation = str(f.type)
    if annotation.startswith(("list[", "Optional[list[")):
        return list
    for name, kind in (("bool", bool), ("int", int), ("float", float)):
        if annotation == name or annotation == f"Optional[{name}]":
            return kind
    return str


def make_server_args(model_path: Optional[str] = None, **kwargs: Any) -> ServerArgs:
    """Build ServerArgs from keyword arguments, rejecting unknown names with a clear message."""
    known = {f.name for f in fields(ServerArgs)}
    if "model" in kwargs and model_path is None:
        model_path = kwargs.pop("model")
    kwargs = sglang_flags.check_keywords(kwargs, known)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown server argument(s): {', '.join(unknown)}")
    return ServerArgs(model_path=model_path, **kwargs)
