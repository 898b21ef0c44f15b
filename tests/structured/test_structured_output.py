"""Structured output (xgrammar) on the embedded model, through a real Scheduler in-process.

- 50 random JSON schemas from a hypothesis strategy (nested objects, arrays, enums, bounded numbers, required
  fields), all in one batch with unconstrained requests: every constrained output that did not hit
  max_new_tokens validates against its schema, most finish on their own, and the unconstrained requests give
  exactly the tokens they give alone; with the overlap scheduler on and off.
- Regex and EBNF constraints fully match; the end of a grammar forces EOS (even with ignore_eos).
- A bad grammar fails only its own request; identical grammars compile once; a request waits in the grammar
  queue until its grammar is compiled; under overlap, masks are filled after the previous batch's tokens.
- Constrained outputs survive retraction (a KV pool too small for the batch) unchanged.

Greedy decoding throughout, so every expectation is deterministic.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from radixserve.runtime.model_files import load_tokenizer
from scheduler_driver import SchedulerDriver

OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
NUM_SCHEMAS = 50
JSON_MAX_NEW_TOKENS = 128
FREE_QUESTIONS = ["Name a fruit.", "What is 2 + 2?", "Say hello in French.", "Name a planet."]
FREE_MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def chat_ids(tokenizer, question: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"])


def text_of(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def run_all(driver: SchedulerDriver) -> dict:
    """Run until idle, first letting the queued grammars compile (the driver's loop does not sleep, so it
    would otherwise spin through its step budget while the compiler thread works)."""
    driver.scheduler.grammars.wait_for_queue(timeout=60.0)
    return driver.run_until_idle()


# ---- random JSON schemas ------------------------------------------------------------------------------
NAMES = ["id", "name", "age", "price", "tags", "city", "active", "kind", "score", "items", "owner", "level"]


def _leaf_schemas() -> st.SearchStrategy[dict]:
    def integer(bounds: tuple[int, int]) -> dict:
        low, high = sorted(bounds)
        return {"type": "integer", "minimum": low, "maximum": high}

    def number(bounds: tuple[int, int]) -> dict:
        low, high = sorted(bounds)
        return {"type": "number", "minimum": low / 2, "maximum": high / 2 + 1}

    return st.one_of(
        st.tuples(st.integers(-50, 50), st.integers(-50, 500)).map(integer),
        st.tuples(st.integers(-20, 20), st.integers(-20, 100)).map(number),
        st.integers(1, 12).map(lambda n: {"type": "string", "maxLength": n}),
        st.just({"type": "boolean"}),
        st.lists(st.sampled_from(["red", "green", "blue", "small", "large", "yes", "no"]), min_size=1, max_size=4,
                 unique=True).map(lambda values: {"enum": values}),
        st.lists(st.integers(0, 9), min_size=2, max_size=3, unique=True).map(lambda v: {"type": "integer", "enum": v}),
    )


def _object_of(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    @st.composite
    def build(draw) -> dict:
        names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
        properties = {name: draw(children) for name in names}
        required = [name for name in names if draw(st.booleans())] or names[:1]
        return {"type": "object", "properties": properties, "required": required}
    return build()


def _array_of(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.tuples(children, st.integers(0, 1), st.integers(1, 3)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": max(t[1], t[2])})


def json_schemas() -> st.SearchStrategy[dict]:
    """Objects of depth <= 3 whose properties are leaves, arrays of leaves or objects, or nested objects."""
    leaves = _leaf_schemas()
    inner = st.one_of(leaves, _array_of(leaves), _object_of(leaves))
    return _object_of(st.one_of(leaves, leaves, _array_of(inner), _object_of(inner)))


@pytest.fixture(scope="module")
def free_alone(default_model_dir, tokenizer) -> list[list[int]]:
    """The unconstrained requests' outputs when they run on their own."""
    driver = SchedulerDriver(default_model_dir, tokenizer=tokenizer, disable_overlap_schedule=True)
    for i, question in enumerate(FREE_QUESTIONS):
        driver.submit(f"free{i}", chat_ids(tokenizer, question), max_new_tokens=FREE_MAX_NEW_TOKENS)
    outputs = [r.output_ids for r in driver.run_until_idle().values()]
    driver.close()
    return outputs


def draw_schemas(count: int) -> list[dict]:
    """`count` distinct schemas from `json_schemas()`, the same on every run: hypothesis's first examples
    are its simplest, so every 4th of 4 x count generated examples is kept, for variety."""
    found: dict[str, dict] = {}

    @settings(max_examples=5 * count, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(json_schemas())
    def collect(schema: dict) -> None:
        found.setdefault(json.dumps(schema, sort_keys=True), schema)

    collect()
    schemas = list(found.values())[::4][:count]
    assert len(schemas) == count
    return schemas


@pytest.fixture(scope="module")
def random_schemas() -> list[dict]:
    return draw_schemas(NUM_SCHEMAS)


@OVERLAP
def test_random_json_schemas_validate_in_a_mixed_batch(overlap, random_schemas, default_model_dir, tokenizer,
                                                       free_alone):
    schemas = random_schemas
    driver = SchedulerDriver(default_model_dir, tokenizer=tokenizer, disable_overlap_schedule=not overlap)
    prompt = chat_ids(tokenizer, "Describe one thing as a JSON object.")
    for i, schema in enumerate(schemas):
        driver.submit(f"json{i}", prompt, max_new_tokens=JSON_MAX_NEW_TOKENS, json_schema=json.dumps(schema))
        if i % 13 == 0:  # unconstrained requests interleaved with the constrained ones
            j = i // 13
            driver.submit(f"free{j}", chat_ids(tokenizer, FREE_QUESTIONS[j]), max_new_tokens=FREE_MAX_NEW_TOKENS)
    results = run_all(driver)
    assert driver.scheduler.grammars.num_deferred_masks > 0 if overlap else (
        driver.scheduler.grammars.num_deferred_masks == 0)
    driver.close()

    assert [results[f"free{j}"].output_ids for j in range(len(FREE_QUESTIONS))] == free_alone
    finished_by_grammar = 0
    for i, schema in enumerate(schemas):
        result = results[f"json{i}"]
        text = text_of(tokenizer, result.output_ids)
        if result.finish_reason["type"] == "length":
            assert result.completion_tokens == JSON_MAX_NEW_TOKENS
            continue
        assert result.finish_reason == {"type": "stop", "matched": 2}, (schema, text, result.finish_reason)
        jsonschema.validate(json.loads(text), schema)
        finished_by_grammar += 1
    assert finished_by_grammar >= 0.8 * NUM_SCHEMAS, f"only {finished_by_grammar} of {NUM_SCHEMAS} outputs finished"


# ---- regex, EBNF, end of grammar ---------------------------------------------------------------------
REGEX_CASES = [
    ("What is today's date?", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    ("Give me a phone number.", r"\(\d{3}\) \d{3}-\d{4}"),
    ("Give me a phone number.", r"\+1-\d{3}-\d{3}-\d{4}"),
    ("Is the sky blue?", r"(yes|no)"),
    ("Is fire cold? Answer yes or no.", r"(Yes|No)\."),
    ("Pick a number.", r"[1-9][0-9]?"),
]


SCHEDULES = {
    "no-overlap": {"disable_overlap_schedule": True},
    "overlap": {"disable_overlap_schedule": False},
    "overlap-mixed-chunks": {"enable_mixed_chunk": True, "chunked_prefill_size": 16, "disable_overlap_schedule": False},
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_regex_and_ebnf_outputs_fully_match(schedule, default_model_dir, tokenizer):
    """Also with decode steps riding in chunked extend batches (mixed chunks), whose masks wait for the
    previous batch's tokens just like decode batches' do."""
    driver = SchedulerDriver(default_model_dir, tokenizer=tokenizer, **SCHEDULES[schedule])
    for i, (question, pattern) in enumerate(REGEX_CASES):
        driver.submit(f"re{i}", chat_ids(tokenizer, question), max_new_tokens=24, regex=pattern)
    # ignore_eos does not outlive the grammar: once it is complete and can go no further, EOS ends it.
    driver.submit("ignore-eos", chat_ids(tokenizer, "Is the sky blue?"), max_new_tokens=24, regex="(yes|no)",
                  ignore_eos=True)
    grammar = 'root ::= "The answer is " ("red" | "green" | "blue") "."'
    driver.submit("ebnf", chat_ids(tokenizer, "Name a color."), max_new_tokens=24, ebnf=grammar)
    driver.submit("free", chat_ids(tokenizer, "Name a fruit."), max_new_tokens=8)
    results = run_all(driver)
    if schedule == "overlap-mixed-chunks":
        assert driver.scheduler.stats.mixed_batches > 0
    driver.close()
    for i, (_, pattern) in enumerate(REGEX_CASES):
        result = results[f"re{i}"]
        assert result.finish_reason == {"type": "stop", "matched": 2}
        assert re.fullmatch(pattern, text_of(tokenizer, result.output_ids)), (pattern, result.output_ids)
    ignore_eos = results["ignore-eos"]
    assert re.fullmatch("(yes|no)", text_of(tokenizer, ignore_eos.output_ids))
    assert ignore_eos.finish_reason == {"type": "stop", "matched": 2}
    assert re.fullmatch(r"The answer is (red|green|blue)\.", text_of(tokenizer, results["ebnf"].output_ids))
    assert results["free"].finish_reason is not None


def test_a_bad_grammar_fails_only_its_own_request(default_model_dir, tokenizer):
    prompt = chat_ids(tokenizer, "Name a fruit.")
    driver = SchedulerDriver(default_model_dir, tokenizer=tokenizer)
    driver.submit("alone", prompt, max_new_tokens=8)
    alone = driver.run_until_idle()["alone"].output_ids
    bad = {"bad-regex": {"regex": "([a-z"}, "bad-schema": {"json_schema": '{"type": "integer", "minimum": 5, '
                                                                          '"maximum": 1}'},
           "bad-json": {"json_schema": "{not json"}, "bad-ebnf": {"ebnf": "root ::= undefined_rule"}}
    for rid, params in bad.items():
        driver.submit(rid, prompt, max_new_tokens=8, **params)
    driver.submit("good", prompt, max_new_tokens=8)
    driver.submit("good-regex", prompt, max_new_tokens=8, regex="[A-Z][a-z]+")
    results = run_all(driver)
    driver.close()
    assert results["good"].output_ids == alone
    assert re.fullmatch("[A-Z][a-z]+", text_of(tokenizer, results["good-regex"].output_ids))
    messages = {rid: results[rid].finish_reason for rid in bad}
    assert all(reason["type"] == "abort" and results[rid].output_ids == [] for rid, reason in messages.items())
    assert messages["bad-regex"]["message"].startswith("invalid regex: ")
    assert "minimum" in messages["bad-schema"]["message"]
    assert messages["bad-json"]["message"].startswith("invalid json_schema: ")
    assert "undefined_rule" in messages["bad-ebnf"]["message"]


def test_grammar_queue_and_compile_cache(default_model_dir, tokenizer):
    """A request waits outside the scheduler's queue until its grammar is compiled; an identical grammar
    (even in a batch of concurrent requests) is compiled once."""
    driver = SchedulerDriver(default_model_dir, tokenizer=tokenizer)
    sched = driver.scheduler
    schema = json.dumps({"type": "object", "properties": {"fruit": {"enum": ["apple", "pear", "plum"]}},
                         "required": ["fruit"]})
    prompt = chat_ids(tokenizer, "Name a fruit as JSON.")
    for i in range(4):
        driver.submit(f"r{i}", prompt, max_new_tokens=20, json_schema=schema)
    assert sched.grammars.num_queued == 4 and not sched.waiting and not sched.is_idle()
    assert sched.server_info().num_queued_reqs == 4
    results = run_all(driver)
    cache = sched.grammars.cache
    assert cache.num_compiled == 1 and cache.num_hits == 3
    driver.submit("again", prompt, max_new_tokens=20, json_schema=schema)
    results = run_all(driver)
    driver.close()
    assert cache.num_compiled == 1
    outputs = {json.dumps(json.loads(text_of(tokenizer, r.output_ids))) for r in results.values()}
    assert len(outputs) == 1 and json.loads(outputs.pop())["fruit"] in ("apple", "pear", "plum")


def test_an_aborted_request_leaves_the_grammar_queue(default_model_dir, tokenizer):
    driver = SchedulerDriver(default_model_dir, tokenizer=tokenizer)
    driver.submit("queued", chat_ids(tokenizer, "Hi"), max_new_tokens=4, regex="[a-z]+ [a-z]+")
    driver.abort("queued")
    results = run_all(driver)
    driver.close()
    assert driver.scheduler.grammars.num_queued == 0
    assert results["queued"].finish_reason["type"] == "abort" and results["queued"].output_ids == []


def test_constrained_outputs_survive_retraction(default_model_dir, tokenizer):
    """A KV pool too small for the whole batch retracts requests; their matchers keep their state, so the
    outputs are those of a run with room for all of them."""
    # Six 3-digit numbers: an output of about 30 tokens that cannot stop early.
    schema = json.dumps({"type": "array", "items": {"type": "integer", "minimum": 100, "maximum": 999},
                         "minItems": 6, "maxItems": 6})
    prompts = [chat_ids(tokenizer, f"List some numbers about {topic}.")
               for topic in ("cats", "cities", "cars", "trees")]

    def run(**args) -> tuple[list[list[int]], int]:
        driver = SchedulerDriver(default_model_dir, tokenizer=tokenizer, **args)  # overlap on
        for i, prompt in enumerate(prompts):
            driver.submit(f"r{i}", prompt, max_new_tokens=40, json_schema=schema)
        outputs = [r.output_ids for r in run_all(driver).values()]
        retractions = driver.scheduler.stats.num_retractions
        driver.close()
        return outputs, retractions

    roomy, _ = run()
    tight, retractions = run(max_total_tokens=128, schedule_conservativeness=0.05)
    assert retractions > 0
    assert tight == roomy
    for output in tight:
        jsonschema.validate(json.loads(text_of(tokenizer, output)), json.loads(schema))


def test_a_grammar_that_outlasts_the_compile_timeout_fails_only_its_request(default_model_dir, tokenizer):
    """--grammar-compile-timeout: a request whose grammar is still compiling when the time is up ends with an abort
    naming the flag, and the scheduler goes on serving the others meanwhile."""
    driver = SchedulerDriver(default_model_dir, tokenizer=tokenizer, grammar_compile_timeout=0.05)
    prompt = chat_ids(tokenizer, "Name a colour.")
    # A long bounded repetition unrolls into thousands of states: 0.3-1.3 s of compilation over a 49k vocabulary on
    # the CPUs measured (less where xgrammar has met a similar one in this process: the character class is this
    # test's own).
    driver.submit("slow", prompt, max_new_tokens=8, regex="[b-y2-7 ]{1,3000}q")
    driver.submit("free", prompt, max_new_tokens=4)
    driver.scheduler.grammars.wait_for_queue(timeout=0.15)  # past the timeout, well before the compilation ends
    results = driver.run_until_idle()
    assert results["slow"].finish_reason["type"] == "abort" and results["slow"].output_ids == []
    assert "--grammar-compile-timeout" in results["slow"].finish_reason["message"]
    assert results["free"].finish_reason["type"] in ("length", "stop") and results["free"].output_ids
    assert driver.scheduler.grammars.num_queued == 0
    driver.close()
