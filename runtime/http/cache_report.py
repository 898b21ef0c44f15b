"""`radixserve cache-report --url URL --out report.html`: the cache page of a running server, as one file.

The report is the page of `GET /cache` with its stylesheet and script inlined and the data it would poll
(`/cache/tree` and `/get_server_info`, fetched once with the given key) embedded as `RADIXSERVE_SNAPSHOT`;
the page draws a snapshot without making any request, so the file opens anywhere, offline.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Optional

import httpx

from radixserve.runtime.http.static_files import static_text

STYLESHEET_TAG = '<link rel="stylesheet" href="/cache/cache.css">'
SCRIPT_TAG = '<script src="/cache/cache.js"></script>'


class ReportError(Exception):
    """The server could not be reached or refused a request (the message says which and why)."""


def fetch_snapshot(url: str, api_key: Optional[str] = None, namespace: Optional[str] = None, max_nodes: int = 300,
                   detail: str = "summary", rid: Optional[str] = None, timeout: float = 60.0) -> dict[str, Any]:
    """What the page shows, from the server at `url`: {"url", "taken", "tree", "info"}."""
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    params: dict[str, Any] = {"max_nodes": max_nodes, "detail": detail}
    if namespace:
        params["namespace"] = namespace
    if rid:
        params["rid"] = rid
    with httpx.Client(base_url=url, headers=headers, timeout=timeout) as client:
        tree = _get(client, "/cache/tree", params)
        info = _get(client, "/get_server_info", {})
    return {"url": url, "taken": time.time(), "tree": tree, "info": info}


def _get(client: httpx.Client, path: str, params: dict[str, Any]) -> Any:
    try:
        response = client.get(path, params=params)
    except httpx.HTTPError as error:
        raise ReportError(f"cannot reach {client.base_url}{path}: {error}") from None
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except Exception:
            message = response.text[:300]
        raise ReportError(f"{path} answered {response.status_code}: {message}")
    return response.json()


def render_report(snapshot: dict[str, Any]) -> str:
    """One self-contained HTML file drawing `snapshot`."""
    page = static_text("cache.html")
    if STYLESHEET_TAG not in page or SCRIPT_TAG not in page:
        raise AssertionError("cache.html no longer links cache.css and cache.js as the report expects")
    # In a <script> element, "</script>" or "<!--" inside a string would end or confuse it: escape every "<".
    data = json.dumps(snapshot, ensure_ascii=False).replace("<", "\\u003c")
    page = page.replace(STYLESHEET_TAG, "<style>\n" + static_text("cache.css") + "</style>")
    script = "<script>window.RADIXSERVE_SNAPSHOT = " + data + ";</script>\n<script>\n" + static_text("cache.js")
    return page.replace(SCRIPT_TAG, script + "</script>")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:30000", help="the server (default: %(default)s)")
    parser.add_argument("--out", default="cache-report.html", help="the HTML file to write (default: %(default)s)")
    parser.add_argument("--api-key", default=None, help="the key to read the cache with (your tenant's view)")
    parser.add_argument("--namespace", default=None, help="only this namespace (its name as the page shows it)")
    parser.add_argument("--max-nodes", type=int, default=300, help="nodes per namespace (default: %(default)s)")
    parser.add_argument("--detail", choices=["summary", "text"], default="summary",
                        help="'text' embeds the text of your own cached prefixes in the file")
    parser.add_argument("--rid", default=None, help="mark this request's path")


def run(args: argparse.Namespace) -> int:
    try:
        snapshot = fetch_snapshot(args.url, args.api_key, args.namespace, args.max_nodes, args.detail, args.rid)
    except ReportError as error:
        print(f"radixserve cache-report: error: {error}", file=sys.stderr)
        return 1
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(render_report(snapshot))
    tree = snapshot["tree"]
    print(f"wrote {args.out}: {len(tree['namespaces'])} namespace(s), "
          f"{sum(len(ns['nodes']) for ns in tree['namespaces'])} node(s)")
    return 0
