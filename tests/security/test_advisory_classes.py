"""One test (or a few) per class of the advisories published against the serving runtimes radixserve is measured
against (docs/security.md, "Advisory classes"). The HTTP ones run against the suite's real server (two tenants and
an administrator, tests/http_fixtures.py); after each refusal /health must still answer at once.

A: code-carrying deserialization on sockets      B: unsafe deserialization of request content
C: the prefix cache as a cross-tenant oracle     D: authentication gaps
E: grammars that crash the engine                F: resource amplification
G: backtracking regexes on user input            H: image input (not served: refused, never fetched)
I: malicious model files
"""

from __future__ import annotations

import ast
import multiprocessing
import os
import pickle
import stat
import struct
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from http_fixtures import ADMIN_KEY, KEY_A, KEY_B, free_port, shared_server
from radixserve.runtime.wire import messages
from radixserve.runtime.wire.ipc import IpcPaths

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
# The packages whose code runs in the serving processes.
SERVING_PACKAGES = ("runtime", "scheduler", "tokenizer_manager", "detokenizer_manager", "model_runner", "radix_cache",
                    "kernels")
HEALTH_BUDGET_S = 2.0


@pytest.fixture(scope="module")
def server():
    return shared_server()


def post(server, path: str, body: dict, key: str = KEY_A, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=300.0,
                      **kwargs)


def assert_healthy_at_once(server) -> None:
    started = time.monotonic()
    assert httpx.get(server.url + "/health", timeout=HEALTH_BUDGET_S).status_code == 200
    assert time.monotonic() - started < HEALTH_BUDGET_S


def serving_sources():
    for package in SERVING_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def call_name(node: ast.Call) -> str:
    func = node.func
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return ".".join(reversed(parts))


# ---- A: no code-carrying decoder on any socket ---------------------------------------------------------------------

CODE_CARRYING_CALLS = {"pickle.loads", "pickle.load", "cloudpickle.loads", "marshal.loads", "dill.loads",
                       "recv_pyobj", "send_pyobj", "broadcast_object_list", "all_gather_object", "gather_object",
                       "scatter_object_list", "recv_object_list", "send_object_list", "yaml.load", "eval", "exec"}


def test_a_no_serving_code_decodes_with_pickle_or_object_collectives():
    found = []
    for path, tree in serving_sources():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [alias.name for alias in node.names] + [getattr(node, "module", None) or ""]
                found += [f"{path}: imports {n}" for n in names if n.split(".")[0] in ("pickle", "cloudpickle", "dill")]
            if isinstance(node, ast.Call):
                name = call_name(node)
                if name in CODE_CARRYING_CALLS or name.rsplit(".", 1)[-1] in CODE_CARRYING_CALLS - {"eval", "exec"}:
                    found.append(f"{path}:{node.lineno}: {name}")
                if name.endswith("torch.load") or name == "torch.load":
                    weights_only = [k for k in node.keywords if k.arg == "weights_only"]
                    if not weights_only or getattr(weights_only[0].value, "value", None) is not True:
                        found.append(f"{path}:{node.lineno}: torch.load without weights_only=True")
    assert found == []


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_the_wire_decodes_typed_structs_only(tmp_path):
    marker = tmp_path / "ran"
    for payload in (pickle.dumps(_Payload(str(marker))), pickle.dumps({"type": "abort", "rid": "x"})):
        with pytest.raises(msgspec.DecodeError):
            messages.decode(payload)
    assert not marker.exists()
    abort = messages.AbortReq(rid="x")
    assert messages.decode(messages.encode(abort)) == abort


def test_a_local_sockets_live_in_a_private_directory():
    paths = IpcPaths.create()
    try:
        assert stat.S_IMODE(os.stat(paths.tmp_dir).st_mode) == 0o700
        for url in (paths.tokenizer_to_scheduler, paths.scheduler_to_detokenizer, paths.detokenizer_to_tokenizer,
                    paths.replica_input(0), paths.replica_reports):
            assert url.startswith(f"ipc://{paths.tmp_dir}/")
    finally:
        paths.remove()


def _relay_rank(rank: int, port: int, marker: str, results) -> None:
    import torch
    import torch.distributed as dist

    from radixserve.scheduler.tp import TPRelay, TPStepInput

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    relay = TPRelay(rank, dist.new_group(backend="gloo"))
    sent = TPStepInput([b"first", b"second"], check_digest=True)
    got = relay.exchange(sent if rank == 0 else None)
    results.put((rank, "typed", got == sent))
    # A peer that sends a pickle where the relay expects its msgspec bytes: refused, nothing runs.
    payload = pickle.dumps(_Payload(marker))
    if rank == 0:
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=relay.cpu_group)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=relay.cpu_group)
        results.put((rank, "pickle", True))
    else:
        try:
            relay.exchange(None)
            results.put((rank, "pickle", "decoded"))
        except msgspec.DecodeError:
            results.put((rank, "pickle", True))
    dist.destroy_process_group()


def test_a_the_tensor_parallel_relay_carries_typed_bytes(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    marker = str(tmp_path / "ran")
    port = free_port()
    procs = [ctx.Process(target=_relay_rank, args=(rank, port, marker, results)) for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        outcome = {(rank, what): ok for rank, what, ok in (results.get(timeout=120) for _ in range(4))}
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    assert outcome == {(0, "typed"): True, (1, "typed"): True, (0, "pickle"): True, (1, "pickle"): True}
    assert not os.path.exists(marker)


# ---- B: request content is data, and adapters load only from the configured folder -------------------------------

def test_b_embeddings_and_adapter_paths_from_a_request_are_refused(server, tmp_path):
    embeds = post(server, "/generate", {"text": "hi", "input_embeds": [[0.5] * 8],
                                        "sampling_params": {"max_new_tokens": 1}})
    assert embeds.status_code == 400 and "input_embeds" in embeds.json()["error"]["message"]
    body = {"lora_name": "x", "lora_path": str(tmp_path)}
    assert post(server, "/load_lora_adapter", body).status_code == 403  # a tenant: not the administrator
    refused = post(server, "/load_lora_adapter", body, key=ADMIN_KEY)  # no --lora-adapter-dir: nothing loads
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "lora_path_not_allowed"
    assert_healthy_at_once(server)


# ---- C: cached_tokens counts only the caller's own namespace --------------------------------------------------------

def test_c_another_tenants_prompt_is_no_cache_hit(server):
    prompt = "The secret recipe of tenant alpha, number 4217: flour, sugar, eggs, and a pinch of salt " * 3
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    first = post(server, "/generate", body).json()["meta_info"]
    again = post(server, "/generate", body).json()["meta_info"]
    other = post(server, "/generate", body, key=KEY_B).json()["meta_info"]
    assert again["cached_tokens"] >= first["prompt_tokens"] - 1
    assert other["cached_tokens"] == 0


# ---- D: every route but the public ones needs the key; keys are held as digests -------------------------------------

def test_d_routes_outside_v1_need_the_key_and_near_misses_fail(server):
    near_miss = KEY_A[:-1] + ("x" if KEY_A[-1] != "x" else "y")
    for method, path in [("POST", "/generate"), ("GET", "/get_server_info"), ("GET", "/cache/tree"),
                         ("POST", "/flush_cache"), ("GET", "/metrics"), ("POST", "/abort_request"),
                         ("GET", "/health_generate"), ("POST", "/load_lora_adapter")]:
        for headers in ({}, {"Authorization": f"Bearer {near_miss}"}, {"Authorization": f"Basic {KEY_A}"}):
            response = httpx.request(method, server.url + path, json={}, headers=headers, timeout=30.0)
            assert response.status_code == 401, (method, path, headers, response.text)


def test_d_the_resolver_holds_digests_and_compares_in_constant_time(tmp_path):
    import inspect

    from radixserve.runtime import tenancy

    tenants = tmp_path / "tenants.json"
    tenants.write_text('{"sk-one": "one", "sk-two": "two"}')
    resolver = tenancy.TenantResolver.from_server_args(None, str(tenants), "sk-admin")
    held = repr(vars(resolver))
    assert "sk-one" not in held and "sk-two" not in held and "sk-admin" not in held
    assert resolver.tenant_for("Bearer sk-two") == "two" and resolver.caller("Bearer sk-admin").is_admin
    source = inspect.getsource(tenancy)
    assert source.count("hmac.compare_digest(") == 2 and "== presented" not in source


# ---- E: grammars that would crash or stall the engine ---------------------------------------------------------------

def test_e_malformed_deep_and_slow_grammars_are_400s(server):
    deep = '{"type": "object", "properties": {"a": ' * 2000 + "{}" + "}}" * 2000
    cases = [{"json_schema": deep}, {"json_schema": '{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}'},
             {"json_schema": "{not json"}, {"regex": "(a"}, {"regex": "(a|b" * 500}, {"ebnf": "root ::= missing"}]
    for params in cases:
        response = post(server, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, **params}})
        assert response.status_code == 400, (list(params), response.text[:200])
        assert_healthy_at_once(server)


# ---- F: what a request can multiply is bounded, and the head of a request too --------------------------------------

def test_f_amplifying_fields_are_400s_and_huge_headers_431(server):
    generous = [
        ("/generate", {"text": "hi", "sampling_params": {"n": 129, "max_new_tokens": 1}}, "--max-request-n"),
        ("/generate", {"text": "hi", "sampling_params": {"stop": [f"s{i}" for i in range(33)]}}, "--max-stop-strings"),
        ("/generate", {"text": "hi", "sampling_params": {"stop": ["x" * 5000]}}, "--max-stop-string-length"),
        ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {str(i): 1 for i in range(2000)}}},
         "--max-logit-bias-tokens"),
        ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 10**6}, "top_logprobs_num"),
        ("/v1/completions", {"prompt": "hi", "best_of": 10**4, "n": 1}, "best_of"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 10**4}, "logprobs"),
    ]
    for path, body, named in generous:
        response = post(server, path, body)
        assert response.status_code == 400 and named in response.text, (path, body, response.text[:300])
    header = httpx.get(server.url + "/health", headers={"X-Padding": "a" * (2 << 20)}, timeout=30.0)
    assert header.status_code == 431
    assert_healthy_at_once(server)


def test_f_extreme_penalties_generate_or_are_refused(server):
    for params in ({"repetition_penalty": 1e30}, {"repetition_penalty": 1e-30}, {"frequency_penalty": 2.0,
                                                                                  "presence_penalty": -2.0},
                   {"temperature": 1e-30}, {"temperature": 1e30}):
        response = post(server, "/generate", {"text": "hi hi hi", "sampling_params": {"max_new_tokens": 4, **params}})
        assert response.status_code in (200, 400), (params, response.text[:200])
        if response.status_code == 200:
            assert response.json()["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    assert_healthy_at_once(server)


# ---- G: user input never meets a backtracking regex ----------------------------------------------------------------

REGEX_CALLS = {"compile", "match", "search", "fullmatch", "sub", "subn", "findall", "finditer", "split"}


def test_g_a_checkpoints_ignore_pattern_that_can_backtrack_is_refused():
    from radixserve.model_runner.quantization.methods import bounded_pattern

    for fine in (r".*lm_head", r"model.layers.\d+.mlp.gate$", r"model\.layers\.[0-9]+\.(q|k)_proj"):
        assert bounded_pattern(fine) == fine
    for evil in (r"(a+)+$", r"(a|aa)*b", r"(.*)*x", r"((ab)*)+", r"(?=a)a", r"(a)\1"):
        with pytest.raises(ValueError, match="refused"):
            bounded_pattern(evil)
    with pytest.raises(ValueError, match="not a regular expression"):
        bounded_pattern("(unclosed")


def test_g_every_python_regex_in_the_serving_code_is_a_literal():
    """Python's `re` backtracks; only fixed patterns of the code may use it (user regexes go to xgrammar, an
    automaton compiled off the scheduler's critical path under --grammar-compile-timeout)."""
    found = []
    for path, tree in serving_sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and call_name(node).startswith("re.") and \
                    call_name(node)[3:] in REGEX_CALLS and node.args:
                pattern = node.args[0]
                literal = isinstance(pattern, ast.Constant) and isinstance(pattern.value, str)
                # A character class of escaped fixed markers (tool_grammar.py) is built from constants too.
                joined = isinstance(pattern, ast.JoinedStr) and all(
                    isinstance(v, ast.Constant) or "escape" in ast.dump(v) for v in pattern.values)
                # A model file's pattern, checked for linear-time matching first (quantization/methods.py).
                bounded = isinstance(pattern, ast.Call) and call_name(pattern) == "bounded_pattern"
                if not (literal or joined or bounded):
                    found.append(f"{path}:{node.lineno}: {ast.unparse(pattern)}")
    assert found == []


@pytest.mark.parametrize("name", ["hermes", "qwen25", "llama3", "mistral", "pythonic"])
def test_g_tool_call_parsers_take_linear_time_on_adversarial_output(name):
    from radixserve.runtime.http.openai.tool_parsers import get_tool_parser

    parser = get_tool_parser(name)
    size = 200_000
    adversarial = ["<tool_call>" * (size // 11), "[" * size, "{" * size, '{"name": "' + "a" * size,
                   "[TOOL_CALLS][" + '{"name": "f", "arguments": {' * (size // 30), "<|python_tag|>" + "(" * size,
                   "[f(a=" * (size // 5), "\\" * size + '"']
    for text in adversarial:
        started = time.monotonic()
        parsed = parser.parse(text)
        assert time.monotonic() - started < 2.0, (name, text[:40])
        assert parsed is not None


# ---- H: image input is not served, so an image part is refused and never fetched -----------------------------------

def test_h_image_parts_are_refused_without_a_fetch(server):
    with __import__("socket").socket() as listener:  # a URL that would show a fetch: nothing may connect to it
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(1.0)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/cat.png"
        chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                          {"type": "image_url", "image_url": {"url": url}}]}]}
        assert post(server, "/v1/chat/completions", chat).status_code == 400
        assert post(server, "/generate", {"text": "hi", "image_data": url}).status_code == 400
        with pytest.raises(OSError):
            listener.accept()


# ---- I: model files ------------------------------------------------------------------------------------------------

def test_i_a_gguf_with_absurd_counts_names_its_defect(tmp_path):
    """The header checks themselves are fuzzed in tests/model_runner/test_model_file_checks.py."""
    from radixserve.model_runner.loader.file_checks import ModelFileError
    from radixserve.model_runner.loader.gguf_convert import convert_gguf

    path = tmp_path / "absurd.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**40, 2**40) + b"\0" * 64)
    with pytest.raises(ModelFileError, match="cannot fit") as error:
        convert_gguf(str(path), str(tmp_path))
    assert str(error.value).startswith(str(path))
