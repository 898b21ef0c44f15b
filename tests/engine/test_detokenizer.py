"""Incremental detokenization against the reference: tokenizer.decode of all ids at once, cut at a stop string.

Runs on the default model's real tokenizer (byte-level BPE, so CJK and emoji span several tokens).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.detokenizer_manager.incremental import IncrementalDecoder
from radixserve.detokenizer_manager.manager import DetokenizerManager
from radixserve.runtime.model_files import load_tokenizer
from radixserve.runtime.wire.messages import BatchTokenOut, FinishReason

TEXTS = [
    "你好，世界！今天天气很好。",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧‍👦 done",
    "日本語のテキストと한국어 텍스트, mixed with English.",
    "Ünïcödé àccents — dashes… and “quotes”",
    "plain ascii with  double spaces\nand newlines\n\n",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def reference(tokenizer, ids, skip_special_tokens=True, stop=()):
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[: min(cuts)] if cuts else text


def stream(tokenizer, ids, chunk_sizes, skip_special_tokens=True, stop=()):
    """Push ids in chunks of the given sizes; return the deltas (the last push has finished=True)."""
    decoder = IncrementalDecoder(tokenizer, skip_special_tokens=skip_special_tokens, stop=stop)
    deltas, pos = [], 0
    sizes = iter(chunk_sizes)
    while pos < len(ids):
        size = max(1, next(sizes, 1))
        piece = ids[pos : pos + size]
        pos += size
        deltas.append(decoder.push(piece, finished=pos >= len(ids)))
    if not ids:
        deltas.append(decoder.push([], finished=True))
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    deltas = stream(tokenizer, ids, [1] * len(ids))
    assert "".join(deltas) == text == reference(tokenizer, ids)
    assert not any("\ufffd" in d for d in deltas), "a delta held a broken character"


def test_multibyte_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("😀")
    assert len(ids) > 1, "the emoji should span several byte-level tokens for this test"
    decoder = IncrementalDecoder(tokenizer)
    assert [decoder.push([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.push([ids[-1]]) == "😀"


def test_finish_flushes_an_incomplete_character(tokenizer):
    ids = tokenizer.encode("ab😀")[:-1]  # drop the emoji's last byte token
    deltas = stream(tokenizer, ids, [1] * len(ids))
    assert "".join(deltas) == reference(tokenizer, ids)
    assert "".join(deltas).endswith("\ufffd")


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip):
    ids = [1] + tokenizer.encode("assistant\nHello 你好") + [2, 0] + tokenizer.encode(" after")
    deltas = stream(tokenizer, ids, [1] * len(ids), skip_special_tokens=skip)
    assert "".join(deltas) == reference(tokenizer, ids, skip_special_tokens=skip)
    assert ("<|im_start|>" in "".join(deltas)) is (not skip)


def test_stop_string_split_across_tokens(tokenizer):
    text = "The answer is 42. STOP_HERE and more text after it"
    ids = tokenizer.encode(text)
    stop = ["STOP_HERE"]
    decoder = IncrementalDecoder(tokenizer, stop=stop)
    emitted = ""
    for i, t in enumerate(ids):
        emitted += decoder.push([t], finished=i == len(ids) - 1)
        assert "S" not in emitted.split("42.")[-1], "a partial stop string was streamed"
    assert emitted == "The answer is 42. "
    assert decoder.stopped


def test_stop_prefix_released_when_it_turns_out_not_to_stop(tokenizer):
    ids = tokenizer.encode("Say STOP, no: STOPS? fine")
    stop = "STOPPED"
    decoder = IncrementalDecoder(tokenizer, stop=[stop])
    emitted = ""
    for i, t in enumerate(ids):
        emitted += decoder.push([t])
        # Nothing that could still grow into the stop string has been shown: no shown position p starts
        # a suffix of the text so far that is a prefix of the stop string.
        so_far = reference(tokenizer, ids[: i + 1])
        assert so_far.startswith(emitted)
        assert not any(stop.startswith(so_far[p:]) for p in range(len(emitted)))
    emitted += decoder.push([], finished=True)
    assert emitted == "Say STOP, no: STOPS? fine"


def test_stop_string_in_first_token_and_cjk_stop(tokenizer):
    ids = tokenizer.encode("你好，世界！再见")
    assert "".join(stream(tokenizer, ids, [1] * len(ids), stop=["世界"])) == "你好，"
    assert "".join(stream(tokenizer, ids, [len(ids)], stop=["你"])) == ""


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta")
    assert "".join(stream(tokenizer, ids, [2] * len(ids), stop=["delta", " beta", "gamma"])) == "alpha"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_ids_random_chunks(tokenizer, data):
    """Any ids (broken UTF-8 included), any chunking, with stop strings taken from the text itself."""
    vocab = len(tokenizer)
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=0, max_size=40), label="ids")
    sizes = data.draw(st.lists(st.integers(1, 5), min_size=len(ids), max_size=len(ids)), label="chunk sizes")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    full = tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    stop = []
    if full and data.draw(st.booleans(), label="use stop"):
        start = data.draw(st.integers(0, len(full) - 1))
        stop = [full[start : start + data.draw(st.integers(1, 4))]]
    deltas = stream(tokenizer, ids, sizes, skip_special_tokens=skip, stop=stop)
    assert "".join(deltas) == reference(tokenizer, ids, skip_special_tokens=skip, stop=stop)


def test_random_cjk_emoji_text_random_chunks(tokenizer):
    rng = random.Random(0)
    alphabet = "你好世界天气中文字符😀🎉👍🏽ßéü abc,.!\n"
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = tokenizer.encode(text)
        sizes = [rng.randint(1, 4) for _ in ids]
        stop = [text[3:5]] if len(text) > 5 and rng.random() < 0.5 else []
        assert "".join(stream(tokenizer, ids, sizes, stop=stop)) == reference(tokenizer, ids, stop=stop)


def _batch(rids, new_ids, finished, stop=None):
    n = len(rids)
    return BatchTokenOut(
        rids=rids,
        new_token_ids=new_ids,
        finish_reasons=[FinishReason.max_length(1) if f else None for f in finished],
        prompt_tokens=[3] * n,
        completion_tokens=[len(x) for x in new_ids],
        cached_tokens=[0] * n,
        skip_special_tokens=[True] * n,
        spaces_between_special_tokens=[True] * n,
        stop=stop or [[] for _ in range(n)],
    )


def test_manager_routes_requests_and_drops_finished_state(tokenizer):
    manager = DetokenizerManager(tokenizer)
    a, b = tokenizer.encode("你好世界"), tokenizer.encode("emoji 😀 ok")
    texts = {"a": "", "b": ""}
    steps = max(len(a), len(b))
    for i in range(steps):
        rids = [r for r, ids in (("a", a), ("b", b)) if i < len(ids)]
        out = manager.handle(_batch(
            rids,
            [[(a if r == "a" else b)[i]] for r in rids],
            [i == len(a if r == "a" else b) - 1 for r in rids],
        ))
        assert out.rids == rids and out.prompt_tokens == [3] * len(rids)
        for r, delta in zip(out.rids, out.text_deltas):
            texts[r] += delta
    assert texts == {"a": "你好世界", "b": "emoji 😀 ok"}
    assert manager.decoders == {}, "finished requests must release their state"


def test_manager_abort_with_no_new_tokens(tokenizer):
    manager = DetokenizerManager(tokenizer)
    manager.handle(_batch(["r"], [tokenizer.encode("hi")], [False]))
    batch = _batch(["r"], [[]], [True])
    batch.finish_reasons[0] = FinishReason.abort("aborted")
    out = manager.handle(batch)
    assert out.text_deltas == [""] and out.finish_reasons[0].type == "abort"
    assert "r" not in manager.decoders


def test_manager_caps_live_states_lru(tokenizer):
    manager = DetokenizerManager(tokenizer, max_live_decoders=3)
    for rid in ["r0", "r1", "r2"]:
        manager.handle(_batch([rid], [[100]], [False]))
    manager.handle(_batch(["r0"], [[101]], [False]))  # r0 becomes most recent
    manager.handle(_batch(["r3"], [[102]], [False]))  # over the cap: r1 (least recent) goes
    assert list(manager.decoders) == ["r2", "r0", "r3"]
    assert manager.num_evicted == 1
