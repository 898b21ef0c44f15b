"""Decode batches reuse their sampling tensors while nothing in them changes per step (scheduler/sampling_reuse.py).

Units: which requests have per-step sampling, and when the last batch's tensors are handed out again. A real
scheduler on the embedded model: steady greedy and unseeded sampled decoding reuses them and gives the same
tokens as a scheduler that builds them every step; a seeded or penalised request never takes the shortcut.
"""

from __future__ import annotations

from radixserve.runtime.wire.messages import SamplingParams
from radixserve.scheduler.req import Req
from radixserve.scheduler.sampling_reuse import SamplingInfoReuse, has_per_step_sampling
from scheduler_driver import SchedulerDriver


def _req(rid: str, **params) -> Req:
    req = Req(rid, [1, 2, 3], SamplingParams(max_new_tokens=8, **params))
    req.kv_len = 4  # one output decided
    return req


def test_per_step_sampling_is_seeds_penalties_and_min_new_tokens():
    assert not has_per_step_sampling(_req("plain", temperature=0.7, top_p=0.9, top_k=20))
    for params in (dict(seed=3), dict(repetition_penalty=1.1), dict(frequency_penalty=0.5),
                   dict(presence_penalty=0.5), dict(min_new_tokens=4)):
        assert has_per_step_sampling(_req("x", **params)), params
    assert not has_per_step_sampling(_req("done", min_new_tokens=1))  # already past its minimum


def test_the_last_batch_is_handed_out_again_only_for_the_same_requests():
    reuse, built = SamplingInfoReuse(), []

    def build():
        built.append(object())
        return built[-1]

    a, b, seeded = _req("a"), _req("b"), _req("s", seed=1)
    first = reuse.get([a, b], [True, True], build)
    assert reuse.get([a, b], [True, True], build) is first and reuse.num_reused == 1
    assert reuse.get([b, a], [True, True], build) is not first  # another order
    assert reuse.get([a], [True], build) is built[-1] and len(built) == 3
    assert reuse.get([a, seeded], [True, True], build) is built[-1] and len(built) == 4
    assert reuse.get([a, seeded], [True, True], build) is built[-1] and len(built) == 5  # never kept
    assert reuse.get([a, b], [True, False], build) is built[-1] and len(built) == 6  # a chunk samples nothing


def _run(model_dir, reuse: bool):
    driver = SchedulerDriver(model_dir, max_total_tokens=4096)
    if not reuse:
        driver.scheduler.batch_builder.sampling_reuse = None
    # The seeded, penalised and min_new_tokens requests stop after 6 tokens; the other two go on to 16 alone.
    specs = [dict(temperature=0.0, max_new_tokens=16), dict(temperature=0.8, seed=7, max_new_tokens=6),
             dict(temperature=0.0, frequency_penalty=0.4, max_new_tokens=6),
             dict(temperature=0.0, min_new_tokens=5, max_new_tokens=6), dict(temperature=0.9, max_new_tokens=16)]
    for i, params in enumerate(specs):
        driver.submit(f"r{i}", [100 + 37 * i + j for j in range(12)], ignore_eos=True, **params)
    driver.run_until_idle()
    outputs = driver.outputs()
    reused = driver.scheduler.batch_builder.sampling_reuse.num_reused if reuse else 0
    driver.close()
    return outputs, reused


def test_a_scheduler_reusing_the_tensors_gives_the_same_tokens(default_model_dir):
    expected, _ = _run(default_model_dir, reuse=False)
    outputs, reused = _run(default_model_dir, reuse=True)
    assert [len(o) for o in outputs] == [16, 6, 6, 6, 16]
    assert outputs[:4] == expected[:4]  # the last one samples without a seed: its draws differ run to run
    assert reused >= 5  # the steps after the seeded, penalised and min_new_tokens requests finished
