"""A streaming request's stop strings cross the scheduler -> detokenizer socket once, with its first output; the
detokenizer keeps them for the rest of the request, so the text is still cut at a stop string found many steps
later. A real scheduler process over ZMQ, its messages fed to a real DetokenizerManager."""

from __future__ import annotations

import pytest

from radixserve.detokenizer_manager.manager import DetokenizerManager
from radixserve.runtime.model_files import load_tokenizer
from radixserve.runtime.wire.messages import BatchTokenOut, ProcessReady, SamplingParams, TokenizedGenerateReq
from radixserve.runtime.wire.server_args import ServerArgs
from test_scheduler_process import START_TIMEOUT_S, start

pytestmark = pytest.mark.timeout(300)

MAX_NEW_TOKENS = 24


def _run(peer, rid: str, prompt: list[int], stop: list[str]) -> list[BatchTokenOut]:
    peer.send(TokenizedGenerateReq(rid=rid, input_ids=prompt, stream=True, sampling_params=SamplingParams(
        max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True, stop=stop)))
    messages = []
    while not messages or messages[-1].finish_reasons[0] is None:
        message = peer.recv(60)
        assert isinstance(message, BatchTokenOut) and message.rids == [rid]
        messages.append(message)
    return messages


def test_stop_strings_are_sent_once_and_still_cut_the_stream(default_model_dir):
    tokenizer = load_tokenizer(default_model_dir)
    prompt = list(tokenizer.encode("Here is a list of fruits: apple, banana,"))
    process, peer, ipc = start(ServerArgs(model_path=default_model_dir, device="cpu", log_level="warning"))
    try:
        assert isinstance(peer.recv(START_TIMEOUT_S), ProcessReady)
        plain = _run(peer, "plain", prompt, [])
        ids = [token for message in plain for token in message.new_token_ids[0]]
        text = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        # A stop string that first appears well into the output: the text of tokens 12..14.
        head = tokenizer.decode(ids[:12], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        stop = text[len(head):][:6]
        assert stop.strip() and text.find(stop) >= len(head) // 2, (text, stop)
        stops = [stop, "never-in-the-output-\u2603"]

        messages = _run(peer, "stopped", prompt, stops)
    finally:
        process.kill()
        process.join(10)
        peer.close()
        ipc.remove()
    assert len(messages) >= 10  # one message per decode step
    assert messages[0].stop == [stops]
    assert all(message.stop == [[]] for message in messages[1:])
    detokenizer = DetokenizerManager(tokenizer)
    streamed = "".join(detokenizer.handle(message).text_deltas[0] for message in messages)
    assert streamed == text[: text.find(stop)]
    assert not detokenizer.decoders  # the request's state (its stop strings too) is gone with it
