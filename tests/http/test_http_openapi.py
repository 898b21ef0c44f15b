"""`/openapi.json` over a real server, and a schemathesis fuzz of every route it documents: schema-valid and
schema-violating requests alike never get a 5xx, within a fixed time budget."""

from __future__ import annotations

import collections
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from http_fixtures import ADMIN_KEY, KEY_A, MAIN_SERVER_FLAGS, ServerProcess, tenants_file

pytestmark = pytest.mark.timeout(600)

FUZZ_BUDGET_S = 55.0  # about 2.4 s per documented operation
EXAMPLES_PER_OPERATION = 25
# Request fields whose valid values set the amount of work: generated values are folded into a small range
# so that a schema-valid example costs at most a few decode steps (the fuzz looks for crashes, not for load).
WORK_FIELDS = {"max_tokens", "max_completion_tokens", "max_new_tokens", "min_tokens", "min_new_tokens",
               "max_output_tokens"}
MAX_WORK = 4
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate", "/abort_request", "/v1/messages",
                     "/v1/responses")
POST_ROUTES = {"/v1/chat/completions": "ChatCompletionRequest", "/v1/completions": "CompletionRequest",
               "/generate": "GenerateRequest", "/abort_request": "AbortRequest",
               "/load_lora_adapter": "LoadLoRAAdapterRequest", "/unload_lora_adapter": "UnloadLoRAAdapterRequest",
               "/v1/embeddings": "EmbeddingRequest", "/v1/rerank": "RerankRequest", "/rerank": "RerankRequest",
               "/v1/score": "ScoreRequest", "/classify": "ClassifyRequest", "/v1/classify": "ClassifyRequest",
               "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest",
               "/v1/messages": "MessagesRequest", "/v1/messages/count_tokens": "CountTokensRequest",
               "/v1/responses": "ResponsesRequest"}
ROUTES = {"/health", "/metrics", "/v1/models", "/v1/models/{model_id}", "/v1/chat/completions", "/v1/completions",
          "/generate", "/abort_request", "/flush_cache", "/get_model_info", "/get_server_info", "/health_generate",
          "/model_info", "/server_info",
          "/cache", "/cache/tree", "/cache/{asset}", "/load_lora_adapter", "/unload_lora_adapter",
          "/v1/embeddings", "/v1/rerank", "/rerank", "/v1/score", "/classify", "/v1/classify",
          "/version", "/ping", "/tokenize", "/detokenize",
          "/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/v1/responses/{response_id}",
          "/update_weights_from_disk", "/update_weights_from_tensor", "/init_weights_update_group",
          "/update_weights_from_distributed", "/destroy_weights_update_group", "/get_weights_by_name",
          "/get_weight_version", "/release_memory_occupation", "/resume_memory_occupation", "/pause_generation",
          "/continue_generation"}


@pytest.fixture(scope="module")
def server():
    """A server of the shared one's configuration, of its own: the fuzz's findings are about its requests alone,
    not about what the other HTTP tests left behind."""
    process = ServerProcess(*MAIN_SERVER_FLAGS, "--tenants-file", tenants_file(), "--admin-api-key", ADMIN_KEY,
                            api_key=KEY_A, admin_key=ADMIN_KEY)
    yield process
    process.stop()


def test_openapi_documents_every_route_and_the_request_bodies(server):
    response = httpx.get(server.url + "/openapi.json", timeout=30.0)
    assert response.status_code == 200
    schema = response.json()
    assert schema["openapi"].startswith("3.") and set(schema["paths"]) == ROUTES
    components = schema["components"]["schemas"]
    for path, name in POST_ROUTES.items():
        body = schema["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{name}"}
        assert components[name].get("properties") or components[name].get("anyOf"), name  # anyOf: one of forms
    assert {"messages", "max_tokens", "cache_salt"} <= set(components["ChatCompletionRequest"]["properties"])
    assert {"text", "input_ids", "sampling_params", "stream"} <= set(components["GenerateRequest"]["properties"])
    assert "422" not in schema["paths"]["/generate"]["post"]["responses"]  # validation errors are 400s here
    assert "security" not in schema["paths"]["/health"]["get"]
    assert schema["paths"]["/generate"]["post"]["security"] == [{"apiKey": []}]


def _limit_work(value):
    """Fold the work-setting fields of a generated body (at any depth) into 0..MAX_WORK; an explicit null
    maximum (which means "up to the context window") becomes MAX_WORK."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key in WORK_FIELDS and isinstance(item, int) and not isinstance(item, bool) and item > MAX_WORK:
                value[key] = item % (MAX_WORK + 1)
            elif key in WORK_FIELDS and key.startswith("max_") and item is None:
                value[key] = MAX_WORK
            else:
                _limit_work(item)
    elif isinstance(value, list):
        for item in value:
            _limit_work(item)


def _bound_generation(path: str, body) -> None:
    """Give a generation body that leaves its length unset the same small maximum: unset means "up to the context
    window", thousands of decode steps, which is load, not a crash."""
    if not isinstance(body, dict):
        return
    if path in ("/v1/chat/completions", "/v1/completions"):
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = MAX_WORK
    elif path == "/v1/responses":
        if body.get("max_output_tokens") is None:
            body["max_output_tokens"] = MAX_WORK
    elif path == "/generate":
        params = body.setdefault("sampling_params", {})
        if isinstance(params, dict):
            params.setdefault("max_new_tokens", MAX_WORK)


def _fuzz(server, operation, mode: GenerationMode, deadline: float, statuses: collections.Counter) -> None:
    """Up to EXAMPLES_PER_OPERATION generated requests to one operation (until `deadline`); fails on a 5xx."""

    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case):
        if time.monotonic() > deadline:
            return
        _limit_work(case.body)
        _bound_generation(operation.path, case.body)
        response = case.call(headers=server.headers(), timeout=120)
        statuses[response.status_code] += 1
        case.validate_response(response, checks=[not_a_server_error])

    try:
        fuzz()
    except Unsatisfiable:  # nothing to violate: an operation without parameters or body
        assert mode is GenerationMode.NEGATIVE and not operation.body, operation.label


def test_schemathesis_finds_no_server_error_on_any_route(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {operation.path for operation in operations} == ROUTES
    statuses: collections.Counter = collections.Counter()
    # Each (operation, mode) gets an equal share of the time left, so what the quick ones leave goes to the
    # generation routes, which come last.
    runs = [(operation, mode) for operation in sorted(operations, key=lambda op: op.path in GENERATION_ROUTES)
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
    end = time.monotonic() + FUZZ_BUDGET_S
    for number, (operation, mode) in enumerate(runs):
        _fuzz(server, operation, mode, time.monotonic() + (end - time.monotonic()) / (len(runs) - number), statuses)
    # The examples reached both the generation paths and the validation paths.
    assert not any(status >= 500 for status in statuses), statuses
    assert statuses[200] >= 20 and statuses[400] >= 20, statuses
    assert server.process.poll() is None
    server.wait_idle(timeout=30.0)
