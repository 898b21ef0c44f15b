"""Comparing token keys: the one primitive every walk of the radix tree (match, insert, summaries, drafts) uses."""

from __future__ import annotations


def common_prefix_length(key: list, query: list, start: int, end: int) -> int:
    """Length of the longest common prefix of `key` and `query[start:end]`.

    List slices compare in C at a few nanoseconds per element, while a Python loop costs tens; so the common case
    (the whole key matches) is one slice comparison, and a mismatch is located by galloping then bisecting with
    slice comparisons, touching O(mismatch position) elements. See benchmarks/radix_cache_bench.py for timings.
    """
    n = min(len(key), end - start)
    if n == len(key):
        if query[start:start + n] == key:
            return n
    elif key[:n] == query[start:start + n]:
        return n
    # A mismatch lies in [0, n). Gallop to a window [lo, hi) that contains it, key[:lo] matching.
    lo, step = 0, 8
    while True:
        hi = min(lo + step, n)
        if key[lo:hi] != query[start + lo:start + hi]:
            break
        lo, step = hi, step * 2
    while hi - lo > 8:
        mid = (lo + hi) // 2
        if key[lo:mid] == query[start + lo:start + mid]:
            lo = mid
        else:
            hi = mid
    for i in range(lo, hi):
        if key[i] != query[start + i]:
            return i
    return hi
