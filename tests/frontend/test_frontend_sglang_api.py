"""The SGLang-compatible DSL names without a model: typed generation, reasoning splitting, streaming deltas,
global_config, the Runtime's command line, and the errors for what radixserve does not implement.

The programs themselves run on a real model in test_frontend_sglang_programs.py.
"""

from __future__ import annotations

import json
import re

import pytest

import radixserve as sgl
from radixserve.frontend.backends.base import BackendError, StreamDeltas
from radixserve.frontend.choices import ChoiceScores
from radixserve.frontend.dtypes import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR
from radixserve.frontend.global_config import GlobalConfig
from radixserve.frontend.ir import Concat, SeparateReasoning
from radixserve.frontend.reasoning import split_reasoning
from radixserve.frontend.runtime import Runtime, cli_flags
from radixserve.frontend.sampling import SamplingDefaults
from radixserve.frontend.tracing import constant_prefix
from radixserve.runtime.wire.server_args import ServerArgs


# ---- typed generation ----------------------------------------------------------------------------------

@pytest.mark.parametrize("regex, good, bad", [
    (REGEX_INT, ["24", "-7", "+365", "12 ", "3\n"], ["1.5", "", "a1", "--2"]),
    (REGEX_FLOAT, ["3.14", "-0.5", ".5", "2.", "1e-3", "7 "], ["", "1.2.3", "e5", "pi"]),
    (REGEX_BOOL, ["True", "False"], ["true", "yes", "1"]),
    (REGEX_STR, ['"Paris"', '""', '"a, b: c!"'], ['Paris', '"a"b"', '"a\\b"', '"a\nb"']),
])
def test_dtype_regexes_accept_exactly_values_of_their_type(regex, good, bad):
    for text in good:
        assert re.fullmatch(regex, text), text
        value = text.strip()
        if regex == REGEX_INT:
            int(value)
        elif regex == REGEX_FLOAT:
            float(value)
        elif regex == REGEX_STR:
            assert isinstance(json.loads(text), str)
    for text in bad:
        assert not re.fullmatch(regex, text), text


def test_dtype_becomes_a_regex_and_number_stops():
    defaults = SamplingDefaults.make(stop="END")
    params, _ = defaults.resolve(sgl.gen_int("n").params)
    assert params["regex"] == REGEX_INT and params["stop"] == ["END", " ", "\n"]
    params, _ = defaults.resolve(sgl.gen("x", dtype="float", stop=" ").params)
    assert params["regex"] == REGEX_FLOAT and params["stop"] == [" ", "\n"]
    params, _ = defaults.resolve(sgl.gen_string("s").params)
    assert params["regex"] == REGEX_STR and params["stop"] == ["END"]
    params, _ = defaults.resolve(sgl.gen("b", dtype=bool).params)
    assert params["regex"] == REGEX_BOOL and "dtype" not in params
    assert params["skip_special_tokens"] is True and params["spaces_between_special_tokens"] is True
    with pytest.warns(UserWarning, match="only the dtype is used"):
        both = sgl.gen("x", dtype=int, regex="[a-z]+")
    assert both.params.regex is None and both.params.dtype == "int"
    with pytest.raises(ValueError, match="unsupported dtype"):
        sgl.gen("x", dtype=list)
    with pytest.raises(TypeError, match="gen_int"):
        sgl.gen_int("x", regex="[0-9]")


def test_sglang_arguments_radixserve_does_not_implement_are_refused():
    assert sgl.gen("x", n=1) == sgl.gen("x")
    with pytest.raises(ValueError, match="n=2"):
        sgl.gen("x", n=2)
    with pytest.raises(ValueError, match="stop_regex"):
        sgl.gen("x", stop_regex="a+")
    with pytest.raises(ValueError, match="temperature must be 0"):
        sgl.select("x", ["a", "b"], temperature=0.5)
    with pytest.raises(ValueError, match="temperature must be 0"):
        sgl.gen("x", choices=["a", "b"], temperature=0.5)
    assert sgl.gen("x", choices=["a", "b"], temperature=0).choices == ("a", "b")


# ---- separate_reasoning ---------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type, text, reasoning, answer", [
    ("qwen3", "<think> add them </think> 4", "add them", "4"),
    ("qwen3", "just 4", "", "just 4"),                       # not in thinking: all answer
    ("qwen3", "<think>still thinking", "still thinking", ""),  # cut off inside the thinking
    ("deepseek-r1", "add them</think>\n\n4", "add them", "4"),  # forced: the opening tag was in the prompt
    ("deepseek-r1", "no closing tag", "no closing tag", ""),
    ("kimi", "\u25c1think\u25b7hmm\u25c1/think\u25b7 yes", "hmm", "yes"),
])
def test_split_reasoning(model_type, text, reasoning, answer):
    assert split_reasoning(text, model_type) == (reasoning, answer)


def test_separate_reasoning_expression():
    expr = sgl.separate_reasoning(sgl.gen("a") + " and " + sgl.gen("b"), model_type="deepseek-r1")
    assert isinstance(expr, Concat) and expr.parts[-1] == SeparateReasoning(("a", "b"), "deepseek-r1")
    with pytest.raises(ValueError, match="model_type"):
        sgl.separate_reasoning(sgl.gen("a"))
    with pytest.raises(ValueError, match="unknown reasoning model_type"):
        sgl.separate_reasoning(sgl.gen("a"), model_type="gpt-9")
    with pytest.raises(ValueError, match="named gen"):
        sgl.separate_reasoning("text", model_type="qwen3")
    with pytest.raises(ValueError, match="name"):
        sgl.separate_reasoning(sgl.gen(), model_type="qwen3")


# ---- streaming: both of SGLang's streaming modes become deltas -------------------------------------------

def _chunk(text, ids, entries=None):
    meta = {"completion_tokens": ids}
    if entries is not None:
        meta["output_token_logprobs"] = entries
    return {"text": text, "meta_info": meta}


def test_stream_deltas_from_whole_text_chunks():
    deltas = StreamDeltas(incremental=False)
    entries = [[-0.1, 1, None], [-0.2, 2, None], [-0.3, 3, None]]
    out = [deltas(_chunk("He", 1, entries[:1])), deltas(_chunk("Hello", 2, entries[:2])),
           deltas(_chunk("Hello", 2, entries[:2])), deltas(_chunk("Hello, world", 3, entries))]
    assert [chunk["text"] for chunk in out] == ["He", "llo", "", ", world"]
    assert [chunk["meta_info"]["output_token_logprobs"] for chunk in out] == \
        [entries[:1], entries[1:2], [], entries[2:]]
    with pytest.raises(BackendError, match="streaming mode"):
        deltas(_chunk("Goodbye", 4))


def test_stream_deltas_from_incremental_chunks():
    deltas = StreamDeltas(incremental=True)
    entries = [[-0.1, 1, None], [-0.2, 2, None], [-0.3, 3, None]]
    out = [deltas(_chunk("He", 1, entries[:1])), deltas(_chunk("llo", 2, entries[1:2])),
           deltas(_chunk("He", 3, entries[2:]))]  # a delta that repeats the text so far stays a delta
    assert [chunk["text"] for chunk in out] == ["He", "llo", "He"] and deltas.text == "HelloHe"
    assert [chunk["meta_info"]["output_token_logprobs"] for chunk in out] == [entries[:1], entries[1:2], entries[2:]]


# ---- global_config, flush_cache / get_server_info without a backend ----------------------------------------

def test_global_config():
    config = GlobalConfig()
    assert config.verbosity == 0 and config.enable_precache_with_tracing is True
    config.verbosity = 2
    assert config.verbosity == 2
    with pytest.raises(AttributeError, match="enable_parallel_encoding"):
        config.enable_parallel_encoding = True
    with pytest.raises(TypeError, match="bool"):
        config.skip_special_tokens_in_output = "no"
    assert sgl.global_config.default_backend is sgl.frontend.get_default_backend()


def test_server_helpers_without_a_backend():
    previous = sgl.frontend.get_default_backend()
    sgl.set_default_backend(None)
    try:
        assert sgl.flush_cache() is False and sgl.get_server_info() is None
        with pytest.raises(TypeError, match="not a backend"):
            sgl.flush_cache(object())
    finally:
        sgl.set_default_backend(previous)


# ---- select's meta_info carries SGLang's keys ------------------------------------------------------------

def test_choice_meta_info_has_sglang_keys():
    scores = ChoiceScores(choices=["yes", "no"], method="unconditional_likelihood_normalized", decision=1,
                          scores=[-0.5, -0.2], normalized_logprobs=[-1.0, -0.6], token_ids=[[5], [6, 7]],
                          token_texts=[[" yes"], [" n", "o"]], token_logprobs=[[-1.0], [-0.7, -0.5]],
                          unconditional_logprobs=[[-0.5], [-0.3, -0.5]])
    meta = scores.meta_info()
    assert meta["normalized_prompt_logprobs"] == [-1.0, -0.6]
    assert meta["input_token_logprobs"] == [[[-1.0, 5, " yes"]], [[-0.7, 6, " n"], [-0.5, 7, "o"]]]
    assert meta["output_token_logprobs"] == [[], []]
    assert meta["unconditional_token_logprobs"] == [[[-0.5, 5, " yes"]], [[-0.3, 6, " n"], [-0.5, 7, "o"]]]
    assert meta["normalized_unconditional_prompt_logprobs"] == [-0.5, -0.2]
    assert meta["decision"] == 1 and meta["token_logprobs"] == [[-1.0], [-0.7, -0.5]]


# ---- var_scope and tracing --------------------------------------------------------------------------------

def test_var_scope_markers_do_not_end_the_traced_prefix():
    from radixserve.frontend.chat_template import ChatTemplate

    def program(s, question):
        with s.var_scope("header"):
            s += "Header.\n"
        s += "Q: " + question

    template = ChatTemplate(prefixes={}, suffixes={})
    assert constant_prefix(program, ["question"], {}, lambda: template) == "Header.\n"


# ---- Runtime: server arguments become `radixserve serve` flags --------------------------------------------

def test_runtime_command_line():
    args = ServerArgs(model_path="/models/x", port=30001, max_running_requests=8, enable_mixed_chunk=True,
                      disable_overlap_schedule=True, mem_fraction_static=0.5, log_level="error")
    assert cli_flags(args) == ["--model-path", "/models/x", "--mem-fraction-static", "0.5",
                               "--max-running-requests", "8", "--enable-mixed-chunk", "--disable-overlap-schedule",
                               "--port", "30001", "--log-level", "error"]
    assert cli_flags(ServerArgs()) == []
    with pytest.raises(ValueError, match="enable_metrics=False"):
        cli_flags(ServerArgs(enable_metrics=False))


def test_runtime_rejects_bad_arguments_before_starting_anything():
    with pytest.raises(ValueError, match="unknown server argument"):
        Runtime(no_such_flag=1)
    with pytest.raises(ValueError, match="enable_metrics"):
        Runtime(enable_metrics=False)


def test_image_and_video_expressions():
    assert sgl.image("cat.png").kind == "image" and sgl.video("clip.mp4", 8).num_frames == 8
