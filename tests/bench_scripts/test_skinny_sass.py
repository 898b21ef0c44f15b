"""`benchmarks/skinny_sass.py` compiles the skinny FMA kernels for sm_90 on this host (no GPU) and reads their K loop
from the SASS: the record holds, per kernel and tile, a loop of FMAs with the registers a thread uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_skinny_sass_reads_each_kernels_loop(tmp_path):
    out = tmp_path / "sass.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "skinny_sass.py"), "--kinds", "w4a16,fp8,bf16", "--configs",
         "32x128x4", "--out", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["arch"] == 90 and [row["kernel"] for row in record["rows"]] == ["w4a16", "fp8", "bf16"]
    for row in record["rows"]:
        # A thread holds 32 weights of the 32 x 128 tile an iteration: one FMA each, and more instructions than that.
        assert row["opcodes"].get("FFMA", 0) + row["opcodes"].get("FMUL", 0) >= 32, row
        assert 1.0 < row["instructions_per_weight"] < 50.0 and 16 <= row["registers"] <= 255, row
    w4a16 = record["rows"][0]["opcodes"]
    assert w4a16.get("LOP3", 0) >= 16, w4a16  # the nibbles' masks: at least one logic op per two of 32 weights
