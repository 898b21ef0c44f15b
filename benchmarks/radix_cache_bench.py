"""Microbenchmark of the radix cache: microseconds per match / insert / evict as the tree grows.

    .venv/bin/python benchmarks/radix_cache_bench.py                 # trees of 1k, 10k and 100k sequences
    .venv/bin/python benchmarks/radix_cache_bench.py --sizes 1000    # a quick run

Workload (shared-prefix-ish, like chat traffic): every cached sequence is a system prompt (16 of them, 512-1024
tokens) + a conversation history (64 per system prompt, 256-2560 tokens) + its own suffix (16-512 tokens), so
sequences are 784-4096 tokens long and the tree has real structure: 16 system-prompt nodes, ~1k history nodes,
one leaf per sequence. Sharing is what keeps 100k sequences of ~2.3k tokens (230M tokens) in memory: the tree
holds only ~1.5M shared + ~26M unique tokens. The KV allocator is real and sized to fit the tree exactly.

Tables printed (and written as JSON under benchmarks/results/):
1. per tree size: match (a cached sequence, full hit), insert (a new suffix under a cached history), evict (one
   LRU leaf); the key-length distribution is the same at every size, so flat columns mean the cost does not grow
   with the tree;
2. match time against key length at the largest tree size;
3. the prefix-comparison routine the tree uses against a Python loop and NumPy, on lists of token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from itertools import compress, count
from operator import ne

import numpy as np
import torch

from radixserve.radix_cache.pool import KVAllocator, ReqToTokenPool
from radixserve.radix_cache.keys import common_prefix_length
from radixserve.radix_cache.tree import RadixCache

VOCAB_SIZE = 49152
# One int object per token id, shared by every list (as a tokenizer's cache would), so memory is 8 bytes a token.
VOCAB = list(range(VOCAB_SIZE))
NUM_SYSTEM_PROMPTS = 16
HISTORIES_PER_PROMPT = 64


class Workload:
    """Sequence k = system[k's prompt] + history[k's history] + suffix(k); suffixes are regenerated from k."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.seed = seed
        self.systems = [self._tokens(rng, rng.integers(512, 1025)) for _ in range(NUM_SYSTEM_PROMPTS)]
        self.histories = [
            [self._tokens(rng, rng.integers(256, 2561)) for _ in range(HISTORIES_PER_PROMPT)]
            for _ in range(NUM_SYSTEM_PROMPTS)
        ]

    @staticmethod
    def _tokens(rng: np.random.Generator, length: int) -> list[int]:
        return [VOCAB[token] for token in rng.integers(0, VOCAB_SIZE, int(length)).tolist()]

    def sequence(self, k: int) -> list[int]:
        rng = np.random.default_rng((self.seed, k))
        system = int(rng.integers(NUM_SYSTEM_PROMPTS))
        history = int(rng.integers(HISTORIES_PER_PROMPT))
        return self.systems[system] + self.histories[system][history] + self._tokens(rng, rng.integers(16, 513))

    def max_unique_tokens(self, num_sequences: int) -> int:
        shared = sum(map(len, self.systems)) + sum(len(h) for hs in self.histories for h in hs)
        return shared + 512 * num_sequences


# CPU time of this process, not wall time: the benchmark machine is shared, and time spent descheduled is not
# the cache's cost. Batches and the minimum over them absorb what noise remains (it only ever adds time).
clock = time.process_time
BATCHES = 10


def best_batch_mean_us(seconds: list[float], batches: int = BATCHES) -> float:
    """Mean microseconds of the fastest of `batches` consecutive batches of measurements."""
    size = max(1, len(seconds) // batches)
    return min(sum(seconds[i:i + size]) / size for i in range(0, len(seconds) - size + 1, size)) * 1e6


def timed(fn, items, batches: int = BATCHES) -> float:
    """Microseconds per call of fn(item): the items run in `batches` consecutive batches; the fastest batch's
    mean is reported."""
    size = max(1, len(items) // batches)
    best = float("inf")
    for first in range(0, len(items) - size + 1, size):
        start = clock()
        for item in items[first:first + size]:
            fn(item)
        best = min(best, (clock() - start) / size)
    return best * 1e6


def cache_with(workload: Workload, num_sequences: int, extra: int, page_size: int) -> tuple[RadixCache, float]:
    """A cache holding sequences 0..num_sequences-1, inserted the way a scheduler does (match, allocate the
    rest, insert); returns it and the build time in seconds."""
    capacity = workload.max_unique_tokens(num_sequences + extra) + page_size
    allocator = KVAllocator(capacity - capacity % page_size + page_size, page_size)
    cache = RadixCache(ReqToTokenPool(1, 1), allocator, page_size)
    start = time.perf_counter()
    for k in range(num_sequences):
        insert_new(cache, workload.sequence(k))
    return cache, time.perf_counter() - start


def path_nodes(node) -> int:
    """Nodes on the path from the namespace root to `node`: the work of a match, in dict lookups."""
    depth = 0
    while node.key:
        depth, node = depth + 1, node.parent
    return depth


def insert_new(cache: RadixCache, tokens: list[int]) -> None:
    prefix = cache.match_prefix(tokens).indices
    new_slots = cache.allocator.alloc(len(tokens) - len(prefix))
    cache.insert(tokens, torch.cat([prefix, new_slots]))


def bench_tree_sizes(workload: Workload, sizes: list[int], num_ops: int, page_size: int) -> tuple[list[dict], RadixCache]:
    rows, cache = [], None
    for num_sequences in sizes:
        cache = None  # let the previous tree go before building the next one
        cache, build_seconds = cache_with(workload, num_sequences, num_ops, page_size)
        rng = random.Random(num_sequences)
        queries = [workload.sequence(rng.randrange(num_sequences)) for _ in range(num_ops)]
        match_us = timed(cache.match_prefix, queries)
        nodes_per_match = sum(path_nodes(cache.match_prefix(query).last_node) for query in queries) / len(queries)
        # Inserts: new sequences; their system prompt and history are cached, their suffix is new. Timed without
        # the allocation, which is the allocator's cost, not the tree's.
        new_sequences = [workload.sequence(num_sequences + i) for i in range(num_ops)]
        slots = []
        for tokens in new_sequences:
            prefix = cache.match_prefix(tokens).indices
            slots.append(torch.cat([prefix, cache.allocator.alloc(len(tokens) - len(prefix))]))
        pairs = list(zip(new_sequences, slots))
        insert_us = timed(lambda pair: cache.insert(*pair), pairs)
        # Evictions, as under memory pressure: memory is full, each call frees the least recently used leaf (a
        # suffix) and the freed room is taken at once (untimed), so the allocator's free list stays short.
        allocator = cache.allocator
        held = [allocator.alloc(allocator.available_size())]

        def evict_one_leaf() -> float:
            start = clock()
            cache.evict(1)
            elapsed = clock() - start
            held.append(allocator.alloc(allocator.available_size()))
            return elapsed

        evict_us = best_batch_mean_us([evict_one_leaf() for _ in range(num_ops)])
        allocator.free(torch.cat(held))
        rows.append({
            "cached_sequences": num_sequences,
            "tree_tokens": cache.total_size(),
            "build_seconds": round(build_seconds, 2),
            "mean_query_tokens": round(sum(map(len, queries)) / len(queries)),
            "nodes_per_match": round(nodes_per_match, 2),
            "match_us": round(match_us, 1),
            "match_us_per_1k_tokens": round(match_us * 1000 / (sum(map(len, queries)) / len(queries)), 2),
            "insert_us": round(insert_us, 1),
            "evict_us": round(evict_us, 1),
        })
        print_row(rows[-1])
    return rows, cache


def bench_key_length(cache: RadixCache, workload: Workload, num_sequences: int, num_ops: int) -> list[dict]:
    """Match time against key length in one tree: prefixes of the longest cached sequences, all full hits."""
    candidates = [workload.sequence(k) for k in random.Random(1).sample(range(num_sequences), min(num_sequences, 2000))]
    longest = sorted(candidates, key=len)[-50:]
    for tokens in longest:  # cached again if an eviction benchmark took their suffixes
        insert_new(cache, tokens)
    rows = []
    for length in (128, 256, 512, 1024, 2048, 3072, 4096):
        if length > len(longest[0]):
            length = len(longest[0])
        queries = [seq[:length] for seq in longest]
        assert all(cache.match_prefix(query).length == length for query in queries), "benchmark keys must be cached"
        queries = (queries * (num_ops // len(queries) + 1))[:num_ops]
        rows.append({"key_tokens": length, "match_us": round(timed(cache.match_prefix, queries), 1)})
        if length == len(longest[0]):
            break
    return rows


def loop_prefix_length(key: list, query: list, start: int, end: int) -> int:
    length = 0
    for a, b in zip(key, query[start:end]):
        if a != b:
            break
        length += 1
    return length


def itertools_prefix_length(key: list, query: list, start: int, end: int) -> int:
    return next(compress(count(), map(ne, key, query[start:end])), min(len(key), end - start))


def numpy_prefix_length(key: list, query: list, start: int, end: int) -> int:
    n = min(len(key), end - start)
    mismatches = np.flatnonzero(np.asarray(key[:n]) != np.asarray(query[start:start + n]))
    return int(mismatches[0]) if len(mismatches) else n


def bench_prefix_routines(num_ops: int) -> list[dict]:
    routines = {
        "slice_gallop (used)": common_prefix_length,
        "python_loop": loop_prefix_length,
        "itertools_map_ne": itertools_prefix_length,
        "numpy": numpy_prefix_length,
    }
    rng = random.Random(0)
    rows = []
    for length in (16, 256, 4096):
        key = [VOCAB[rng.randrange(VOCAB_SIZE)] for _ in range(length)]
        for mismatch_at in (length, length // 2):
            query = list(key)
            if mismatch_at < length:
                query[mismatch_at] = -1
            row = {"key_tokens": length, "common_prefix": mismatch_at}
            for name, routine in routines.items():
                assert routine(key, query, 0, len(query)) == mismatch_at
                row[name] = round(timed(lambda _: routine(key, query, 0, len(query)), range(num_ops)), 2)
            rows.append(row)
    return rows


def print_row(row: dict) -> None:
    print("  " + "  ".join(f"{key}={value}" for key, value in row.items()), flush=True)


def markdown_table(rows: list[dict]) -> str:
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(row[key]) for key in header) + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--ops", type=int, default=2000, help="timed operations of each kind per tree size")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()

    workload = Workload(args.seed)
    print(f"radix cache, page_size={args.page_size}: per tree size")
    size_rows, largest = bench_tree_sizes(workload, args.sizes, args.ops, args.page_size)
    print(f"match time vs key length, tree of {args.sizes[-1]} sequences")
    length_rows = bench_key_length(largest, workload, args.sizes[-1], args.ops)
    for row in length_rows:
        print_row(row)
    print("prefix-length routines, microseconds per call")
    routine_rows = bench_prefix_routines(args.ops)
    for row in routine_rows:
        print_row(row)

    record = {
        "benchmark": "radix_cache",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                    "cpu_count": os.cpu_count()},
        "args": vars(args),
        "tree_sizes": size_rows,
        "key_length": length_rows,
        "prefix_routines": routine_rows,
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"radix_cache_{time.strftime('%Y%m%d_%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print("\n" + markdown_table(size_rows) + "\n\n" + markdown_table(length_rows) + "\n\n" + markdown_table(routine_rows))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
