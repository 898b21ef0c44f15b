"""The serving benchmark (benchmarks/serving.py) against a real radixserve server on the embedded model.

Tiny workloads: the command line writes a complete JSON record with no failed request; the server's cache hit
rate on a shared-prefix workload is above zero and agrees with the cached-token counts the responses report;
outputs have their planned lengths (ignore_eos); a closed loop never has more requests in flight than allowed;
multi-turn prompts extend the previous prompt and answer; the plot command draws a PNG from records.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys

import pytest

from http_fixtures import KEY_A, shared_server

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

from serving_client import Target, run_sessions  # noqa: E402
from serving_datasets import multi_turn_sessions, random_sessions, shared_prefix_sessions  # noqa: E402

pytestmark = pytest.mark.timeout(300)

RECORD_FIELDS = {
    "command", "kind", "timestamp", "label", "backend", "base_url", "dataset", "arrival", "num_requests",
    "completed", "failed", "short_outputs", "duration_s", "total_input_tokens", "total_output_tokens",
    "reported_cached_tokens", "request_throughput", "input_throughput", "output_throughput", "total_throughput",
    "ttft_ms", "itl_ms", "tpot_ms", "e2e_latency_ms", "errors", "cache_hit_rate", "cache_counters", "server",
    "environment",
}
DISTRIBUTION_FIELDS = {"mean", "median", "p90", "p95", "p99"}


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from radixserve.runtime.model_files import load_tokenizer

    return load_tokenizer(default_model_dir)


def _run(target: Target, sessions, **kwargs):
    return asyncio.run(run_sessions(target, sessions, progress=False, **kwargs))


def test_datasets_follow_their_shapes(tokenizer):
    sessions = random_sessions(tokenizer, 40, input_len=20, output_len=10, range_ratio=0.5, seed=3)
    assert all(10 <= len(s.turns[0].new_ids) <= 20 and 5 <= s.turns[0].output_len <= 10 for s in sessions)
    assert len({len(s.turns[0].new_ids) for s in sessions}) > 1  # lengths really vary
    special = set(tokenizer.all_special_ids)
    assert not any(special & set(s.turns[0].new_ids) for s in sessions)
    again = random_sessions(tokenizer, 40, input_len=20, output_len=10, range_ratio=0.5, seed=3)
    assert [s.turns[0].new_ids for s in again] == [s.turns[0].new_ids for s in sessions]

    shared = shared_prefix_sessions(tokenizer, num_groups=3, prompts_per_group=4, system_len=16, question_len=5,
                                    output_len=7, seed=3)
    prompts = [s.turns[0].new_ids for s in shared]
    assert len(prompts) == 12 and all(len(p) == 21 for p in prompts)
    groups = {}
    for prompt in prompts:
        groups.setdefault(tuple(prompt[:16]), []).append(prompt)
    assert sorted(len(g) for g in groups.values()) == [4, 4, 4]
    assert [tuple(p[:16]) for p in prompts] != sorted(tuple(p[:16]) for p in prompts)  # shuffled, not grouped
    assert all(s.turns[0].new_text.startswith(tokenizer.decode(s.turns[0].new_ids[:16])) for s in shared)


def test_cli_shared_prefix_record(server, default_model_dir, tmp_path):
    """The real command line, closed loop: a complete record, nothing failed, and a cache hit rate > 0 that is
    the share of prompt tokens the responses say were cached."""
    output = tmp_path / "gsp.json"
    # The administrator's key: the record reads the server-wide counters of /get_server_info.
    command = [sys.executable, os.path.join(BENCHMARKS, "serving.py"), "--base-url", server.url,
               "--api-key", server.admin_key,
               "--tokenizer", default_model_dir, "--dataset", "generated-shared-prefix", "--gsp-num-groups", "2",
               "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "48", "--gsp-question-len", "8",
               "--gsp-output-len", "4", "--max-concurrency", "2", "--seed", "11", "--disable-tqdm",
               "--output-details", "--output-file", str(output)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "closed loop, 2 requests in flight" in completed.stdout
    assert "Server cache hit rate:" in completed.stdout
    record = json.loads(output.read_text())
    assert RECORD_FIELDS <= set(record)
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_latency_ms"):
        assert set(record[key]) == DISTRIBUTION_FIELDS
        assert 0 < record[key]["median"] <= record[key]["p99"]
    assert record["arrival"] == {"loop": "closed", "label": "closed loop, 2 requests in flight",
                                 "max_concurrency": 2, "request_rate": "inf"}
    assert record["dataset"]["name"] == "generated-shared-prefix" and record["dataset"]["num_groups"] == 2
    assert (record["num_requests"], record["completed"], record["failed"]) == (6, 6, 0)
    assert record["total_input_tokens"] == 6 * (48 + 8) and record["total_output_tokens"] == 6 * 4
    assert record["short_outputs"] == 0 and record["errors"] == []
    assert record["e2e_latency_ms"]["mean"] > record["ttft_ms"]["mean"]
    assert math.isclose(record["output_throughput"], 24 / record["duration_s"])
    # --output-details: one entry per request, its gaps those the ITL distribution was made of.
    details = record["details"]
    assert len(details) == 6 and min(d["start_s"] for d in details) == 0
    # A chunk per token, except where the server had two or more tokens of a stream waiting when it wrote (a busy
    # machine): then one chunk carries them, as SGLang's streams do, and the stream has fewer gaps.
    assert all(d["output_len"] == 4 and len(d["itl_ms"]) <= 3 and d["error"] == "" for d in details)
    gaps = [g for d in details for g in d["itl_ms"]]
    assert len(gaps) >= 12, [len(d["itl_ms"]) for d in details]
    assert sum(gaps) / len(gaps) == pytest.approx(record["itl_ms"]["mean"], abs=0.01)
    # The timeline reads the details back: 6 streams, each a chunk more than its gaps (18 gaps, 24 chunks, when every
    # token came alone).
    timeline = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "serving_timeline.py"), str(output)],
                              capture_output=True, text=True, timeout=60)
    assert timeline.returncode == 0, timeline.stderr
    assert timeline.stdout.startswith(f"gaps {len(gaps)}: median")
    assert sum(int(line.split()[1]) for line in timeline.stdout.splitlines()
               if line[:6].strip().replace(".", "").isdigit()) == len(gaps) + 6
    # Nothing else ran meanwhile, so the server's counters equal the per-response counts.
    assert record["cache_hit_rate"] > 0
    assert record["cache_hit_rate"] == pytest.approx(record["reported_cached_tokens"] / record["total_input_tokens"])
    assert record["server"]["radix_cache"] is True

    plot = tmp_path / "latency.png"
    subprocess.run([sys.executable, os.path.join(BENCHMARKS, "serving.py"), "plot", str(output), str(output),
                    "-o", str(plot)], check=True, capture_output=True, timeout=120)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_openai_backend_random_lengths_and_closed_loop_cap(server, tokenizer):
    """Text prompts through /v1/completions: every output has its planned length; at most 2 requests overlap."""
    target = Target("openai", server.url, api_key=KEY_A)
    sessions = random_sessions(tokenizer, 5, input_len=24, output_len=6, range_ratio=0.5, seed=5)
    results, duration = _run(target, sessions, max_concurrency=2)
    assert [r.error for r in results] == [""] * 5
    assert sorted(r.output_len for r in results) == sorted(s.turns[0].output_len for s in sessions)
    assert all(r.prompt_len > 0 and 0 < r.ttft < r.latency <= duration for r in results)
    intervals = [(r.start, r.start + r.latency) for r in results]
    for start, _ in intervals:
        assert sum(s <= start < e for s, e in intervals) <= 2


def test_multi_turn_prompts_extend_previous_turn(server, tokenizer):
    """Turn k's prompt is turn k-1's prompt + its answer + new user tokens, and the server finds that history
    in its cache (all but at most the last answer token, whose KV is never computed)."""
    target = Target("radixserve", server.url, api_key=KEY_A)
    sessions = multi_turn_sessions(tokenizer, 1, num_turns=3, first_len=20, user_len=6, output_len=5, seed=9)
    results, _ = _run(target, sessions)
    assert [r.error for r in results] == [""] * 3
    assert [r.output_len for r in results] == [5, 5, 5]
    assert [r.prompt_len for r in results] == [20, 20 + 5 + 6, 20 + 5 + 6 + 5 + 6]
    assert sessions[0].history_ids[:20] == sessions[0].turns[0].new_ids
    assert sessions[0].history_ids[20:25] == results[0].output_ids
    for previous, turn in zip(results, results[1:]):
        assert turn.cached_tokens >= previous.prompt_len + previous.output_len - 1
