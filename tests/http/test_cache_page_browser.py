"""The cache page in a real headless browser (Debian's Chromium driven by Playwright) against a live server.

After a generated-shared-prefix workload of tenant A: the page draws one top-level node per group in that
namespace, shows the hit rate /get_server_info reports, marks a request's path when its rid is entered, and,
opened with A's key, shows nothing of tenant B (no namespace, no text, not even with node text on). The file
written by `radixserve cache-report` draws the same picture without any request.

`make test` installs Chromium (apt) and Playwright (the dev extra); this module is skipped, saying why, only
where Chromium is missing (e.g. a machine where the apt install was not allowed).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from cache_page_workload import GROUPS, Workload, shared_prefix_workload
from http_fixtures import KEY_A, KEY_B, shared_server
from radixserve.runtime.wire.cache_tree import namespace_name

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

if not os.access(CHROMIUM, os.X_OK):
    pytest.skip(f"{CHROMIUM} is missing: `make test` installs it with apt-get (package chromium), which needs root "
                "and Debian's package archive", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra: pip install -e '.[dev]'")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def workload(server) -> Workload:
    return shared_prefix_workload(server.url, KEY_A, "alpha")


@pytest.fixture(scope="module")
def beta_marker(server) -> str:
    marker = f"Quagga{uuid.uuid4().hex[:6]} private notes of the other tenant"
    response = httpx.post(server.url + "/generate", headers=server.headers(KEY_B), timeout=300, json={
        "text": marker, "cache_salt": "beta-page", "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert response.status_code == 200, response.text
    return marker


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert not errors, errors  # no script error on the page, ever


def open_page(page, server, key: str) -> None:
    page.goto(f"{server.url}/cache#key={key}")
    page.wait_for_selector("#namespaces[data-loaded]", timeout=60_000)
    page.wait_for_function("document.getElementById('hit-rate').dataset.value !== undefined", timeout=60_000)


def section(workload: Workload) -> str:
    return f'section.namespace[data-name="{workload.namespace}"]'


def test_page_draws_the_workload_and_the_hit_rate(page, server, workload):
    server.wait_idle()
    open_page(page, server, KEY_A)
    top_level = page.locator(section(workload) + ' rect.node[data-depth="1"]')
    assert top_level.count() == workload.expected_top_level == GROUPS
    assert page.locator(section(workload) + " rect.omitted").count() == 0
    # The hit rate shown is the one /get_server_info reports to this tenant: its own (nothing runs now).
    expected = httpx.get(server.url + "/get_server_info", headers=server.headers(KEY_A)).json()["cache"]["hit_rate"]
    page.wait_for_function(f"Math.abs(Number(document.getElementById('hit-rate').dataset.value) - {expected}) < 1e-12",
                           timeout=30_000)
    assert page.inner_text("#hit-rate") == f"{100 * expected:.1f}%"
    assert 0 < expected < 1
    # The namespace header shows the namespace's own hit rate, as the API reports it.
    tree = httpx.get(server.url + "/cache/tree", params={"namespace": workload.namespace},
                     headers=server.headers(KEY_A)).json()
    ns_rate = tree["namespaces"][0]["hit_rate"]
    assert f"hit rate {100 * ns_rate:.1f}%" in page.inner_text(section(workload) + " .facts")


def test_entering_a_rid_marks_its_path(page, server, workload, beta_marker):
    open_page(page, server, KEY_A)
    rid = workload.rids[2]
    path = httpx.get(server.url + "/cache/tree", params={"rid": rid, "max_nodes": 300},
                     headers=server.headers(KEY_A)).json()["path"]
    page.fill("#rid", rid)
    page.click("#rid-form button")
    page.wait_for_selector("rect.node.on-path")
    marked = page.locator("rect.node.on-path")
    assert marked.count() == len(path["node_ids"]) >= 2
    assert sorted(int(marked.nth(i).get_attribute("data-id")) for i in range(marked.count())) == \
        sorted(path["node_ids"])
    assert rid in page.inner_text("#path-info")
    # A rid of nobody in this tenant's namespaces marks nothing and says so.
    page.fill("#rid", "no-such-request")
    page.click("#rid-form button")
    page.wait_for_selector("#path-info.missing")
    assert page.locator("rect.node.on-path").count() == 0


def test_tenant_a_sees_nothing_of_tenant_b(page, server, workload, beta_marker):
    open_page(page, server, KEY_A)
    page.check("#show-text")  # node text on: tooltips and labels carry the cached text
    page.wait_for_function("document.querySelector('#namespaces text.label') !== null "
                           "&& !document.querySelector('#namespaces text.label').textContent.includes(' hits')",
                           timeout=60_000)
    names = page.eval_on_selector_all("section.namespace", "els => els.map(e => e.dataset.name)")
    assert workload.namespace in names
    assert all(name == "tenant:alpha" or name.startswith("tenant:alpha/") for name in names), names
    html = page.content()
    for secret in ("beta", "Quagga", beta_marker):
        assert secret not in html
    # The same page with B's key shows B's namespace and text, and nothing of A's.
    page.fill("#key", KEY_B)
    page.click("#key-form button")
    page.wait_for_selector(f'section.namespace[data-name="{namespace_name(("tenant:beta", "salt:beta-page"))}"]',
                           timeout=60_000)
    page.wait_for_function(f"document.body.innerHTML.includes({beta_marker[:12]!r})", timeout=60_000)
    assert "alpha" not in page.content()


def test_the_report_file_draws_the_same_picture_offline(page, server, workload, tmp_path):
    out = tmp_path / "report.html"
    subprocess.run([sys.executable, "-m", "radixserve", "cache-report", "--url", server.url, "--api-key", KEY_A,
                    "--out", str(out), "--rid", workload.rids[0]], check=True, timeout=120)
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    page.goto(out.as_uri())
    page.wait_for_selector("#namespaces[data-loaded]")
    assert requests == [out.as_uri()]  # nothing else is fetched: the file is self-contained
    assert page.locator(section(workload) + ' rect.node[data-depth="1"]').count() == GROUPS
    assert page.locator("rect.node.on-path").count() >= 2
    assert page.inner_text("#hit-rate").endswith("%") and not page.is_visible("#key-form")
    time.sleep(2.5)  # longer than the live page's polling interval: still no request
    assert requests == [out.as_uri()]
