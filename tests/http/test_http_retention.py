"""Retained sessions over a real server under KV pressure: `/generate` with prompt_cache_key and
prompt_cache_retention keeps a tenant's conversation cached while other traffic fills the pool several times over;
the retention shows in /get_server_info and /metrics; another tenant using the same key neither reads nor releases
it; a Responses chain with prompt_cache_retention is retained the same way."""

from __future__ import annotations

import random

import httpx
import openai
import pytest

from http_fixtures import ADMIN_KEY, KEY_A, KEY_B, ServerProcess, tenants_file

pytestmark = [pytest.mark.timeout(900)]

POOL_TOKENS = 1024


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--max-total-tokens", str(POOL_TOKENS), "--retention-quota-tokens", "400", "--tenants-file", tenants_file(),
                            "--admin-api-key", ADMIN_KEY, "--log-level", "warning", api_key=KEY_A, admin_key=ADMIN_KEY)
    yield process
    process.stop()


def generate(server, key: str, input_ids: list[int], **fields) -> dict:
    response = httpx.post(server.url + "/generate", headers=server.headers(key), timeout=300.0, json={
        "input_ids": input_ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_retained_session_outlives_kv_pressure(server):
    rng = random.Random(0)
    turn1 = [rng.randrange(100, 20000) for _ in range(300)]
    session = {"prompt_cache_key": "agent-7", "prompt_cache_retention": 600.0}
    first = generate(server, KEY_A, turn1, **session)
    retention = server.server_info()["retention"]
    kept = retention["tokens_by_tenant"]["alpha"]
    assert retention["sessions"] == 1 and kept >= len(turn1)
    metrics = httpx.get(server.url + "/metrics", headers=server.headers(ADMIN_KEY)).text
    assert f'radixserve:retained_tokens{{model_name="' in metrics and f'tenant="alpha"}} {float(kept)}' in metrics

    # Tenant B, same key and prompt: its own (empty) namespace; A's session is untouched.
    other = generate(server, KEY_B, turn1, **session)
    assert other["meta_info"]["cached_tokens"] == 0
    for _ in range(8):  # 8 x 300 prompt tokens through a 1024-token pool
        generate(server, KEY_B, [rng.randrange(100, 20000) for _ in range(300)])
    info = server.server_info()["retention"]
    assert info["tokens_by_tenant"]["alpha"] == kept and info["sessions"] >= 1

    turn2 = turn1 + first["output_ids"] + [rng.randrange(100, 20000) for _ in range(20)]
    second = generate(server, KEY_A, turn2, **session)
    assert second["meta_info"]["cached_tokens"] >= len(turn1) + len(first["output_ids"]) - 1
    # A tenant's own view shows its own use of its quota, nothing of the other tenant's.
    info = server.server_info()["retention"]
    own = httpx.get(server.url + "/get_server_info", headers=server.headers(KEY_A)).json()["retention"]
    assert own == {"retained_tokens": info["tokens_by_tenant"]["alpha"], "tenant_quota_tokens": 400}
    assert own["retained_tokens"] >= len(turn2)


@pytest.mark.slow
def test_without_retention_the_cache_is_plain_lru(server):
    rng = random.Random(1)
    turn1 = [rng.randrange(100, 20000) for _ in range(200)]
    first = generate(server, KEY_A, turn1)
    for _ in range(8):
        generate(server, KEY_B, [rng.randrange(100, 20000) for _ in range(300)])
    second = generate(server, KEY_A, turn1 + first["output_ids"])
    assert second["meta_info"]["cached_tokens"] == 0


@pytest.mark.slow
def test_retention_needs_a_key(server):
    response = httpx.post(server.url + "/generate", headers=server.headers(KEY_A), json={
        "input_ids": [1, 2, 3], "prompt_cache_retention": 60.0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_cache_key"


@pytest.mark.slow
def test_responses_chain_with_retention(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY_A, max_retries=0, timeout=300.0)
    model = client.models.list().data[0].id
    before = server.server_info()["retention"]["sessions"]
    first = client.responses.create(model=model, input="Name a fruit.", max_output_tokens=8, temperature=0.0,
                                    prompt_cache_key="chain-1", prompt_cache_retention="in_memory")
    assert server.server_info()["retention"]["sessions"] == before + 1
    rng = random.Random(2)
    for _ in range(8):
        generate(server, KEY_B, [rng.randrange(100, 20000) for _ in range(300)])
    second = client.responses.create(model=model, input="And a vegetable?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0.0, prompt_cache_key="chain-1",
                                     prompt_cache_retention="in_memory")
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
