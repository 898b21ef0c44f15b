"""A generated-shared-prefix workload (benchmarks/serving_datasets.py) sent to a live server for the cache page
tests, in a namespace of its own (a fresh `cache_salt`) so other tests' traffic on the shared server never
changes what these tests expect to see."""

from __future__ import annotations

import os
import sys
import uuid
from dataclasses import dataclass

import httpx

from radixserve.runtime.wire.cache_tree import namespace_name

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from serving import load_tokenizer_for  # noqa: E402
from serving_datasets import shared_prefix_sessions  # noqa: E402

GROUPS, PER_GROUP, SYSTEM_LEN, QUESTION_LEN, OUTPUT_LEN = 4, 3, 96, 16, 4


@dataclass
class Workload:
    tenant: str  # "alpha"
    salt: str
    prompts: list[list[int]]
    rids: list[str]

    @property
    def namespace(self) -> str:
        """The namespace's name as /cache/tree and /get_server_info write it (the salt only as a digest)."""
        return namespace_name((f"tenant:{self.tenant}", f"salt:{self.salt}"))

    @property
    def expected_top_level(self) -> int:
        """Children of the namespace root: one per distinct first token (the tree keys children by it)."""
        return len({prompt[0] for prompt in self.prompts})


_sent: dict[tuple[str, str], Workload] = {}


def shared_prefix_workload(url: str, key: str, tenant: str) -> Workload:
    """The workload of this test session on the server at `url` for `key`, sent the first time it is asked for
    (the page and API test modules look at the same one)."""
    if (url, key) not in _sent:
        _sent[url, key] = run_shared_prefix(url, key, tenant)
    return _sent[url, key]


def run_shared_prefix(url: str, key: str, tenant: str, seed: int = 11) -> Workload:
    """Send GROUPS x PER_GROUP prompts (a group's system prompt + a question) as one /generate batch."""
    sessions = shared_prefix_sessions(load_tokenizer_for(None), GROUPS, PER_GROUP, SYSTEM_LEN, QUESTION_LEN,
                                      OUTPUT_LEN, seed)
    prompts = [session.turns[0].new_ids for session in sessions]
    salt = f"gsp-{uuid.uuid4().hex[:8]}"
    rids = [f"{salt}-{i}" for i in range(len(prompts))]
    response = httpx.post(url + "/generate", timeout=600.0, headers={"Authorization": f"Bearer {key}"}, json={
        "input_ids": prompts, "rid": rids, "cache_salt": salt,
        "sampling_params": {"max_new_tokens": OUTPUT_LEN, "temperature": 0, "ignore_eos": True}})
    assert response.status_code == 200, response.text
    assert all(result["meta_info"]["finish_reason"]["type"] == "length" for result in response.json())
    return Workload(tenant, salt, prompts, rids)
