"""One request's impossible constraints fail that request alone, with a clear error; the batch and the server go on.

A grammar that allows no token at some step (a regex that matches nothing, or one whose only continuation is the
end of sequence while `min_new_tokens` bans it) used to make the sampler draw the id equal to the vocabulary size,
which failed the whole batch and took the scheduler down. Now:
- detectable before the request runs (no first token): the request is refused (400 over HTTP, InvalidRequestError
  from the Engine) and never enters a batch;
- found mid-generation: the request finishes with an error (the same 400 / InvalidRequestError), the other
  requests of its batch produce exactly what they produce alone.
"""

from __future__ import annotations

import json

import httpx
import pytest

from http_fixtures import shared_server
from radixserve.runtime.model_files import load_tokenizer
from scheduler_driver import SchedulerDriver

MATCHES_NOTHING = r"[^\s\S]"  # a character class that admits no character
ONE_LETTER = "a"  # after "a" the grammar only allows EOS, which min_new_tokens=2 bans
FORTY_LETTERS = "(ab){20}"  # the same dead end some tokens in, well after the first token has gone out
SAMPLED = {"temperature": 1.0, "top_p": 0.9}


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_a_request_whose_constraints_leave_no_token_fails_alone(default_model_dir, tokenizer, overlap):
    prompt = tokenizer.encode("Name three fruits:")
    driver = SchedulerDriver(default_model_dir, tokenizer=tokenizer, disable_overlap_schedule=not overlap)
    driver.submit("alone", prompt, max_new_tokens=6)
    alone = driver.run_until_idle()["alone"].output_ids
    driver.submit("nothing", prompt, max_new_tokens=6, regex=MATCHES_NOTHING, return_logprob=True, **SAMPLED)
    driver.submit("banned-end", prompt, max_new_tokens=6, min_new_tokens=2, regex=ONE_LETTER, return_logprob=True,
                  top_logprobs_num=3, **SAMPLED)
    driver.submit("neighbour", prompt, max_new_tokens=6)
    driver.scheduler.grammars.wait_for_queue(timeout=60.0)
    results = driver.run_until_idle()
    driver.close()

    assert results["neighbour"].output_ids == alone
    nothing, banned_end = results["nothing"].finish_reason, results["banned-end"].finish_reason
    assert nothing["type"] == "abort" and nothing["status_code"] == 400 and "allows no first token" in nothing["message"]
    assert results["nothing"].output_ids == []
    # "a" is generated, then nothing is allowed: found mid-generation, in the sampler.
    assert results["banned-end"].output_ids == tokenizer.encode("a")
    assert banned_end["type"] == "abort" and banned_end["status_code"] == 400
    assert "no token satisfies" in banned_end["message"]


def test_the_engine_raises_a_typed_error_and_keeps_serving(engine):
    from radixserve import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="allows no first token"):
        engine.generate("Hello", {"max_new_tokens": 4, "regex": MATCHES_NOTHING, **SAMPLED}, return_logprob=True)
    with pytest.raises(InvalidRequestError, match="no token satisfies"):
        for _ in engine.generate("Hello", {"max_new_tokens": 4, "min_new_tokens": 2, "regex": ONE_LETTER, **SAMPLED},
                                 stream=True):
            pass
    out = engine.generate("Hello", {"max_new_tokens": 3, "temperature": 0})
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_extreme_temperatures_and_penalties_do_not_break_sampling(engine):
    """A tiny temperature means greedy (SGLang's rule); a tiny repetition penalty makes logits +inf, which must
    still sample a real token. Either used to draw the id equal to the vocabulary size and end the scheduler."""
    greedy = engine.generate("Hello", {"max_new_tokens": 3, "temperature": 0})["output_ids"]
    assert engine.generate("Hello", {"max_new_tokens": 3, "temperature": 1e-40})["output_ids"] == greedy
    vocab = engine.model_info.vocab_size
    for params in ({"repetition_penalty": 1e-40, "temperature": 1.0}, {"repetition_penalty": 1e-40, "temperature": 0},
                   {"repetition_penalty": 1e-40, "temperature": 1e-3, "top_p": 0.5}):
        out = engine.generate("hello hello hello", {"max_new_tokens": 3, **params}, return_logprob=True)
        assert len(out["output_ids"]) == 3 and all(0 <= t < vocab for t in out["output_ids"]), params
    assert engine.generate("Hello", {"max_new_tokens": 3, "temperature": 0})["output_ids"] == greedy


@pytest.fixture(scope="module")
def engine():
    from radixserve import Engine

    with Engine(log_level="warning") as engine:
        yield engine


@pytest.fixture(scope="module")
def server():
    return shared_server()


def test_over_http_the_request_gets_a_400_and_the_server_goes_on(server):
    headers = server.headers()
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "logprobs": True, "top_logprobs": 2,
            **SAMPLED}
    for body in ({**chat, "regex": MATCHES_NOTHING}, {**chat, "regex": MATCHES_NOTHING, "stream": True},
                 {**chat, "regex": ONE_LETTER, "min_tokens": 2}):
        response = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and "token" in error["message"]
        assert "Traceback" not in response.text
    # Found mid-stream, after the first token was sent: the stream ends with the error event. (With ONE_LETTER the
    # dead end comes one decode step after the first token, which a fast step can deliver together with it.)
    streamed = httpx.post(server.url + "/v1/chat/completions", headers=headers, timeout=60,
                          json={**chat, "max_tokens": 64, "regex": FORTY_LETTERS, "min_tokens": 63, "stream": True})
    events = [line[len("data: "):] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert streamed.status_code == 200 and events[-1] == "[DONE]"
    assert "no token satisfies" in json.loads(events[-2])["error"]["message"]
    native = httpx.post(server.url + "/generate", headers=headers, timeout=60, json={
        "text": "Hi", "sampling_params": {"max_new_tokens": 4, "regex": MATCHES_NOTHING, **SAMPLED},
        "return_logprob": True})
    assert native.status_code == 400, native.text
    fine = httpx.post(server.url + "/v1/completions", headers=headers, timeout=60,
                      json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert fine.status_code == 200 and fine.json()["choices"][0]["finish_reason"] == "length"
    server.wait_idle()
