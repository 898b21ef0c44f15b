"""The serving profile tools of benchmarks/: the py-spy stack split and the in-process serving replay."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import scheduler_stack_split  # noqa: E402

LOOP = "<module> (<string>:1);run_scheduler_process (scheduler/process.py:98);serve (scheduler/process.py:146)"
STEP = LOOP + ";Scheduler.step (scheduler/scheduler.py:124);BatchExecutor.enqueue (scheduler/overlap.py:139)"
FORWARD = STEP + ";ModelRunner.forward (model_runner/model_runner.py:118);LlamaModel.forward (models/llama.py:150)"


def test_stack_split_counts_loop_parts_and_layer_kinds():
    lines = [
        # o_proj inside the attention module: a linear layer, not attention
        f"{FORWARD};LlamaAttention.forward (models/llama.py:85);RowParallelLinear.forward (layers.py:60) 5\n",
        f"{FORWARD};LlamaAttention.forward (models/llama.py:84);CpuAttentionBackend.forward (cpu_backend.py:89) 3\n",
        f"{FORWARD};RMSNorm.forward (layers.py:97) 2\n",
        f"{STEP};Sampler.sample (model_runner/sampling.py:243) 4\n",
        f"{LOOP};Poller.poll (zmq/sugar/poll.py:106) 1\n",
        "<module> (<string>:1);_watch_parent.<locals>.watch (scheduler/process.py:160) 5\n",
        "\n",
    ]
    total, loop, forward = scheduler_stack_split.split(lines)
    assert total == 20
    assert loop == {"model forward": 10, "sampling": 4, "waiting for work": 1, "other threads": 5}
    assert forward == {"linear layers": 5, "attention": 3, "RMSNorm, rotary, SiLU-and-mul": 2}


@pytest.mark.slow
def test_serving_replay_runs_every_request_to_the_end():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cpu_serving_profile.py"), "--dtype", "float32", "--rate", "50",
         "--num-prompts", "4", "--input-len", "16", "--output-len", "4", "--server-arg", "chunked_prefill_size=32"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "server args {'chunked_prefill_size': 32}" in out.stdout
    assert "EXTEND" in out.stdout and "DECODE" in out.stdout
    assert "TTFT median / p99" in out.stdout
    assert "attention (the backend's forward, all layers) by mode: DECODE" in out.stdout


def test_decode_profile_timers_count_each_part_and_restore_what_they_wrapped():
    import types

    import cpu_decode_profile

    class Part:
        def forward(self, x):
            return x + 1

    module = types.SimpleNamespace(act=lambda x: x * 2)
    part, other, plain_forward, plain_act = Part(), Part(), Part.forward, module.act
    timers = cpu_decode_profile.PartTimers()
    timers.wrap(part, "forward", "linears")  # an instance whose method is its class's
    timers.wrap(module, "act", "silu_mul")  # a module-level function
    timers.wrap(Part, "forward", "rotary")  # a class's method: every other instance
    assert part.forward(1) == 2 and module.act(3) == 6
    assert set(timers.seconds) == {"linears", "silu_mul"}
    assert other.forward(1) == 2 and set(timers.seconds) == {"linears", "silu_mul", "rotary"}
    assert all(seconds > 0 for seconds in timers.seconds.values())
    timers.restore()
    assert "forward" not in vars(part) and Part.forward is plain_forward and module.act is plain_act


def test_decode_profile_splits_a_step_of_the_int8_blocks(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cpu_decode_profile.py"), "--mode", "gguf-int8", "--input-len", "16",
         "--output-len", "6", "--out", str(tmp_path / "profile.json")],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "gguf-int8, 16 in / 6 out" in out.stdout and "LM head (logits)" in out.stdout
    import json

    record = json.loads((tmp_path / "profile.json").read_text())
    parts = record["parts_ms"]
    assert all(parts[name] > 0 for name in ("linears", "lm_head", "attention", "norms", "rotary", "sampling"))
    assert sum(v for k, v in parts.items() if k != "sampling") <= record["forward_ms"] * 1.05
