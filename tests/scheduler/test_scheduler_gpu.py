"""The scheduler on a CUDA device: the overlap worker runs batches on its own CUDA stream, so this is where
stream ordering (host writes to req_to_token and the token table vs the worker's reads) is really exercised.
Greedy outputs must equal Hugging Face's and be identical with overlap on and off. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from scheduler_driver import SchedulerDriver
from test_scheduler import MAX_NEW_TOKENS, make_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CONFIGS = {
    "overlap": dict(),
    "no-overlap": dict(disable_overlap_schedule=True),
    "overlap-chunk-mixed": dict(chunked_prefill_size=16, enable_mixed_chunk=True),
    "overlap-retract": dict(max_total_tokens=240, page_size=4),
}


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    import transformers

    model_dir = tiny_model_dir("llama")
    prompts = make_prompts(0, 16, 512)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device="cuda")
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS,
                                 min_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=0)
            expected.append(out[0, len(prompt):].tolist())
    return model_dir, prompts, expected


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_on_cuda_matches_hf(name, setup):
    model_dir, prompts, expected = setup
    driver = SchedulerDriver(model_dir, device="cuda", dtype="float32", attention_backend="torch_native",
                             **CONFIGS[name])
    for i, prompt in enumerate(prompts):
        driver.submit(f"r{i}", prompt, max_new_tokens=MAX_NEW_TOKENS)
    driver.run_until_idle()
    assert driver.outputs() == expected
    if name == "overlap-retract":
        assert driver.scheduler.stats.num_retractions > 0
    driver.close()
