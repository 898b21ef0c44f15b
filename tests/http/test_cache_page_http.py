"""GET /cache/tree, the page's files and `radixserve cache-report` against a real server with two tenants.

The tree after a shared-prefix workload is checked against the workload itself (the prompts sent, as token
ids): one top-level node per distinct first token, the system prompts' tokens and text, hits for every reuse;
and against /get_server_info's counters for the same namespace. Tenant A never sees anything of tenant B.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest

from cache_page_workload import GROUPS, PER_GROUP, SYSTEM_LEN, Workload, shared_prefix_workload
from http_fixtures import KEY_A, KEY_B, shared_server
from radixserve.runtime.wire.cache_tree import namespace_name
from radixserve.runtime.http.cache_report import SCRIPT_TAG, STYLESHEET_TAG, render_report
from radixserve.runtime.http.static_files import static_text

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def workload(server) -> Workload:
    return shared_prefix_workload(server.url, KEY_A, "alpha")


@pytest.fixture(scope="module")
def beta_marker(server) -> str:
    """A request of tenant B with a recognisable text, in B's default namespace and a salted one."""
    marker = f"Zebra{uuid.uuid4().hex[:6]} confidential ledger of tenant two"
    for salt in (None, "beta-salt"):
        body = {"text": marker, "rid": f"beta-{salt}-{uuid.uuid4().hex[:6]}", "cache_salt": salt,
                "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        response = httpx.post(server.url + "/generate", json=body, headers=server.headers(KEY_B), timeout=300)
        assert response.status_code == 200, response.text
    return marker


def remote_urls(text: str) -> set[str]:
    return set(re.findall(r"https?://[^\s\"')]+", text))


def tree(server, key: str, **params) -> dict:
    response = httpx.get(server.url + "/cache/tree", params=params, headers=server.headers(key), timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def namespace(summary: dict, name: str) -> dict:
    (found,) = [ns for ns in summary["namespaces"] if ns["name"] == name]
    return found


def test_tree_of_a_shared_prefix_workload(server, workload, tokenizer):
    server.wait_idle()
    ns = namespace(tree(server, KEY_A, namespace=workload.namespace, detail="text"), workload.namespace)
    prompts = workload.prompts
    # Nothing else ran in this namespace: its tokens are the prompts' plus the outputs with KV (all but the last).
    assert ns["num_top_level"] == workload.expected_top_level == GROUPS
    assert ns["num_tokens"] == len({tuple(p[:i]) for p in prompts for i in range(1, len(p) + 1)}) + \
        len(prompts) * 3  # OUTPUT_LEN - 1 output tokens each, never shared (each prompt ends differently)
    assert ns["queried_tokens"] > 0 and not ns["truncated"] and ns["locked_tokens"] == 0
    top = [node for node in ns["nodes"] if node["parent"] == -1]
    assert len(top) == GROUPS
    systems = {tuple(p[:SYSTEM_LEN]) for p in prompts}
    for node in top:
        # Each group's system prompt is one node (questions diverge right after it), reused by the group.
        assert node["tokens"] == SYSTEM_LEN and node["depth"] == 1 and node["tier"] == "device"
        assert node["lock_ref"] == 0 and node["last_access"] > 0
        assert node["hits"] >= PER_GROUP - 1
        assert any(node["text"] == tokenizer.decode(list(s)[:256]) for s in systems)
        assert node["subtree_tokens"] == SYSTEM_LEN + PER_GROUP * (len(prompts[0]) - SYSTEM_LEN + 3)
    assert "token_ids" not in json.dumps(ns)
    # The same counters as /get_server_info reports for this namespace.
    info = httpx.get(server.url + "/get_server_info", headers=server.headers(KEY_A), timeout=30).json()
    counters = info["cache"]["namespaces"][workload.namespace]
    assert {k: ns[k] for k in ("queried_tokens", "matched_tokens", "hit_rate")} == \
        {k: counters[k] for k in ("queried_tokens", "matched_tokens", "hit_rate")}


def test_summary_is_limited_to_the_heaviest_nodes(server, workload):
    ns = namespace(tree(server, KEY_A, namespace=workload.namespace, max_nodes=2), workload.namespace)
    assert len(ns["nodes"]) == 2 and ns["truncated"] and ns["num_top_level"] == GROUPS
    shown_top = [n for n in ns["nodes"] if n["parent"] == -1]
    omitted = ns["num_tokens"] - sum(n["subtree_tokens"] for n in shown_top)
    assert sum(n["tokens"] + n["omitted_tokens"] for n in ns["nodes"]) + omitted == ns["num_tokens"]
    ns = namespace(tree(server, KEY_A, namespace=workload.namespace, depth=1), workload.namespace)
    assert {n["depth"] for n in ns["nodes"]} == {1} and all(n["omitted_children"] == PER_GROUP for n in ns["nodes"])


def test_a_finished_requests_path(server, workload):
    rid = workload.rids[0]
    summary = tree(server, KEY_A, rid=rid, namespace=workload.namespace)
    path = summary["path"]
    nodes = {n["id"]: n for n in namespace(summary, workload.namespace)["nodes"]}
    assert path["rid"] == rid and path["namespace"] == workload.namespace and not path["running"]
    assert path["num_tokens"] == len(workload.prompts[0]) + 4 and path["cached_tokens"] == path["num_tokens"] - 1
    depths = [nodes[i]["depth"] for i in path["node_ids"]]
    assert len(depths) >= 2 and depths == list(range(1, len(depths) + 1))  # the system prompt, then its own
    assert nodes[path["node_ids"][0]]["tokens"] == SYSTEM_LEN
    assert sum(nodes[i]["tokens"] for i in path["node_ids"]) == path["cached_tokens"]


def test_a_running_requests_path_is_locked(server):
    rid = f"running-{uuid.uuid4().hex[:8]}"
    done = threading.Event()

    def run() -> None:
        httpx.post(server.url + "/generate", timeout=300, headers=server.headers(KEY_A), json={
            "text": "Count slowly from one:", "rid": rid, "cache_salt": rid,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}})
        done.set()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        summary = tree(server, KEY_A, rid=rid)
        while not (summary["path"] and summary["path"]["node_ids"]) and time.monotonic() < deadline:
            time.sleep(0.05)
            summary = tree(server, KEY_A, rid=rid)
        path = summary["path"]
        assert path is not None, "the running request never showed up"
        assert path["running"] and path["namespace"] == namespace_name(("tenant:alpha", f"salt:{rid}"))
        ns = namespace(summary, path["namespace"])
        assert ns["locked_tokens"] > 0
        assert all(n["lock_ref"] >= 1 for n in ns["nodes"] if n["id"] in path["node_ids"])
    finally:
        httpx.post(server.url + "/abort_request", json={"rid": rid}, headers=server.headers(KEY_A))
        thread.join(120)
    assert done.is_set()


def test_tenant_a_sees_nothing_of_tenant_b(server, workload, beta_marker):
    for params in ({}, {"detail": "text"}, {"detail": "text", "max_nodes": 5000}):
        body = httpx.get(server.url + "/cache/tree", params=params, headers=server.headers(KEY_A), timeout=60).text
        assert "beta" not in body and "Zebra" not in body and beta_marker not in body
        names = [ns["name"] for ns in json.loads(body)["namespaces"]]
        assert names and all(name == "tenant:alpha" or name.startswith("tenant:alpha/") for name in names)
    # B's own rid and namespace names, asked for by A, are simply absent.
    assert tree(server, KEY_A, namespace="tenant:beta")["namespaces"] == []
    assert tree(server, KEY_A, namespace=namespace_name(("tenant:beta", "salt:beta-salt")))["namespaces"] == []
    beta = tree(server, KEY_B, detail="text")
    assert {ns["name"] for ns in beta["namespaces"]} >= {"tenant:beta", namespace_name(("tenant:beta", "salt:beta-salt"))}
    assert beta_marker in json.dumps(beta) and "alpha" not in json.dumps(beta)
    assert tree(server, KEY_B, rid=workload.rids[0])["path"] is None


def test_bad_input_and_open_files(server):
    for params, param in (({"max_nodes": 0}, "max_nodes"), ({"depth": -1}, "depth"), ({"detail": "all"}, "detail"),
                          ({"max_nodes": "many"}, "max_nodes"), ({"rid": "x" * 300}, "rid")):
        response = httpx.get(server.url + "/cache/tree", params=params, headers=server.headers(KEY_A))
        assert response.status_code == 400, (params, response.text)
        assert param in response.json()["error"]["param"]
    assert httpx.get(server.url + "/cache/tree").status_code == 401
    assert httpx.get(server.url + "/cache/tree", headers={"Authorization": "Bearer nope"}).status_code == 401
    page = httpx.get(server.url + "/cache")  # the page and its files hold no data: open
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/cache/cache.js" in page.text and remote_urls(page.text) == set()
    for name, kind in (("cache.js", "text/javascript"), ("cache.css", "text/css")):
        response = httpx.get(server.url + "/cache/" + name)
        assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
        assert remote_urls(response.text) <= {"http://www.w3.org/2000/svg"}  # the SVG namespace name, not a fetch
    missing = httpx.get(server.url + "/cache/secrets.txt")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert server.server_info()["num_running_reqs"] >= 0  # the server is still up


def test_cache_report_writes_one_self_contained_file(server, workload, beta_marker, tmp_path):
    out = tmp_path / "report.html"
    command = [sys.executable, "-m", "radixserve", "cache-report", "--url", server.url, "--api-key", KEY_A,
               "--out", str(out), "--detail", "text", "--rid", workload.rids[1]]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    html = out.read_text()
    assert "RADIXSERVE_SNAPSHOT" in html and "<script src=" not in html and "<link" not in html
    assert "beta" not in html and beta_marker not in html and workload.namespace in html
    snapshot = json.loads(html.split("window.RADIXSERVE_SNAPSHOT = ", 1)[1].split(";</script>", 1)[0])
    assert snapshot["tree"]["path"]["rid"] == workload.rids[1]
    assert namespace(snapshot["tree"], workload.namespace)["num_top_level"] == GROUPS
    wrong_key = subprocess.run([*command[:-4], "--api-key", "wrong"], capture_output=True, text=True, timeout=120)
    assert wrong_key.returncode == 1 and "401" in wrong_key.stderr


def test_report_escapes_what_it_embeds():
    """Cached text is the users': whatever it holds, it stays data inside the report's script element."""
    hostile = "</script><script>alert(1)</script><!-- \u2028"
    node = {"id": 0, "parent": -1, "depth": 1, "tokens": 3, "prefix_tokens": 3, "subtree_tokens": 3, "hits": 0,
            "last_access": 0.0, "lock_ref": 0, "tier": "device", "omitted_children": 0, "omitted_tokens": 0,
            "text": hostile, "text_truncated": False}
    ns = {"name": "tenant:x/salt:</script>", "nodes": [node]}
    html = render_report({"url": "u", "taken": 0.0, "tree": {"namespaces": [ns]}, "info": {}})
    plain = static_text("cache.html").replace(SCRIPT_TAG, "").replace(STYLESHEET_TAG, "")
    assert html.count("</script>") == 2 and html.count("<script") == 2 and "<!--" not in html
    assert plain.count("<script") == 0
    data = html.split("window.RADIXSERVE_SNAPSHOT = ", 1)[1].split(";</script>", 1)[0]
    assert json.loads(data)["tree"]["namespaces"][0]["nodes"][0]["text"] == hostile


@pytest.fixture(scope="module")
def tokenizer():
    from radixserve.runtime.model_files import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None).model_dir)
