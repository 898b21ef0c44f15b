"""Tensor-parallel scaling: step times of TP=1 against TP=N for one model, with the collectives' share.

    python benchmarks/tp_scaling.py --tp-sizes 1,3                      # the embedded model on the CPU (gloo)
    python benchmarks/tp_scaling.py --model-path DIR --device cuda --tp-sizes 1,2 --dtype bfloat16

For each TP size it spawns that many ranks (a real process group: gloo on the CPU, NCCL on CUDA); each rank
builds its sharded ModelRunner and runs `--batch-size` random prompts of `--input-len` tokens through one
batched prefill and `--decode-steps` decode steps (static_generate.greedy_generate). Reported per TP size:
the prefill step and the mean decode step (wall clock, rank 0, median of `--repeats`), and the share of those
times spent inside the model's collectives (all-reduce after o_proj and down_proj and in the embedding, the
all-gather of the logits), timed around each collective call on rank 0. On CUDA the collectives are timed
with a device synchronisation around each call, which serialises the step: read the share, not the time.
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import time

import _srcpath  # noqa: F401  (makes the source tree importable when run from a checkout)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank_main(rank: int, tp_size: int, addr: str, args: argparse.Namespace, results) -> None:
    import torch

    from radixserve.model_runner.model_runner import ModelRunner
    from radixserve.model_runner.runner_config import RunnerConfig
    from radixserve.model_runner.parallel import TPGroup
    from radixserve.model_runner.static_generate import greedy_generate
    from radixserve.runtime.wire.server_args import ServerArgs

    server_args = ServerArgs(model_path=args.model_path, device=args.device, dtype=args.dtype,
                             max_total_tokens=args.batch_size * (args.input_len + args.decode_steps + 8),
                             max_running_requests=args.batch_size, tp_size=tp_size, dist_init_addr=addr,
                             disable_cuda_graph=True)
    runner = ModelRunner(RunnerConfig.from_server_args(server_args), tp_rank=rank)
    timer = _TimedGroup(runner.tp, runner.device)
    for module in runner.model.modules():  # route every collective of the model through the timer
        if isinstance(getattr(module, "tp", None), TPGroup):
            module.tp = timer
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, runner.vocab_size, (args.input_len,), generator=generator).tolist()
               for _ in range(args.batch_size)]
    prefill, decode, prefill_share, decode_share = [], [], [], []
    for _ in range(args.repeats + 1):  # the first round warms up
        timer.seconds = 0.0
        start = time.perf_counter()
        greedy_generate(runner, prompts, 1)
        prefill_s, prefill_comm = time.perf_counter() - start, timer.seconds
        timer.seconds = 0.0
        start = time.perf_counter()
        greedy_generate(runner, prompts, args.decode_steps + 1)
        total_s, total_comm = time.perf_counter() - start, timer.seconds
        decode_s = max(total_s - prefill_s, 0.0) / args.decode_steps
        prefill.append(prefill_s)
        decode.append(decode_s)
        prefill_share.append(prefill_comm / prefill_s)
        decode_share.append(max(total_comm - prefill_comm, 0.0) / max(total_s - prefill_s, 1e-9))
    if rank == 0:
        results.put({name: statistics.median(values[1:]) for name, values in
                     (("prefill_s", prefill), ("decode_step_s", decode), ("prefill_comm_share", prefill_share),
                      ("decode_comm_share", decode_share))})


class _TimedGroup:
    """A TPGroup whose collectives add their wall time to `seconds`."""

    def __init__(self, group, device) -> None:
        self.group, self.device, self.seconds = group, device, 0.0
        self.rank, self.size = group.rank, group.size

    def _timed(self, fn, x):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        out = fn(x)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds += time.perf_counter() - start
        return out

    def all_reduce(self, x):
        return self._timed(self.group.all_reduce, x)

    def all_gather_last(self, x):
        return self._timed(self.group.all_gather_last, x)


def run(tp_size: int, args: argparse.Namespace) -> dict:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    addr = f"127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(r, tp_size, addr, args, results)) for r in range(tp_size)]
    for p in procs:
        p.start()
    try:
        return results.get(timeout=args.timeout)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="default: the embedded model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tp-sizes", default="1,3")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    print(f"{'tp':>3} {'prefill ms':>11} {'comm %':>7} {'decode step ms':>15} {'comm %':>7}")
    for tp_size in (int(t) for t in args.tp_sizes.split(",")):
        r = run(tp_size, args)
        print(f"{tp_size:>3} {r['prefill_s'] * 1e3:>11.1f} {r['prefill_comm_share'] * 100:>6.1f}% "
              f"{r['decode_step_s'] * 1e3:>15.2f} {r['decode_comm_share'] * 100:>6.1f}%", flush=True)


if __name__ == "__main__":
    main()
