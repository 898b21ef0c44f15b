"""`benchmarks/embeddings.py` runs end to end on the CPU: a tiny random Qwen3 of a registered shape (the path of the
GPU run's Qwen3-Embedding-0.6B shape), timed against sentence-transformers, the two agreeing on every embedding.
Skipped where sentence-transformers (the baseline, not a dependency) is not installed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("sentence_transformers")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import embeddings  # noqa: E402

TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=50000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)


@pytest.mark.slow
def test_embeddings_benchmark_runs_and_agrees_with_sentence_transformers(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(embeddings.SHAPES, "tiny", TINY_SHAPE)
    out = tmp_path / "record.json"
    monkeypatch.setattr(sys, "argv", ["embeddings.py", "--shape", "tiny", "--num-inputs", "12", "--input-len", "24",
                                      "--batch-size", "4", "--repeats", "1", "--json", str(out)])
    embeddings.main()
    record = json.loads(out.read_text())
    assert [row["system"] for row in record["rows"]] == ["radixserve Engine.encode", "sentence-transformers"]
    assert record["num_inputs"] == 12 and all(row["embeddings_per_s"] > 0 for row in record["rows"])
    assert record["max_cosine_distance"] < 1e-5
    assert "speed-up" in capsys.readouterr().out
