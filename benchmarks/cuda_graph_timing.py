"""Device time of calls captured in one CUDA graph, for the GPU benchmarks of benchmarks/ (GPU host only)."""

from __future__ import annotations

import statistics


def time_graph(calls: list, repeats: int) -> float:
    """Device time per call, in microseconds, of `calls` (zero-argument functions) captured in one CUDA graph and
    replayed: the median over `repeats` replays, divided by the number of calls."""
    import torch

    for call in calls:  # compiles outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / len(calls))
    return statistics.median(times)
