"""Prompt-token logprobs (`return_logprob` + `logprob_start_len`) against Hugging Face transformers.

The embedded model through a real Scheduler in-process; the reference is transformers' forward pass on the
same float32 weights, log_softmax'ed. The logprobs must agree (allclose) from any start position, with and
without a prefix served from the radix cache, with chunked prefill of 16 tokens, with pages of 4 tokens,
with the overlap scheduler on and off, and for max_new_tokens=0 (scoring only). The cache rule is checked
too: a request asking for logprobs from position s reuses at most s - 1 cached tokens.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.runtime.model_files import load_tokenizer
from radixserve.runtime.wire.messages import BatchTokenOut, SamplingParams, TokenizedGenerateReq
from scheduler_driver import Result, SchedulerDriver

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It then ran into the forest and was never seen again.",
    "Paris is the capital of France, and Berlin is the capital of Germany. Rome is the capital of",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
]
TOP_K = 3
ATOL = 2e-4


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(text) for text in TEXTS]


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """`[len, vocab]` log_softmax of transformers' logits (row p is the distribution of token p + 1)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module")
def reference(hf_model, prompts) -> list[torch.Tensor]:
    return [hf_logprobs(hf_model, ids) for ids in prompts]


class LogprobDriver(SchedulerDriver):
    """A SchedulerDriver that also keeps each request's input_token_logprobs / input_top_logprobs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.input_logprobs: dict[str, list] = {}
        self.input_top: dict[str, list] = {}
        take = self.scheduler.take_outputs

        def take_and_record() -> list:
            messages = take()
            for message in messages:
                if isinstance(message, BatchTokenOut) and message.input_token_logprobs:
                    for i, rid in enumerate(message.rids):
                        if message.input_token_logprobs[i] is not None:
                            assert rid not in self.input_logprobs, f"{rid}: input logprobs sent twice"
                            self.input_logprobs[rid] = message.input_token_logprobs[i]
                            self.input_top[rid] = message.input_top_logprobs[i]
            return messages

        self.scheduler.take_outputs = take_and_record

    def score(self, rid: str, ids: list[int], start: int, max_new_tokens: int = 1, top: int = TOP_K,
              stream: bool = False) -> None:
        """Submit a greedy request for the prompt logprobs of `ids` from position `start`."""
        self.results[rid] = Result()
        self.scheduler.handle_message(TokenizedGenerateReq(
            rid=rid, input_ids=list(ids), sampling_params=SamplingParams(max_new_tokens=max_new_tokens,
                                                                         temperature=0.0),
            return_logprob=True, logprob_start_len=start, top_logprobs_num=top, stream=stream))


def check_against_reference(driver: LogprobDriver, rid: str, ids: list[int], start: int, ref: torch.Tensor,
                            top: int = TOP_K) -> None:
    got = driver.input_logprobs[rid]
    assert len(got) == len(ids) - start, (rid, len(got), len(ids), start)
    for offset, logprob in enumerate(got):
        position = start + offset
        if position == 0:
            assert logprob is None
            continue
        expected = ref[position - 1, ids[position]].item()
        assert logprob == pytest.approx(expected, abs=ATOL), (rid, position)
    tops = driver.input_top[rid]
    assert len(tops) == (len(got) if top else 0)
    for offset, alternatives in enumerate(tops):
        position = start + offset
        if position == 0:
            assert alternatives is None
            continue
        values, token_ids = torch.topk(ref[position - 1], top)
        assert [token_id for token_id, _ in alternatives] == token_ids.tolist()
        assert [lp for _, lp in alternatives] == pytest.approx(values.tolist(), abs=ATOL)


CONFIGS = {
    "plain": {},
    "plain-overlap": {"disable_overlap_schedule": False},
    "chunk16": {"chunked_prefill_size": 16},
    "chunk16-overlap-pages4": {"chunked_prefill_size": 16, "page_size": 4, "disable_overlap_schedule": False},
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_prompt_logprobs_equal_transformers(config, default_model_dir, tokenizer, prompts, reference):
    args = {"disable_overlap_schedule": True, **CONFIGS[config]}
    driver = LogprobDriver(default_model_dir, tokenizer=tokenizer, **args)
    starts = [0, 5, len(prompts[2]) - 1]
    # Fresh prompts, all in one batch (chunked, several chunks per prompt), from different start positions.
    for i, (ids, start) in enumerate(zip(prompts, starts)):
        driver.score(f"fresh{i}", ids, start)
    driver.run_until_idle()
    for i, (ids, start) in enumerate(zip(prompts, starts)):
        check_against_reference(driver, f"fresh{i}", ids, start, reference[i])
        assert driver.results[f"fresh{i}"].cached_tokens == 0

    # The prompts are cached now: the cached part is reused only up to logprob_start_len - 1.
    page = args.get("page_size", 1)
    ids = prompts[0]
    for start in (0, 1, 2, 9, 17, len(ids) - 1, len(ids)):
        rid = f"cached-from-{start}"
        driver.score(rid, ids, start)
        driver.run_until_idle()
        check_against_reference(driver, rid, ids, start, reference[0])
        limit = min(max(start - 1, 0), len(ids) - 1)
        assert driver.results[rid].cached_tokens == limit // page * page, rid
    # Without input logprobs the whole cached prefix is reused, and a scoring-only request works too.
    driver.submit("no-logprobs", ids, max_new_tokens=1)
    driver.score("score-only", prompts[1], 10, max_new_tokens=0, top=0)
    driver.run_until_idle()
    assert driver.results["no-logprobs"].cached_tokens == (len(ids) - 1) // page * page
    check_against_reference(driver, "score-only", prompts[1], 10, reference[1], top=0)
    assert driver.results["score-only"].output_ids == []
    assert driver.results["score-only"].finish_reason == {"type": "length", "length": 0}
    driver.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_streamed_request_gets_them_once_with_its_first_tokens(overlap, default_model_dir, tokenizer, prompts,
                                                               hf_model):
    """A prompt of 4 chunks of 16 tokens, streamed: the logprobs arrive once (the driver checks), complete,
    while the prompt's KV is computed chunk by chunk alongside another request's decode."""
    driver = LogprobDriver(default_model_dir, tokenizer=tokenizer, chunked_prefill_size=16,
                           disable_overlap_schedule=not overlap)
    ids = (prompts[0] + prompts[1] + prompts[2])[:60]
    driver.submit("other", prompts[1], max_new_tokens=8)
    driver.step()
    driver.score("stream", ids, 3, max_new_tokens=4, top=0, stream=True)
    driver.run_until_idle()
    assert driver.results["stream"].num_messages >= 2 and len(driver.results["stream"].output_ids) == 4
    check_against_reference(driver, "stream", ids, 3, hf_logprobs(hf_model, ids), top=0)
    driver.close()
