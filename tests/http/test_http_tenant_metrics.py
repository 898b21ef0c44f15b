"""Per-tenant usage over a real server (tenants alpha and beta, an admin key) and a real HTTP client.

- `/metrics` has `radixserve:tenant_*` series labelled by tenant id: requests, prompt, generated and cached
  tokens, and a queue-time histogram; each tenant's series move by exactly what its own requests report;
- requests without a tenant (the admin key) share one label; labels never carry prompt text;
- `/get_server_info` shows a tenant its own totals only, the administrator every tenant's.
"""

from __future__ import annotations

import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from http_fixtures import ADMIN_KEY, KEY_A, KEY_B, shared_server
from radixserve.runtime.http.tenant_usage import DEFAULT_LABEL, OTHER_LABEL, TenantUsage

pytestmark = pytest.mark.timeout(300)
COUNTERS = ("tenant_num_requests", "tenant_prompt_tokens", "tenant_generation_tokens", "tenant_cached_tokens")


@pytest.fixture(scope="module")
def server():
    return shared_server()


def scrape(server) -> tuple[str, dict[tuple[str, str], float]]:
    """The /metrics text, and its tenant samples as (sample name, tenant) -> value."""
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60.0).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "tenant" in sample.labels and "le" not in sample.labels:
                samples[(sample.name, sample.labels["tenant"])] = sample.value
    return text, samples


def generate(server, key: str, text: str, max_new_tokens: int) -> dict:
    response = httpx.post(server.url + "/generate", headers={"Authorization": f"Bearer {key}"}, timeout=120.0,
                          json={"text": text, "sampling_params": {"max_new_tokens": max_new_tokens,
                                                                  "temperature": 0, "ignore_eos": True}})
    assert response.status_code == 200, response.text
    return response.json()["meta_info"]


def usage(server, key: str) -> dict:
    response = httpx.get(server.url + "/get_server_info", headers={"Authorization": f"Bearer {key}"}, timeout=60.0)
    assert response.status_code == 200
    return response.json()["tenant_usage"]


def test_each_tenants_series_move_by_its_own_requests_and_hold_no_prompt_text(server):
    secret_a, secret_b = f"alpha-secret-{uuid.uuid4().hex}", f"beta-secret-{uuid.uuid4().hex}"
    _, before = scrape(server)
    view_a_before = usage(server, KEY_A)
    prompt_a = f"Tenant alpha writes {secret_a} about the long history of the harbour town and its ships"
    metas_a = [generate(server, KEY_A, prompt_a, 3), generate(server, KEY_A, prompt_a, 4)]
    metas_b = [generate(server, KEY_B, f"Tenant beta asks {secret_b} a question", 5)]
    text, after = scrape(server)

    assert secret_a not in text and secret_b not in text and "harbour" not in text
    assert metas_a[1]["cached_tokens"] > 0  # the repeated prompt was served from alpha's cache
    for tenant, metas in (("alpha", metas_a), ("beta", metas_b)):
        expected = {
            "radixserve:tenant_num_requests_total": len(metas),
            "radixserve:tenant_prompt_tokens_total": sum(m["prompt_tokens"] for m in metas),
            "radixserve:tenant_generation_tokens_total": sum(m["completion_tokens"] for m in metas),
            "radixserve:tenant_cached_tokens_total": sum(m["cached_tokens"] for m in metas),
            "radixserve:tenant_queue_time_seconds_count": len(metas),
        }
        for name, delta in expected.items():
            assert after[(name, tenant)] - before.get((name, tenant), 0.0) == delta, (name, tenant)
        queued = (after[("radixserve:tenant_queue_time_seconds_sum", tenant)]
                  - before.get(("radixserve:tenant_queue_time_seconds_sum", tenant), 0.0))
        assert queued == pytest.approx(sum(m["queue_time"] for m in metas), abs=1e-6)
    for meta in metas_a + metas_b:
        assert 0.0 <= meta["queue_time"] <= meta["e2e_latency"]
    # Nobody else moved: the label set is the tenants file's ids and the shared default label, nothing more.
    assert {tenant for _, tenant in after} == {"alpha", "beta", DEFAULT_LABEL}
    for name in COUNTERS:
        key = (f"radixserve:{name}_total", DEFAULT_LABEL)
        assert after[key] == before.get(key, 0.0), name

    # The tenant view: alpha sees its own totals (and nothing of beta's), moved by its own requests.
    view_a = usage(server, KEY_A)
    assert set(view_a) == {"alpha"}
    assert view_a["alpha"]["num_requests"] - view_a_before["alpha"]["num_requests"] == 2
    assert view_a["alpha"]["generation_tokens"] - view_a_before["alpha"]["generation_tokens"] == 7
    assert set(usage(server, KEY_B)) == {"beta"}
    everything = usage(server, ADMIN_KEY)
    assert {"alpha", "beta", DEFAULT_LABEL} <= set(everything)
    assert everything["alpha"] == view_a["alpha"]


def test_requests_without_a_tenant_share_the_default_label(server):
    _, before = scrape(server)
    meta = generate(server, ADMIN_KEY, f"The operator's own prompt {uuid.uuid4().hex}", 2)
    text, after = scrape(server)
    key = ("radixserve:tenant_generation_tokens_total", DEFAULT_LABEL)
    assert after[key] - before.get(key, 0.0) == meta["completion_tokens"] == 2
    # A refused key counts nowhere.
    refused = httpx.post(server.url + "/generate", headers={"Authorization": "Bearer sk-wrong"}, timeout=60.0,
                         json={"text": "hello", "sampling_params": {"max_new_tokens": 1}})
    assert refused.status_code == 401
    assert scrape(server)[1] == after


def test_labels_are_bounded_by_the_tenants_file():
    usage_store = TenantUsage(["alpha", "beta"])
    for tenant in ("alpha", None, "", "someone-else", "another"):
        usage_store.observe_request({"prompt_tokens": 4, "completion_tokens": 2, "cached_tokens": 1,
                                     "queue_time": 0.02}, tenant)
    totals = usage_store.all_totals()
    assert set(totals) == {"alpha", "beta", DEFAULT_LABEL, OTHER_LABEL}
    assert totals["alpha"]["num_requests"] == 1 and totals["beta"]["num_requests"] == 0
    assert totals[DEFAULT_LABEL]["num_requests"] == 2 and totals[OTHER_LABEL]["num_requests"] == 2
    assert totals[OTHER_LABEL]["prompt_tokens"] == 8 and totals[OTHER_LABEL]["cached_tokens"] == 2
    assert totals[OTHER_LABEL]["mean_queue_time_seconds"] == pytest.approx(0.02)
