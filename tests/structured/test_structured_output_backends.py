"""The grammar mask works whatever the attention backend: the same constrained outputs from torch_native, cpu,
triton (under the Triton interpreter on CPU) and, on a GPU, flashinfer, with the overlap scheduler on.

A tiny random-weight Llama with the embedded model's tokenizer: its logits are far from anything a grammar
would pick on its own, so only the mask keeps the outputs valid. On CPU the triton backend runs under the
Triton interpreter (tests/conftest.py sets `TRITON_INTERPRET=1` before anything imports triton).
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from radixserve.runtime.model_files import load_tokenizer
from scheduler_driver import SchedulerDriver

ON_GPU = torch.cuda.is_available()
assert ON_GPU or os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets TRITON_INTERPRET=1 without a GPU"
BACKENDS = ["torch_native", "cpu", "triton"] + (["flashinfer"] if ON_GPU else [])
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "b": {"enum": ["x", "y"]}}, "required": ["a", "b"]}


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tiny_model_dir) -> str:
    return tiny_model_dir("llama", with_tokenizer=True)


def constrained_outputs(model_dir: str, backend: str) -> dict[str, str]:
    tokenizer = load_tokenizer(model_dir)
    driver = SchedulerDriver(model_dir, tokenizer=tokenizer, attention_backend=backend)
    driver.submit("date", tokenizer.encode("Date:"), max_new_tokens=16, regex=DATE)
    driver.submit("json", tokenizer.encode("JSON:"), max_new_tokens=24, json_schema=json.dumps(SCHEMA))
    driver.submit("free", tokenizer.encode("Free:"), max_new_tokens=6)
    driver.scheduler.grammars.wait_for_queue(timeout=60.0)
    results = driver.run_until_idle()
    driver.close()
    for rid in ("date", "json"):
        assert results[rid].finish_reason["type"] == "stop", (rid, results[rid].finish_reason)
    return {rid: tokenizer.decode(r.output_ids, skip_special_tokens=True) for rid, r in results.items()}


@pytest.fixture(scope="module")
def reference(tiny_with_tokenizer) -> dict[str, str]:
    return constrained_outputs(tiny_with_tokenizer, "torch_native")


@pytest.mark.parametrize("backend", BACKENDS)
def test_grammar_mask_in_every_attention_backend(backend, tiny_with_tokenizer, reference):
    assert re.fullmatch(DATE, reference["date"])
    parsed = json.loads(reference["json"])
    assert set(parsed) == {"a", "b"} and 0 <= parsed["a"] <= 99 and parsed["b"] in ("x", "y")
    assert constrained_outputs(tiny_with_tokenizer, backend) == reference
