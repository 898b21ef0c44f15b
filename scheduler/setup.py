"""What the scheduler builds once at start-up, and the checks a request passes before it is queued."""

from __future__ import annotations

import logging
from typing import Any, Optional

from radixserve.radix_cache.base import PrefixCache
from radixserve.runtime.wire.server_args import ServerArgs
from radixserve.scheduler.req import Req

logger = logging.getLogger(__name__)


def make_cache(server_args: ServerArgs, req_to_token_pool: Any, allocator: Any, kv_pool: Any,
               shares_kv: bool = True, state_pool: Any = None) -> PrefixCache:
    """The radix cache, the never-sharing cache under `disable_radix_cache` or for a model whose KV cannot be shared
    (`shares_kv` False), or the hierarchical cache (host tier of `hicache_size` GB, else `hicache_ratio` times the
    device pool) under `enable_hierarchical_cache`. A hybrid model (`state_pool`, its recurrent states) gets the
    radix cache that also keeps state snapshots (radix_cache/hybrid.py), or under `enable_hierarchical_cache` the one
    whose snapshots move to the host with their KV (radix_cache/hybrid_hiradix.py; `hicache_ratio` times the device
    snapshot slots on the host)."""
    if kv_pool is not None and kv_pool.window_map is not None:  # sliding windows, window slots (radix_cache/swa.py)
        if server_args.enable_hierarchical_cache:
            raise ValueError("the hierarchical cache does not move window slots to the host; drop "
                             "--enable-hierarchical-cache or add --disable-hybrid-swa-memory")
        if not (server_args.disable_radix_cache or not shares_kv):
            from radixserve.radix_cache.swa import SWARadixCache

            return SWARadixCache(req_to_token_pool, allocator, max(kv_pool.window_sizes),
                                 server_args.radix_eviction_policy)
    if server_args.disable_radix_cache or not shares_kv:
        from radixserve.radix_cache.no_share import NoShareCache

        return NoShareCache(req_to_token_pool, allocator, allocator.page_size)
    if state_pool is not None and server_args.enable_hierarchical_cache:
        if server_args.hicache_storage_dir:
            raise ValueError("the disk tier keeps no recurrent-state snapshots, so a hybrid linear-attention model "
                             "could never resume from it; drop --hicache-storage-dir")
        from radixserve.radix_cache.hybrid_hiradix import HybridHiRadixCache
        from radixserve.radix_cache.state_pool import HostStatePool

        host_states = HostStatePool(state_pool, max(1, int(state_pool.num_snapshot_slots * server_args.hicache_ratio)))
        logger.info("hierarchical cache: %d state snapshot slots on the host (%.2f GB)", host_states.size,
                    host_states.size * host_states.bytes_per_slot / 1e9)
        return HybridHiRadixCache(req_to_token_pool, allocator, _host_kv_pool(server_args, kv_pool, allocator),
                                  state_pool, host_states, allocator.page_size, server_args.radix_eviction_policy,
                                  server_args.hicache_write_policy)
    if state_pool is not None:
        from radixserve.radix_cache.hybrid import HybridRadixCache

        return HybridRadixCache(req_to_token_pool, allocator, state_pool, allocator.page_size,
                                server_args.radix_eviction_policy)
    if server_args.enable_hierarchical_cache:
        from radixserve.radix_cache.hiradix import HiRadixCache

        return HiRadixCache(req_to_token_pool, allocator, _host_kv_pool(server_args, kv_pool, allocator),
                            allocator.page_size, server_args.radix_eviction_policy, server_args.hicache_write_policy,
                            server_args.hicache_storage_dir)
    from radixserve.radix_cache.tree import RadixCache

    return RadixCache(req_to_token_pool, allocator, allocator.page_size, server_args.radix_eviction_policy)


def _host_kv_pool(server_args: ServerArgs, kv_pool: Any, allocator: Any) -> Any:
    """The host tier's KV pool: `hicache_size` GB, else `hicache_ratio` times the device pool."""
    from radixserve.radix_cache.host_pool import HostKVPool

    bytes_per_token = kv_pool.bytes_per_token(kv_pool.num_layers, kv_pool.num_kv_heads, kv_pool.head_dim,
                                              kv_pool.dtype)
    if server_args.hicache_size > 0:
        host_tokens = int(server_args.hicache_size * 1e9) // bytes_per_token
    else:
        host_tokens = int(allocator.size * server_args.hicache_ratio)
    host_pool = HostKVPool(kv_pool, host_tokens)
    logger.info("hierarchical cache: host tier of %d tokens (%.2f GB), %s%s", host_pool.size,
                host_pool.size * bytes_per_token / 1e9, server_args.hicache_write_policy,
                f", disk tier in {server_args.hicache_storage_dir}" if server_args.hicache_storage_dir else "")
    return host_pool


def make_window_release(runner: Any, cache: PrefixCache) -> Optional[Any]:
    """What frees window KV as positions leave the requests' windows (scheduler/window_release.py), for a pool whose
    window layers have slots of their own; None otherwise."""
    pool = runner.token_to_kv_pool
    if pool.window_map is None:
        return None
    from radixserve.scheduler.window_release import WindowRelease

    return WindowRelease(runner.allocator, cache, runner.req_to_token_pool, max(pool.window_sizes))


def try_load_tokenizer(server_args: ServerArgs, model_dir: str) -> Optional[Any]:
    """The model's tokenizer (needed for stop strings), or None when the model directory has none."""
    from radixserve.runtime.wire.tokenizer_files import server_tokenizer

    path = server_args.tokenizer_path or model_dir
    try:
        return server_tokenizer(path, server_args)
    except Exception as exc:  # a model without tokenizer files still serves token-id requests
        logger.warning("no tokenizer in %s (%s: %s); requests with stop strings or grammars will be rejected",
                       path, type(exc).__name__, exc)
        return None


def check_request(req: Req, runner: Any, tokenizer: Any, chunk_size: Optional[int] = None) -> Optional[str]:
    """Why `req` cannot be served, or None. The TokenizerManager has checked the request (SamplingParams and the
    length rule); this checks only what the scheduler alone knows: its KV pool and whether it has a tokenizer."""
    params = req.sampling_params
    page_size = runner.allocator.page_size
    needed = -(-(req.prompt_len + params.max_new_tokens) // page_size) * page_size
    if needed > runner.allocator.size:
        return (f"the prompt plus max_new_tokens needs {needed} KV slots, more than the whole KV pool "
                f"({runner.allocator.size})")
    window_size = getattr(runner.allocator, "window_size", None)
    if window_size is not None:  # window slots (radix_cache/swa_pool.py): an extend holds one per new token
        largest_extend = min(req.prompt_len, chunk_size) if chunk_size else req.prompt_len
        window = max(runner.token_to_kv_pool.window_sizes)
        window_needed = min(needed, largest_extend + window)
        if window_needed > window_size:
            return (f"an extend of {largest_extend} tokens after a window of {window} needs {window_needed} window "
                    f"slots, more than the whole window pool ({window_size}); "
                    "raise --swa-full-tokens-ratio, chunk the prefill (--chunked-prefill-size) or add "
                    "--disable-hybrid-swa-memory")
    if params.stop and tokenizer is None:
        return "stop strings need a tokenizer, and this model has none"
    pooling = runner.pooling
    if req.pooling is None and not pooling.is_generation:
        return f"this model does not generate text; it serves {', '.join(pooling.kinds)} requests"
    if req.pooling is not None and req.pooling.kind not in pooling.kinds:
        return f"this model cannot serve {req.pooling.kind} requests (it serves: {', '.join(pooling.kinds)})"
    return None
