"""Structured output (deepinfer.engine.structured_output) on the embedded tiny model with random
weights and DeepSeek's real tokenizer: the model never wants to comply, so every output that matches
does so only through the grammar's masks.

JSON schemas run with disable_any_whitespace (a random model otherwise spends its tokens on
whitespace) and bound every string, array and number, so each grammar completes well inside
max_tokens: the tests assert finish_reason "stop" and a valid document for every one of them.
"""

from __future__ import annotations

import json
import re
import sys
import threading

import jsonschema  # the test extra installs it and llguidance: missing, these tests fail rather than skip
import pytest

from deepinfer import SamplingParams, StructuredOutputsParams
from deepinfer.engine.sampling_params import InvalidRequestError

from hostile_grammars import UNSATISFIABLE, nested_schema

PROMPT = "Answer:"

# A point: reused inline and through $ref
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["x", "y"], "additionalProperties": False}  # fmt: skip
# 20 schemas of increasing difficulty: scalars with ranges and steps, enums, nullable types, flat
# objects with required and optional keys, string patterns, bounded arrays, const, anyOf, nested
# objects, arrays of objects, $ref, oneOf, and a record that combines them.
SCHEMAS = [
    {"type": "boolean"},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "number", "minimum": -1.5, "maximum": 2.5, "multipleOf": 0.25},
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100, "multipleOf": 5},
    {"type": ["string", "null"], "maxLength": 3},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}}, "required": ["code"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "size": {"type": "integer", "minimum": 1, "maximum": 3}},
     "required": ["color"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}, "name": {"type": "string", "maxLength": 4}},
     "required": ["x", "name"], "additionalProperties": False},
    {"type": "object", "properties": {"version": {"const": 2}, "kind": {"enum": ["x", "y"]}}, "required": ["version", "kind"], "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "enum": ["none"]}]},
    {"type": "object", "properties": {"point": POINT}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
                                      "id": {"type": "string", "pattern": "^[0-9]{4}$"}},
     "required": ["tags", "id"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"enum": ["u", "v"]}, "n": {"type": "integer", "minimum": 0, "maximum": 5}},
                                "required": ["k", "n"], "additionalProperties": False}, "minItems": 1, "maxItems": 2},
    {"$defs": {"point": POINT}, "type": "object", "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
     "required": ["from", "to"], "additionalProperties": False},
    {"oneOf": [{"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["kind", "r"], "additionalProperties": False},
               {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["kind", "side"], "additionalProperties": False}]},
    {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,5}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "emails": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}@[a-z]{1,4}\\.(com|org)$"}, "maxItems": 2},
        "address": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
     "required": ["name", "age", "address"], "additionalProperties": False},
]  # fmt: skip


def _params(max_tokens=120, seed=0, temperature=1.0, **structured) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=seed, temperature=temperature, structured_outputs=StructuredOutputsParams(**structured))


def accepted(api, spec: StructuredOutputsParams, token_ids: list[int]) -> bool:
    """Whether a fresh matcher of spec takes token_ids and may end there (or has ended, on EOS)."""
    matcher = api.engine._grammar_compiler().submit(spec).result().deep_copy()
    return all(matcher.consume_token(t) for t in token_ids) and (matcher.is_accepting() or matcher.is_stopped())


def test_json_schemas_validate(api):
    assert len(SCHEMAS) == 20
    params = [_params(json=schema, disable_any_whitespace=True, seed=i, max_tokens=60) for i, schema in enumerate(SCHEMAS)]
    for schema, p, out in zip(SCHEMAS, params, api.generate([PROMPT] * len(params), params, use_tqdm=False)):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)
        assert accepted(api, p.structured_outputs, completion.token_ids)


def test_json_object_and_whitespace(api):
    """json_object with default (flexible) whitespace: a JSON object when it completes; cut by max_tokens
    is allowed (the random model likes whitespace), then the text is a prefix that is still open."""
    out = api.generate([PROMPT], _params(json_object=True, max_tokens=24), use_tqdm=False)[0].outputs[0]
    assert out.text.startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:
        assert out.finish_reason == "length"


OCTET = "(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])"


@pytest.mark.parametrize(
    "regex",
    [r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)", rf"({OCTET}\.){{3}}{OCTET}"],
    ids=["date", "email", "ipv4"],
)
def test_regex(api, regex):
    params = [_params(regex=regex, seed=s, max_tokens=40) for s in (1, 2)]
    for p, out in zip(params, api.generate([PROMPT] * 2, params, use_tqdm=False)):
        assert out.outputs[0].finish_reason == "stop" and re.fullmatch(regex, out.outputs[0].text), out.outputs[0].text
        assert accepted(api, p.structured_outputs, out.outputs[0].token_ids)


ARITHMETIC = {
    "lark": 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[1-9]/',
    "ebnf": 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [1-9] | "(" expr ")"',  # GBNF, which llguidance converts to Lark
}


def parse_arithmetic(text: str, complete: bool) -> None:
    """Parse text by ARITHMETIC's grammar (recursive descent); complete=False: text may stop
    anywhere (an output cut by max_tokens is a prefix of a sentence). AssertionError otherwise."""
    at = 0

    def term() -> bool:  # False: the text ended inside it
        nonlocal at
        if at == len(text):
            return False
        if text[at] == "(":
            at += 1
            if not expr():
                return False
            if at == len(text):
                return False
            assert text[at] == ")", (text, at)
            at += 1
            return True
        assert text[at] in "123456789", (text, at)
        at += 1
        return True

    def expr() -> bool:
        nonlocal at
        if not term():
            return False
        while at < len(text) and text[at] in "+-":
            at += 1
            if not term():
                return False
        return True

    finished = expr()
    assert (finished and at == len(text)) if complete else at == len(text), text


@pytest.mark.parametrize("syntax", ["lark", "ebnf"])
def test_arithmetic_grammar(api, syntax):
    """The random model nests parentheses at will: an output may be cut by max_tokens, and is then
    a prefix of a sentence; a finished one parses and evaluates."""
    outs = api.generate([PROMPT] * 4, [_params(grammar=ARITHMETIC[syntax], seed=s, max_tokens=40) for s in range(4)], use_tqdm=False)
    reasons = [out.outputs[0].finish_reason for out in outs]
    assert "stop" in reasons and set(reasons) <= {"stop", "length"}, reasons
    for out in outs:
        text = out.outputs[0].text
        parse_arithmetic(text, complete=out.outputs[0].finish_reason == "stop")
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(eval(text), int), text


def test_choice_n_and_same_seed(api):
    """Each of n samples has its own matcher; the same seed gives the same output. Choices that
    share prefixes (tokens in common) still end on a whole choice."""
    choices = ["alpha", "beta", "gamma delta", "New York", "New Jersey", "Newark"]
    params = SamplingParams(n=3, max_tokens=10, seed=7, temperature=1.0, structured_outputs={"choice": choices})
    first, again = (api.generate([PROMPT], params, use_tqdm=False)[0] for _ in range(2))
    assert [c.text for c in first.outputs] == [c.text for c in again.outputs]
    assert all(c.text in choices and c.finish_reason == "stop" for c in first.outputs)


def test_mixed_batch_and_per_request_errors(api):
    """Free requests, constrained ones and two that do not compile in one batch: the bad ones fail
    alone with a one-line error, the others complete; the free ones are as without the others."""
    free = SamplingParams(max_tokens=8, seed=3)
    params = [free, _params(regex="[0-9]{3}"), _params(regex="[a-"), _params(json={"type": "frobnicate"}), free]
    outs = api.generate([PROMPT, PROMPT, PROMPT, PROMPT, "other"], params, use_tqdm=False)
    alone = api.generate([PROMPT, "other"], free, use_tqdm=False)
    assert [outs[0].outputs[0].token_ids, outs[4].outputs[0].token_ids] == [o.outputs[0].token_ids for o in alone]
    assert re.fullmatch("[0-9]{3}", outs[1].outputs[0].text)
    for out, what in ((outs[2], "regex"), (outs[3], "json")):
        completion = out.outputs[0]
        assert out.finished and completion.finish_reason == "error" and completion.token_ids == []
        assert completion.error.startswith(f"{what} does not compile") and "\n" not in completion.error


def test_eos_only_where_the_grammar_accepts(api):
    """EOS pushed up by +100: free, the request ends at once; constrained, EOS comes at the first
    place the grammar may end, never before; a budget too small for the grammar ends by length."""
    eos = min(api.engine.eos_token_ids)
    free = api.generate([PROMPT], SamplingParams(max_tokens=8, logit_bias={eos: 100.0}), use_tqdm=False)[0].outputs[0]
    assert free.token_ids == [eos] and free.finish_reason == "stop"
    spec = StructuredOutputsParams(regex="[0-9]{3,6}")
    ids = api.generate([PROMPT], SamplingParams(max_tokens=20, logit_bias={eos: 100.0}, structured_outputs=spec), use_tqdm=False)[0].outputs[0]
    assert ids.finish_reason == "stop" and ids.token_ids[-1] == eos and re.fullmatch("[0-9]{3,6}", ids.text), ids
    assert accepted(api, spec, ids.token_ids[:-1]) and not any(accepted(api, spec, ids.token_ids[:k]) for k in range(len(ids.token_ids) - 1))
    long = "[0-9]{30,40}"
    short, enough = api.generate([PROMPT] * 2, [_params(regex=long, max_tokens=3), _params(regex=long, max_tokens=40)], use_tqdm=False)
    assert short.outputs[0].finish_reason == "length" and re.fullmatch("[0-9]+", short.outputs[0].text) and len(short.outputs[0].text) < 30
    assert not accepted(api, StructuredOutputsParams(regex=long), short.outputs[0].token_ids)
    assert enough.outputs[0].finish_reason == "stop" and re.fullmatch(long, enough.outputs[0].text)


def test_min_tokens_with_a_grammar(api):
    """min_tokens bans EOS while the grammar can go on; a grammar that is complete ends the request
    before min_tokens (its end wins: an output past it could not match); a grammar whose only way on
    is a token min_tokens bans fails that request with a one-line error."""
    eos = min(api.engine.eos_token_ids)
    digits = SamplingParams(max_tokens=20, min_tokens=4, logit_bias={eos: 100.0}, structured_outputs={"regex": "[0-9]{1,20}"})
    choice = SamplingParams(max_tokens=20, min_tokens=5, seed=1, structured_outputs={"choice": ["yes", "no"]})
    a, b = (api.tokenizer.encode(text, add_bos=False) for text in ("a", "b"))
    assert len(a) == len(b) == 1
    # after "a" the grammar allows "b" (a stop token id here) or its end: min_tokens bans both
    conflict = SamplingParams(max_tokens=20, min_tokens=5, stop_token_ids=b, logit_bias={a[0]: 100.0}, structured_outputs={"choice": ["a", "ab"]})
    first, second, third = (out.outputs[0] for out in api.generate([PROMPT] * 3, [digits, choice, conflict], use_tqdm=False))
    assert first.finish_reason == "stop" and len(first.token_ids) == 5 and first.token_ids[-1] == eos and re.fullmatch("[0-9]+", first.text)
    assert second.finish_reason == "stop" and second.text in ("yes", "no") and len(second.token_ids) < 5
    assert third.finish_reason == "error" and third.text == "a" and "\n" not in third.error
    assert third.error.startswith("after 1 tokens the grammar allows only its end") and "min_tokens=5" in third.error


def test_grammar_cache_is_bounded_lru(api, monkeypatch):
    from collections import OrderedDict

    from deepinfer.engine.llm_engine import EngineConfig

    compiler = api.engine._grammar_compiler()
    assert compiler.cache_size == api.engine.config.grammar_cache_size == 256
    monkeypatch.setattr(compiler, "cache_size", 2)
    monkeypatch.setattr(compiler, "_cache", OrderedDict())
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    first = compiler.submit(a)
    compiler.submit(b)
    assert compiler.submit(a) is first  # a hit: a is now the most recently used
    compiler.submit(c)  # b, the least recently used, is dropped
    assert compiler.cached_keys() == [a.key(), c.key()]
    out = api.generate([PROMPT], _params(regex="b+", max_tokens=4), use_tqdm=False)[0].outputs[0]  # b compiles again and runs
    assert re.fullmatch("b+", out.text) and compiler.cached_keys() == [c.key(), b.key()]
    with pytest.raises(InvalidRequestError, match="grammar_cache_size must be an integer >= 1"):
        EngineConfig(grammar_cache_size=0).validate()


def test_masks_filled_while_the_forward_runs_one_copy_per_step(api, monkeypatch):
    """Each step: the forward is launched, then the grammar rows' masks are filled on the host (the
    device runs the forward meanwhile on an asynchronous backend), copied once, then sampled."""
    from deepinfer.engine import structured_output

    runner, events = api.engine.runner, []

    def spy(name, call):
        return lambda *args, **kwargs: (events.append(name), call(*args, **kwargs))[1]

    monkeypatch.setattr(runner.model, "forward", spy("forward", runner.model.forward))
    monkeypatch.setattr(structured_output, "fill_bitmasks", spy("fill", structured_output.fill_bitmasks))
    monkeypatch.setattr(runner.ops, "sample", spy("sample", runner.ops.sample))
    masks = runner.processing.grammar_masks
    copies = masks.copies
    params = [_params(regex="[0-9]{6}", max_tokens=10), SamplingParams(max_tokens=6, ignore_eos=True), _params(choice=["north", "south"], seed=2)]
    outs = api.generate([PROMPT] * 3, params, use_tqdm=False)
    assert re.fullmatch("[0-9]{6}", outs[0].outputs[0].text) and outs[2].outputs[0].text in ("north", "south")
    steps = "".join({"forward": "F", "fill": "M", "sample": "S"}[e] for e in events)
    # the free request may start alone while the grammars compile; a step fills its masks between its forward and its sampling
    assert re.fullmatch("(FM?S)+", steps) and steps.count("M") >= 2, steps
    assert masks.copies - copies == steps.count("M")  # one copy per step with a grammar row


def test_expert_parallelism_is_refused_in_one_line(api, monkeypatch):
    """With expert parallelism the ranks' lockstep steps do not admit requests that wait for a grammar: refused up front."""
    monkeypatch.setattr(api.engine, "dist", object())
    with pytest.raises(InvalidRequestError, match="prompt: structured_outputs does not combine with expert parallelism yet; drop one of them"):
        api.engine.check_request([5, 6], _params(regex="a"))


def test_compile_timeout(api, monkeypatch):
    """A grammar not ready within grammar_compile_timeout_s fails its request; the free one completes."""
    from deepinfer.engine.grammar_sandbox import GrammarSandbox

    release = threading.Event()

    def held(self, spec, timeout_s, _original=GrammarSandbox.translate):
        release.wait()
        return _original(self, spec, timeout_s)

    monkeypatch.setattr(GrammarSandbox, "translate", held)
    monkeypatch.setattr(api.engine.grammar_wait, "timeout_s", 0.05)
    try:
        outs = api.generate([PROMPT] * 2, [_params(regex="[0-9]{2}x"), SamplingParams(max_tokens=4)], use_tqdm=False)
    finally:
        release.set()
    assert outs[0].outputs[0].finish_reason == "error" and "grammar_compile_timeout_s" in outs[0].outputs[0].error
    assert outs[1].outputs[0].finish_reason == "length"


def test_preemption_and_overlap():
    """Few KV pages (requests are preempted and recomputed) and overlap scheduling forced on: the
    matchers advance once per token, so every output still matches."""
    from deepinfer import LLM

    llm = LLM(backend="reference", announce=False, num_kv_blocks=6, max_num_seqs=4, overlap=True)
    regex = "[0-9]{100,110}"
    outs = llm.generate([PROMPT] * 4, [_params(regex=regex, seed=s, max_tokens=60) for s in range(4)], use_tqdm=False)
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    for out in outs:
        assert out.outputs[0].finish_reason in ("stop", "length") and re.fullmatch("[0-9]*", out.outputs[0].text)
        if out.outputs[0].finish_reason == "stop":
            assert re.fullmatch(regex, out.outputs[0].text)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({}, "exactly one"),
        ({"json": {"type": "object"}, "regex": "a"}, "exactly one"),
        ({"choice": []}, "choice must be"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"regex": "a", "structural_tag": "x"}, "structural_tag"),
        ({"regex": "a", "backend": "xgrammar"}, "backend"),
    ],
)
def test_params_checked_eagerly(fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        StructuredOutputsParams(**fields)
    with pytest.raises(InvalidRequestError, match="unknown field"):
        SamplingParams(structured_outputs={"regexp": "a"})


def test_disable_additional_properties():
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "object", "properties": {}}}}, disable_additional_properties=True)
    schema = spec.json_schema()
    assert schema["additionalProperties"] is False and schema["properties"]["a"]["additionalProperties"] is False


def test_run_row_of_a_failed_grammar(api):
    """`deepinfer run` writes a request whose grammar failed as an error row (generation_error)."""
    from types import SimpleNamespace

    from deepinfer.cli.run_output import GENERATION_FAILED, result_row

    out = api.generate([PROMPT], _params(regex="(unclosed"), use_tqdm=False)[0]
    row = result_row(SimpleNamespace(id_key="id", id="r1", source="input.jsonl line 1"), PROMPT, out)
    assert row["error"]["type"] == GENERATION_FAILED and row["error"]["message"].startswith("input.jsonl line 1: regex does not compile")


@pytest.fixture(scope="module")
def overlap_pair(cache):
    """(synchronous LLM, overlapped LLM) in deterministic mode: a stopped sequence's dropped row
    changes the overlapped steps' batches, which must not move the other rows' logits."""
    from deepinfer import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(cache))
        return tuple(LLM(backend="reference", announce=False, num_kv_blocks=64, deterministic=True, overlap=overlap) for overlap in (False, True))


def _overlap_spies(llm, monkeypatch):
    """Record, per grammar step sampled after its forward went ahead, its samplers' statuses; check
    that no terminated or failed matcher is asked for a mask."""
    from deepinfer.engine import structured_output

    runner, sampled = llm.engine.runner, []

    def sample_pending(pending, _original=runner.sample_pending):
        sampled.append([seq.status for seq in pending.rows.samplers])
        return _original(pending)

    def fill_bitmasks(rows, bitmask, _original=structured_output.fill_bitmasks):
        assert not any(grammar.matcher.is_stopped() or grammar.matcher.is_error() for _, grammar, _ in rows)
        return _original(rows, bitmask)

    monkeypatch.setattr(runner, "sample_pending", sample_pending)
    monkeypatch.setattr(structured_output, "fill_bitmasks", fill_bitmasks)
    return sampled


def _completions(outs):
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs, c.error) for c in (o.outputs[0] for o in outs)]


def test_overlap_launches_grammar_steps_ahead(overlap_pair, monkeypatch):
    """A mixed batch (grammars of every kind, free requests, penalties, logprobs; stops by the
    grammar completing at different steps, by length, free ones running on after): with overlap,
    the grammar steps' forwards go ahead of the step in flight and are sampled once its tokens
    have advanced the matchers; the outputs are the synchronous engine's."""
    from deepinfer.engine.sequence import SequenceStatus

    sync, ahead = overlap_pair
    json_spec = StructuredOutputsParams(json=SCHEMAS[10], disable_any_whitespace=True)
    params = [
        SamplingParams(max_tokens=40, seed=1, structured_outputs={"regex": "[0-9]{7}"}),
        SamplingParams(max_tokens=10, seed=2, structured_outputs={"choice": ["north", "south", "east", "west"]}),
        SamplingParams(max_tokens=60, seed=3, logprobs=2, repetition_penalty=1.3, presence_penalty=0.5, structured_outputs=json_spec),
        SamplingParams(max_tokens=20, seed=4, ignore_eos=True, frequency_penalty=0.4),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=8, seed=5, logprobs=1, structured_outputs={"regex": "[a-z]{60,80}"}),
        SamplingParams(max_tokens=30, seed=6, repetition_penalty=1.5, frequency_penalty=0.3, structured_outputs={"regex": "[0-9]{2}"}),
        SamplingParams(temperature=0.0, max_tokens=12, structured_outputs={"regex": "(ab|cd){2,5}"}),
    ]
    prompts = [PROMPT, PROMPT, PROMPT, "other", PROMPT, "Hello", PROMPT, "x"]
    want = sync.generate(prompts, params, use_tqdm=False)
    sampled = _overlap_spies(ahead, monkeypatch)
    before = ahead.engine.overlap.steps_ahead
    got = ahead.generate(prompts, params, use_tqdm=False)
    assert _completions(got) == _completions(want)
    reasons = [o.outputs[0].finish_reason for o in got]
    assert reasons[0] == reasons[1] == reasons[2] == reasons[6] == "stop" and reasons[5] == "length", reasons
    assert len({len(o.outputs[0].token_ids) for o in got}) > 4 and min(len(o.outputs[0].token_ids) for o in got) > 1  # at different steps
    assert ahead.engine.overlap.steps_ahead - before >= len(sampled) > 5
    # rows of sequences that the step in flight stopped were sampled (and dropped) without failing
    assert any(SequenceStatus.FINISHED in statuses for statuses in sampled)


def test_overlap_rows_of_stopped_and_failed_grammars(overlap_pair, monkeypatch):
    """Only constrained requests (before, no step went ahead while a grammar ran): a grammar that
    completes, one whose matcher fails (min_tokens bans every token it allows: finish_reason
    "error"), one that ends on EOS, each leaving a row in the step launched behind it, whose mask
    is all ones and whose token is dropped; the others go on as in the synchronous engine."""
    from deepinfer.engine.sequence import SequenceStatus

    sync, ahead = overlap_pair
    eos = min(ahead.engine.eos_token_ids)
    a, b = (ahead.tokenizer.encode(text, add_bos=False) for text in ("a", "b"))
    params = [
        SamplingParams(max_tokens=20, min_tokens=5, stop_token_ids=b, logit_bias={a[0]: 100.0}, structured_outputs={"choice": ["a", "ab"]}),
        SamplingParams(max_tokens=20, logit_bias={eos: 100.0}, repetition_penalty=1.2, structured_outputs={"regex": "[0-9]{3,6}"}),
        SamplingParams(max_tokens=30, seed=8, presence_penalty=0.7, logprobs=1, structured_outputs={"regex": "[0-9]{12,20}"}),
        SamplingParams(max_tokens=10, seed=9, structured_outputs={"choice": ["yes", "no"]}),
    ]
    want = sync.generate([PROMPT] * 4, params, use_tqdm=False)
    sampled = _overlap_spies(ahead, monkeypatch)
    before = ahead.engine.overlap.steps_ahead
    got = ahead.generate([PROMPT] * 4, params, use_tqdm=False)
    assert _completions(got) == _completions(want)
    first, second, third, fourth = (o.outputs[0] for o in got)
    assert first.finish_reason == "error" and first.text == "a"
    assert second.finish_reason == "stop" and second.token_ids[-1] == eos and re.fullmatch("[0-9]{3,6}", second.text)
    assert third.finish_reason == "stop" and re.fullmatch("[0-9]{12,20}", third.text)
    assert fourth.finish_reason == "stop" and fourth.text in ("yes", "no")
    assert ahead.engine.overlap.steps_ahead - before == len(sampled) > 5  # every step ahead is a grammar step
    assert sum(statuses.count(SequenceStatus.FINISHED) for statuses in sampled) >= 3


def test_masks_need_no_torch_compile(api, monkeypatch):
    """Issue 38 (2): the first structured step imported llguidance.torch on the engine thread, whose
    torch.compile decorator took 3.2 s; the masks are written by llguidance's executor without it."""
    monkeypatch.delitem(sys.modules, "llguidance.torch", raising=False)
    out = api.generate([PROMPT], _params(choice=["north", "south"], seed=3, max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert out.text in ("north", "south") and "llguidance.torch" not in sys.modules


def test_prepare_builds_the_tokenizer_once_off_the_caller(cache, monkeypatch):
    """Issue 38 (2): llguidance's view of the tokenizer (a second, the GIL held) is built once, on a
    thread of its own, by prepare_grammars (what serve calls at start-up); later grammars reuse it."""
    from deepinfer import LLM
    from deepinfer.engine import grammar_compiler

    builds = []

    def build(*args, _original=grammar_compiler.build_ll_tokenizer):
        builds.append(threading.current_thread())
        return _original(*args)

    monkeypatch.setattr(grammar_compiler, "build_ll_tokenizer", build)
    monkeypatch.setenv("DEEPINFER_CACHE", str(cache))
    llm = LLM(backend="reference", announce=False, num_kv_blocks=16)
    llm.engine.prepare_grammars().result()
    outs = llm.generate([PROMPT] * 2, [_params(regex="[0-9]{3}", max_tokens=8), _params(choice=["a", "b"], max_tokens=4)], use_tqdm=False)
    assert re.fullmatch("[0-9]{3}", outs[0].outputs[0].text) and outs[1].outputs[0].text in ("a", "b")
    assert len(builds) == 1 and builds[0] is not threading.current_thread()


def test_a_stop_string_on_the_token_that_completes_the_grammar(api):
    """Issue 38 (U2): the token that completes the grammar also completes a stop string: the text
    ends at the stop string (stop_reason names it), as on any other token."""
    words = api.tokenizer.encode("hello world", add_bos=False)
    assert api.tokenizer.decode(words[-1:]).strip() == "world", "the last token holds the stop string"
    cut, kept = (
        api.generate([PROMPT], SamplingParams(max_tokens=8, stop=["world"], include_stop_str_in_output=keep, structured_outputs={"choice": ["hello world"]}),
                     use_tqdm=False)[0].outputs[0]
        for keep in (False, True)
    )  # fmt: skip
    assert (cut.text, cut.finish_reason, cut.stop_reason) == ("hello ", "stop", "world")
    assert (kept.text, kept.finish_reason, kept.stop_reason) == ("hello world", "stop", "world")


@pytest.mark.parametrize("fields", UNSATISFIABLE, ids=["regex", "json", "lark"])
def test_a_grammar_that_matches_nothing_says_so(api, fields):
    """Issue 38 (U3): an unsatisfiable grammar fails its request with that said, not as a clash with
    the request's other token options."""
    out = api.generate([PROMPT], SamplingParams(max_tokens=4, structured_outputs=fields), use_tqdm=False)[0].outputs[0]
    kind = next(iter(fields))
    assert out.finish_reason == "error" and out.token_ids == [] and out.error == f"{kind} matches nothing: no output satisfies it"


def test_a_grammar_past_llguidance_s_limits_says_so(api):
    """Issue 38 (U3): 2,500 choices open at once pass llguidance's limit of 2,000 items in a parser
    row when the first token is consumed; that is the grammar's own failure, said as such (it was
    reported as a clash with the request's other token options)."""
    spec = StructuredOutputsParams(choice=[f"option number {i}" for i in range(2500)])
    out = api.generate([PROMPT], SamplingParams(max_tokens=4, structured_outputs=spec), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "error" and len(out.token_ids) == 1, out
    assert out.error.startswith("after 0 tokens the grammar is too big or complex for llguidance: Parser Error: Current row has 2501 items; max is 2000")
    assert "\n" not in out.error and "<state>" not in out.error


def test_a_grammar_over_max_grammar_bytes_is_refused_up_front(api):
    """Issue 38 (U3, F5): a 100,000-string choice list took llguidance 48 s and then a Rust panic
    (its backtrace in the 400): it is refused before it is compiled, the limit named."""
    from deepinfer.engine.llm_engine import EngineConfig

    choices = [f"option number {i}" for i in range(100_000)]
    spec = StructuredOutputsParams(choice=choices)
    with pytest.raises(InvalidRequestError) as refused:
        api.generate([PROMPT], SamplingParams(max_tokens=4, structured_outputs=spec), use_tqdm=False)
    assert str(refused.value) == (f"prompt 0: the structured_outputs choice is {spec.size()} bytes, too big to compile: "
                                  "the limit is 262144 (max_grammar_bytes, --max-grammar-bytes)")  # fmt: skip
    assert not api.engine.has_unfinished()
    with pytest.raises(InvalidRequestError, match="max_grammar_bytes must be an integer >= 1"):
        EngineConfig(max_grammar_bytes=0).validate()


def test_a_schema_nested_too_deep_is_refused_when_made(api):
    """Issue 38 (F1): a schema nested 400 levels deep (with disable_additional_properties: a
    RecursionError on the engine thread, which died) is refused when the request is made, in one
    line; the engine runs on. As deep as llguidance reads still compiles."""
    from deepinfer.engine.structured_params import MAX_SCHEMA_DEPTH

    deep = nested_schema(400)
    for fields in ({"json": deep, "disable_additional_properties": True}, {"json": json.dumps(deep)}, {"json": "[" * 100_000}):
        with pytest.raises(InvalidRequestError, match=f"the json schema nests objects and arrays more than {MAX_SCHEMA_DEPTH} deep"):
            SamplingParams(structured_outputs=fields)
    fits = nested_schema((MAX_SCHEMA_DEPTH - 1) // 2)  # an object level is two dicts deep
    out = api.generate([PROMPT], _params(json=fits, disable_any_whitespace=True, disable_additional_properties=True, max_tokens=4), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].text.startswith('{"a":')


def test_small_grammars_are_not_queued_behind_large_ones(api, monkeypatch):
    """Issue 38 (F5): large grammars (here held in their compile on purpose) never take every compile
    thread, and the smallest pending grammar goes first: a small regex compiles while they wait. A
    compile nobody waits for any more is dropped before it starts."""
    from deepinfer.engine import grammar_compiler
    from deepinfer.engine.grammar_sandbox import GrammarSandbox

    release, started = threading.Event(), []

    def held(self, spec, timeout_s, _original=GrammarSandbox.translate):
        if spec.size() > grammar_compiler.SMALL_GRAMMAR_BYTES:
            started.append(spec)
            release.wait()
        return _original(self, spec, timeout_s)

    monkeypatch.setattr(GrammarSandbox, "translate", held)
    engine = api.engine
    compiler = grammar_compiler.GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids, threads=2)
    try:
        large = [StructuredOutputsParams(choice=[f"option {k} number {i}" for i in range(2000)]) for k in range(3)]
        assert all(spec.size() > grammar_compiler.SMALL_GRAMMAR_BYTES for spec in large)
        big = [compiler.submit(spec) for spec in large]
        small = compiler.submit(StructuredOutputsParams(regex="[0-9]{3}"))
        assert not small.result(timeout=300).is_error()  # (a guard against a hang, not a timing)
        assert len(started) == 1 and not any(future.done() for future in big)
        compiler.release(big[2])  # its one request stopped waiting before it started
        assert big[2].cancelled() and large[2].key() not in compiler.cached_keys()
        release.set()
        assert all(not future.result(timeout=300).is_error() for future in big[:2])
        assert started == large[:2]
    finally:
        release.set()
        compiler.shutdown()


def test_a_compiler_no_longer_used_is_freed_and_its_threads_end(api):
    """The compile threads and their child processes hold the queue, not the compiler: an engine
    dropped frees its compiler and llguidance's tokenizer (~100 MB), and the threads end."""
    import gc
    import weakref

    from deepinfer.engine.grammar_compiler import GrammarCompiler

    engine = api.engine
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    assert not compiler.submit(StructuredOutputsParams(regex="[0-9]")).result().is_error()
    workers, gone = list(compiler._queue._workers), weakref.ref(compiler)
    del compiler
    gc.collect()
    assert gone() is None and len(workers) == 2
    for worker in workers:
        worker.join()
