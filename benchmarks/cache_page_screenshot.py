"""A screenshot of a live server's cache page (`GET /cache`) during and after a shared-prefix workload.

    radixserve serve --port 30000 --tenants-file tenants.json &      # {"sk-alpha": "alpha", "sk-beta": "beta"}
    python benchmarks/cache_page_screenshot.py --url http://127.0.0.1:30000 --api-key sk-alpha \
        --out docs/cache-page.png

Steps: open the page (headless Chromium through Playwright, the system's /usr/bin/chromium; nothing is
downloaded) so it polls the counters while the workload runs; run the generated-shared-prefix workload of
benchmarks/serving.py with the given key (`--gsp-*` as there); send one more request, rid "demo", made of
group 0's system prompt (rebuilt from the same seed) and a new question; enter "demo" on the page, which marks
that request's path through the tree; take a full-page screenshot.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving import load_tokenizer_for  # noqa: E402
from serving_datasets import TokenSampler, shared_prefix_sessions  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def run_workload(args: argparse.Namespace) -> None:
    command = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "serving.py"),
               "--base-url", args.url, "--dataset", "generated-shared-prefix", "--disable-tqdm",
               "--gsp-num-groups", str(args.gsp_num_groups), "--gsp-prompts-per-group", str(args.gsp_prompts_per_group),
               "--gsp-system-prompt-len", str(args.gsp_system_prompt_len),
               "--gsp-question-len", str(args.gsp_question_len), "--gsp-output-len", str(args.gsp_output_len),
               "--seed", str(args.seed), "--output-file", os.devnull]
    if args.api_key:
        command += ["--api-key", args.api_key]
    subprocess.run(command, check=True)


def send_demo_request(args: argparse.Namespace) -> None:
    """A request that shares group 0's system prompt: the first prompt of the workload with that prefix."""
    tokenizer = load_tokenizer_for(None)
    sessions = shared_prefix_sessions(tokenizer, args.gsp_num_groups, args.gsp_prompts_per_group,
                                      args.gsp_system_prompt_len, args.gsp_question_len, args.gsp_output_len,
                                      args.seed)
    system_ids = sessions[0].turns[0].new_ids[:args.gsp_system_prompt_len]
    question = TokenSampler(tokenizer, random.Random("cache-page-demo")).ids(args.gsp_question_len)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    response = httpx.post(args.url + "/generate", headers=headers, timeout=600, json={
        "input_ids": system_ids + question, "rid": "demo",
        "sampling_params": {"max_new_tokens": args.gsp_output_len, "temperature": 0, "ignore_eos": True}})
    response.raise_for_status()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--out", default="docs/cache-page.png")
    parser.add_argument("--gsp-num-groups", type=int, default=6)
    parser.add_argument("--gsp-prompts-per-group", type=int, default=4)
    parser.add_argument("--gsp-system-prompt-len", type=int, default=256)
    parser.add_argument("--gsp-question-len", type=int, default=32)
    parser.add_argument("--gsp-output-len", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    args.url = args.url.rstrip("/")

    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(args.url + "/cache" + (f"#key={args.api_key}" if args.api_key else ""))
        page.wait_for_selector("#namespaces[data-loaded]")
        run_workload(args)  # the page keeps polling meanwhile, in the browser's own process
        send_demo_request(args)
        page.fill("#rid", "demo")
        page.click("#rid-form button")
        page.wait_for_selector("rect.node.on-path")
        time.sleep(3)  # one more counter sample after the last request
        page.screenshot(path=args.out, full_page=True)
        browser.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
