"""A batch the device cannot hold fails its own requests with a clear error; everything else goes on.

On a GPU an allocation inside a forward (an attention workspace, the logits of a large batch) can fail under
load. The device's `torch.OutOfMemoryError` is raised here, from the real runner's forward of one chosen batch,
because a CPU cannot be made to run out of memory on cue; the scheduler, cache and model around it are real.
Checked: a failure that passes on retry changes no output; one that persists finishes the failing batch's
requests with `abort` and status 503, the requests running beside it (retracted, recomputed) produce exactly what
they produce alone, no KV slot leaks (the invariants after every step), and the failed prompt, sent again, gives
its normal output (no slot of the failed batch stays in the radix tree).
"""

from __future__ import annotations

import pytest
import torch

from scheduler_driver import SchedulerDriver

PROMPTS = {
    "a": [5, 17, 42, 99, 3, 250, 61, 8],
    "b": [7, 7, 120, 33, 14, 2, 301, 45, 46],
    "doomed": [400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 411, 412, 413, 414, 415, 416, 417],
}
MAX_NEW = 6


class FailingForward:
    """Wraps `runner.forward`: extend forwards that carry `marker` raise the device's OOM error, `times` times
    (None: every time)."""

    def __init__(self, runner, marker: int, times: int | None):
        self.runner, self.marker, self.times, self.fired = runner, marker, times, 0
        self.forward = runner.forward
        runner.forward = self

    def __call__(self, batch, *args, **kwargs):
        if (self.times is None or self.fired < self.times) and batch.mode.is_extend() and bool(
                (batch.input_ids == self.marker).any()):
            self.fired += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")
        return self.forward(batch, *args, **kwargs)

    def remove(self) -> None:
        del self.runner.forward  # the instance attribute goes; the method is back


def _alone(model_dir: str, **args) -> dict[str, list[int]]:
    driver = SchedulerDriver(model_dir, **args)
    for rid, prompt in PROMPTS.items():
        driver.submit(rid, prompt, max_new_tokens=MAX_NEW)
        driver.run_until_idle()
        driver.flush_cache()
    outputs = {rid: result.output_ids for rid, result in driver.results.items()}
    driver.close()
    return outputs


def _run_with_fault(model_dir: str, times: int | None, chunk: int | None, **args):
    driver = SchedulerDriver(model_dir, **args)
    fault = FailingForward(driver.runner, PROMPTS["doomed"][-1] if chunk else PROMPTS["doomed"][0], times)
    try:
        driver.submit("a", PROMPTS["a"], max_new_tokens=MAX_NEW)
        driver.submit("b", PROMPTS["b"], max_new_tokens=MAX_NEW)
        driver.step()
        driver.step()  # a and b decode while the doomed prompt arrives
        driver.submit("doomed", PROMPTS["doomed"], max_new_tokens=MAX_NEW)
        results = driver.run_until_idle()
    finally:
        fault.remove()
    assert fault.fired
    return driver, results


CASES = [pytest.param(overlap, chunk, id=f"{'overlap' if overlap else 'no-overlap'}-{'chunked' if chunk else 'whole'}")
         for overlap in (False, True) for chunk in (None, 8)]


@pytest.mark.parametrize("overlap, chunk", CASES)
def test_a_batch_that_runs_out_of_device_memory_once_is_retried(tiny_model_dir, overlap, chunk):
    model_dir = tiny_model_dir("llama")
    args = {"disable_overlap_schedule": not overlap, "chunked_prefill_size": chunk or -1, "max_total_tokens": 256}
    expected = _alone(model_dir, **args)
    driver, results = _run_with_fault(model_dir, 1, chunk, **args)
    assert {rid: r.output_ids for rid, r in results.items()} == expected
    assert driver.scheduler.stats.num_failed_batches == 0
    driver.close()


@pytest.mark.parametrize("overlap, chunk", CASES)
def test_a_batch_that_cannot_fit_fails_alone(tiny_model_dir, overlap, chunk):
    model_dir = tiny_model_dir("llama")
    args = {"disable_overlap_schedule": not overlap, "chunked_prefill_size": chunk or -1, "max_total_tokens": 256}
    expected = _alone(model_dir, **args)
    driver, results = _run_with_fault(model_dir, None, chunk, **args)
    failed = results["doomed"].finish_reason
    assert failed["type"] == "abort" and failed["status_code"] == 503, failed
    assert "out of device memory" in failed["message"]
    assert results["a"].output_ids == expected["a"] and results["b"].output_ids == expected["b"]
    assert driver.scheduler.stats.num_failed_batches == 1

    # No slot of the failed batch stayed in the tree: the same prompt again computes its normal output.
    driver.submit("doomed-again", PROMPTS["doomed"], max_new_tokens=MAX_NEW)
    again = driver.run_until_idle()["doomed-again"]
    assert again.output_ids == expected["doomed"] and again.cached_tokens == 0
    driver.close()
