"""`benchmarks/tune_w4a16.py` runs end to end without a GPU (the Triton interpreter, wall-clock timing) on a tiny
shape: every candidate is checked against the dequantized product, the record names a best config per case, and the
rows to paste into the kernels' tables print in the tables' own types."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script times the full search; run it by hand")
def test_tune_w4a16_checks_candidates_and_prints_table_rows(tmp_path):
    out = tmp_path / "tune.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tune_w4a16.py"), "--shapes", "64x256", "--rows", "1,3",
         "--formats", "w4a16,fp8_block,w16", "--space", "small", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads(out.read_text())
    cases = [(row["format"], row["m"]) for row in record["rows"]]
    assert cases == [("w4a16", 1), ("w4a16", 3), ("fp8_block", 1), ("fp8_block", 3), ("w16", 1), ("w16", 3)]
    for row in record["rows"]:
        assert row["failed"] == [] and row["tried"] >= 2 and row["best_us"] <= row["default_us"]
        assert row["best"][3] in (False, True) and len(row["best"]) == 6
    assert "TUNED_SKINNY[(64, 256, 128)] = [(1, SkinnyConfig(" in result.stdout
    assert "TUNED[(64, 256, (128, 128))] = [(1, SkinnyConfig(" in result.stdout
    assert "TUNED_16BIT[(64, 256)] = [(1, SkinnyConfig(" in result.stdout
