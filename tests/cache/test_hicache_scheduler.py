"""The hierarchical cache under a real Scheduler and the embedded model (SmolLM2-135M, float32, CPU, greedy).

Multi-turn conversations come back to prefixes that a KV pool far smaller than their working set has evicted;
with the tier on those prefixes are demoted to the host (or disk) and loaded back before the next turn's extend,
which then runs in chunks from wherever the loaded prefix ended. Every run must give exactly the tokens of the
run with the tier off, with the invariants of both tiers checked after every scheduler step (scheduler_driver).
"""

from __future__ import annotations

import argparse
import random

import pytest

from radixserve.runtime.wire.server_args import ServerArgs
from scheduler_driver import SchedulerDriver

POOL_TOKENS = 256
CHUNK = 32
NUM_CONVERSATIONS = 3
NUM_TURNS = 3
MAX_NEW_TOKENS = 5


def conversation_rounds(vocab: int) -> list[list[tuple[str, list[int]]]]:
    """Per turn, each conversation's new user tokens: a shared system prompt, then private turns."""
    rng = random.Random(23)
    system = [rng.randrange(vocab) for _ in range(40)]
    rounds = []
    for turn in range(NUM_TURNS):
        lengths = [rng.randrange(40, 70) for _ in range(NUM_CONVERSATIONS)]
        rounds.append([(f"c{c}", ([*system] if turn == 0 else []) + [rng.randrange(vocab) for _ in range(n)])
                       for c, n in enumerate(lengths)])
    return rounds


def run_conversations(model_dir: str, vocab: int, **server_args) -> tuple[dict[str, list[int]], dict]:
    """Every turn of every conversation (turn t of all of them submitted together); returns each request's
    output and the final server info."""
    driver = SchedulerDriver(model_dir, max_total_tokens=POOL_TOKENS, chunked_prefill_size=CHUNK,
                             max_running_requests=4, **server_args)
    histories: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    for turn, new_tokens in enumerate(conversation_rounds(vocab)):
        for conv, tokens in new_tokens:
            histories[conv] = histories.get(conv, []) + tokens
            driver.submit(f"{conv}-t{turn}", histories[conv], max_new_tokens=MAX_NEW_TOKENS)
        results = driver.run_until_idle()
        for conv, _ in new_tokens:
            outputs[f"{conv}-t{turn}"] = results[f"{conv}-t{turn}"].output_ids
            histories[conv] += results[f"{conv}-t{turn}"].output_ids
    info = driver.server_info()
    driver.close()
    return outputs, info


@pytest.fixture(scope="module")
def vocab(default_model_dir) -> int:
    import json
    import os

    with open(os.path.join(default_model_dir, "config.json")) as f:
        return json.load(f)["vocab_size"]


@pytest.fixture(scope="module")
def tier_off(default_model_dir, vocab):
    return run_conversations(default_model_dir, vocab, disable_overlap_schedule=False)


@pytest.mark.slow
@pytest.mark.parametrize("config", [
    dict(hicache_write_policy="write_through", disable_overlap_schedule=True),
    dict(hicache_write_policy="write_back"),
    dict(hicache_ratio=0.5, use_disk=True),
], ids=["write_through", "write_back-overlap", "small-host-disk-overlap"])
def test_same_outputs_with_prefixes_loaded_back(config, default_model_dir, vocab, tier_off, tmp_path):
    config = dict(config)
    if config.pop("use_disk", False):
        config["hicache_storage_dir"] = str(tmp_path)
    config.setdefault("disable_overlap_schedule", False)
    expected, info_off = tier_off
    outputs, info = run_conversations(default_model_dir, vocab, enable_hierarchical_cache=True, **config)
    assert outputs == expected
    hicache, memory = info["cache"]["hicache"], info["memory"]
    # The later turns found their history in a lower tier and loaded it back.
    assert hicache["loaded_from_host_tokens"] + hicache["loaded_from_disk_tokens"] > 0
    if "hicache_storage_dir" in config:
        assert hicache["written_to_disk_tokens"] > 0 and hicache["loaded_from_disk_tokens"] > 0
    assert info["cache"]["hit_rate"] > info_off["cache"]["hit_rate"]
    assert memory["host_total_tokens"] == memory["host_free_tokens"] + memory["host_used_tokens"] > 0
    assert memory["total_tokens"] == memory["free_tokens"] + memory["evictable_tokens"]


def test_server_args_flags(tmp_path):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args([
        "--enable-hierarchical-cache", "--hicache-size", "0.5", "--hicache-write-policy", "write_back",
        "--hicache-storage-dir", str(tmp_path), "--hicache-ratio", "3",
    ]))
    assert (args.enable_hierarchical_cache, args.hicache_size, args.hicache_write_policy) == (True, 0.5, "write_back")
    assert (args.hicache_storage_dir, args.hicache_ratio) == (str(tmp_path), 3.0)
    with pytest.raises(ValueError, match="hicache_write_policy"):
        ServerArgs(enable_hierarchical_cache=True, hicache_write_policy="write_through_selective")
    with pytest.raises(ValueError, match="radix cache"):
        ServerArgs(enable_hierarchical_cache=True, disable_radix_cache=True)
    with pytest.raises(ValueError, match="need enable_hierarchical_cache"):
        ServerArgs(hicache_storage_dir=str(tmp_path))
    with pytest.raises(ValueError, match="hicache_ratio"):
        ServerArgs(enable_hierarchical_cache=True, hicache_ratio=0)


def test_host_tier_sized_by_gigabytes(default_model_dir):
    """`hicache_size` GB overrides `hicache_ratio`; the host figures appear in the server info."""
    driver = SchedulerDriver(default_model_dir, max_total_tokens=POOL_TOKENS, enable_hierarchical_cache=True,
                             hicache_size=0.01)
    memory = driver.server_info()["memory"]
    assert memory["host_total_tokens"] == int(0.01 * 1e9) // memory["host_bytes_per_token"]
    assert memory["host_free_tokens"] == memory["host_total_tokens"] and memory["host_used_tokens"] == 0
    driver.close()
