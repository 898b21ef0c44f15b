"""How long the scheduler spends building a /cache/tree summary, as the tree grows.

    .venv/bin/python benchmarks/cache_tree_summary_bench.py                  # 1k, 10k and 50k sequences
    .venv/bin/python benchmarks/cache_tree_summary_bench.py --sizes 1000

Workload: each sequence is one of `sequences / 20` shared 20-token prefixes plus 16 tokens of its own, cached
through match + insert as requests do (so hit counts are real); the summary keeps 300 nodes (the page's request).
Prints the best of 3 runs per size.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from radixserve.radix_cache.pool import KVAllocator, ReqToTokenPool
from radixserve.radix_cache.tree import RadixCache
from radixserve.radix_cache.tree_summary import summarize_tree


def build(num_sequences: int, seed: int) -> RadixCache:
    cache = RadixCache(ReqToTokenPool(2, 8), KVAllocator(num_sequences * 40 + 100, 1), 1)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(20)] for _ in range(max(1, num_sequences // 20))]
    for _ in range(num_sequences):
        ids = rng.choice(prefixes) + [rng.randrange(30000) for _ in range(16)]
        match = cache.match_prefix(ids)
        slots = torch.cat([match.indices, cache.allocator.alloc(len(ids) - match.length)])
        present = cache.insert(ids, slots)
        if present > match.length:
            cache.allocator.free(slots[match.length:present])
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 50000])
    parser.add_argument("--max-nodes", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for size in args.sizes:
        cache = build(size, args.seed)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            summarize_tree(cache, max_nodes=args.max_nodes)
            times.append(time.perf_counter() - start)
        print(f"{size:>7} sequences, {len(cache._nodes()):>7} nodes, {cache.total_size():>9} tokens: "
              f"summary of {args.max_nodes} nodes in {1000 * min(times):.1f} ms")


if __name__ == "__main__":
    main()
