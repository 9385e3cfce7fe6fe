"""Constrained decoding through the engine (embedded SmolLM2, CPU): every output of a
varied set of constraints validates; async output processing on and off give identical
tokens; constrained and free requests batch together without changing the free ones;
preemption and prefix caching keep constrained outputs exact."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

from tandem.sampling_params import SamplingParams
from tandem.structured_output import StructuredOutputsParams
from tandem.structured_output.bitmask import GrammarBitmask
from tests.conftest import assert_all_blocks_free, make_llm
from tests.structured_output.matcher_faults import FAULTS, expected_error, inject_matcher_fault

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
PET = {
    "type": "object",
    "properties": {"species": {"enum": ["cat", "dog", "fish"]},
                   "toys": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1,
                            "maxItems": 2},
                   "indoor": {"type": "boolean"}},
    "required": ["species", "toys", "indoor"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,6}-[0-9]{3}"
CHOICES = ["Paris", "London", "Berlin", "Madrid"]


def _chat(tok, q: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def _cases(tok):
    """(prompt ids, params, checker) for a varied set of constraints."""
    def so(**kw):
        compact = "json" in kw or "json_object" in kw
        return StructuredOutputsParams(disable_any_whitespace=compact, **kw)

    def sp(c, **kw):
        return SamplingParams(**{"temperature": 0, "max_tokens": 80, "structured_outputs": c, **kw})

    def valid(schema):
        return lambda text: jsonschema.validate(json.loads(text), schema)

    def obj(text):
        assert isinstance(json.loads(text), dict)

    def full(pattern):
        return lambda text: re.fullmatch(pattern, text) or pytest.fail(f"{text!r} does not match {pattern}")

    def one_of(text):
        assert text in CHOICES, text

    return [
        (_chat(tok, "Describe a person as JSON."), sp(so(json=PERSON)), valid(PERSON)),
        (_chat(tok, "Describe a pet as JSON."), sp(so(json=PET)), valid(PET)),
        (_chat(tok, "Describe a pet as JSON."), sp(so(json=json.dumps(PET)), temperature=0.9, seed=3), valid(PET)),
        (_chat(tok, "Give me a product code."), sp(so(regex=REGEX)), full(REGEX)),
        (_chat(tok, "What is the capital of Spain?"), sp(so(choice=CHOICES)), one_of),
        (_chat(tok, "Give me a JSON object about a cat with two keys."),
         sp(so(json_object=True), max_tokens=200), obj),
        (_chat(tok, "Say yes or no."), sp(so(grammar='root ::= "yes" | "no" | "maybe, " [a-z]+ "."')),
         full(r"yes|no|maybe, [a-z]+\."))
    ]


@pytest.fixture(scope="module")
def engines():
    on, off = make_llm(async_output_proc=True), make_llm(async_output_proc=False)
    yield {True: on, False: off}
    on.engine.shutdown()
    off.engine.shutdown()


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_all_blocks_free(llm.engine)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def test_varied_constraints_validate_async_on_off_identical(engines):
    tok = engines[True].get_tokenizer()
    cases = _cases(tok)
    prompts, params, checks = zip(*cases)
    res = {mode: _run(llm, list(prompts), list(params)) for mode, llm in engines.items()}
    assert res[True] == res[False]
    for (ids, text, finish), check in zip(res[True], checks):
        assert finish == "stop", (text, finish)
        check(text)


def test_mixed_batch_free_requests_unchanged(engines):
    """Free requests batched with constrained ones give the tokens they give alone, and
    the constrained ones theirs."""
    llm = engines[True]
    tok = llm.get_tokenizer()
    cases = _cases(tok)[:4]
    free_prompts = [_chat(tok, "Write a short poem."), _chat(tok, "What is 2+2?")]
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone_free = _run(llm, free_prompts, free)
    alone_constrained = _run(llm, [c[0] for c in cases], [c[1] for c in cases])
    mixed = _run(llm, free_prompts[:1] + [c[0] for c in cases] + free_prompts[1:],
                 [free] + [c[1] for c in cases] + [free])
    assert [mixed[0], mixed[-1]] == alone_free
    assert mixed[1:-1] == alone_constrained


@pytest.mark.parametrize("async_output_proc", [True, False])
def test_preemption_and_prefix_caching(engines, async_output_proc):
    """A KV cache too small for the batch preempts sequences (recomputed later) and a
    repeated prompt hits the prefix cache; constrained outputs stay exactly those of a
    roomy engine."""
    tok = engines[True].get_tokenizer()
    cases = _cases(tok)[:3] * 2
    prompts, params = [c[0] for c in cases], [c[1] for c in cases]
    reference = _run(engines[async_output_proc], prompts, params)
    small = make_llm(async_output_proc=async_output_proc, num_kv_blocks=14, block_size=16,
                     enable_prefix_caching=True, max_num_seqs=6)
    try:
        got = _run(small, prompts, params)
        stats = small.engine.client.debug_stats()[0]
    finally:
        small.engine.shutdown()
    assert got == reference
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0
    for (ids, text, _), check in zip(got, [c[2] for c in cases]):
        check(text)


def test_n_and_ignore_eos_end_with_the_grammar(engines):
    """n sequences each get their own grammar state; with ignore_eos the output still
    ends when the grammar is complete."""
    llm = engines[True]
    tok = llm.get_tokenizer()
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=40, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(regex=REGEX))
    out = llm.generate([_chat(tok, "A code please.")], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert re.fullmatch(REGEX, c.text), c.text
        assert c.finish_reason == "stop"
    assert_all_blocks_free(llm.engine)


def test_compiling_grammar_does_not_stall_running_requests(engines):
    """While a new grammar compiles (held back here), a free request added after it runs to
    the end; the constrained one starts once its grammar is ready."""
    engine = engines[True].engine
    manager = engine.core.structured_output
    gate = threading.Event()
    compile_ = manager._compile
    manager._compile = lambda params: gate.wait(120) and compile_(params)
    try:
        engine.add_request("constrained", "Code:", SamplingParams(
            temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=r"held-[0-9]{2}")))
        engine.add_request("free", "Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        done = {}
        for _ in range(200):  # the free request needs 9 steps
            done.update((o.request_id, o) for o in engine.step() if o.finished)
            if "free" in done:
                break
        assert "free" in done and "constrained" not in done
        assert engine.scheduler.requests  # still waiting for its grammar
        gate.set()
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
    finally:
        manager._compile = compile_
        gate.set()
    assert len(done["free"].outputs[0].token_ids) == 8
    assert re.fullmatch(r"held-[0-9]{2}", done["constrained"].outputs[0].text)
    assert_all_blocks_free(engine)


def test_grammar_compile_failure_finishes_only_that_request(engines, caplog):
    """A grammar that fails to compile (past the up-front parse) makes the core drop its
    request with the compile error: the request gets its own final output ("abort", the
    error) and is freed; the other requests are unaffected."""
    engine = engines[True].engine
    manager = engine.core.structured_output

    def broken(params):
        raise RuntimeError("[00:00:00] /project/cpp/compiler.cc:1: simulated failure")

    compile_ = manager._compile
    manager._compile = broken
    try:
        engine.add_request("bad", "Code:", SamplingParams(
            temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex=r"broken-[0-9]{3}")))
        engine.add_request("free", "Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        done = {}
        for _ in range(200):
            done.update((o.request_id, o) for o in engine.step() if o.finished)
            if not engine.has_unfinished_requests():
                break
    finally:
        manager._compile = compile_
    assert not engine.has_unfinished_requests()
    bad = done["bad"]
    assert bad.error == "grammar compilation failed: simulated failure"
    assert [c.finish_reason for c in bad.outputs] == ["abort"] and bad.outputs[0].token_ids == []
    assert "request bad dropped by its engine core: grammar compilation failed: simulated failure" in caplog.text
    assert len(done["free"].outputs[0].token_ids) == 4 and done["free"].error is None
    assert_all_blocks_free(engine)


def test_generate_with_a_failing_grammar_returns_every_result(engines, monkeypatch):
    """LLM.generate over several prompts, one of whose grammars fails to compile: that
    prompt's output is its error ("abort"), the others complete as they do without it."""
    llm = engines[True]
    manager = llm.engine.core.structured_output
    compile_ = manager._compile

    def fail_one(params):
        if params.regex == r"fails-[0-9]":
            raise RuntimeError("simulated compile failure")
        return compile_(params)

    tok = llm.get_tokenizer()
    cases = _cases(tok)[3:5]
    free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts, params = [c[0] for c in cases] + ["Hello"], [c[1] for c in cases] + [free]
    without = _run(llm, prompts, params)
    monkeypatch.setattr(manager, "_compile", fail_one)
    failing = SamplingParams(temperature=0, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(regex=r"fails-[0-9]"))
    outs = llm.generate(prompts[:1] + ["Code:"] + prompts[1:], params[:1] + [failing] + params[1:], use_tqdm=False)
    assert_all_blocks_free(llm.engine)
    assert outs[1].error == "grammar compilation failed: simulated compile failure"
    assert outs[1].outputs[0].finish_reason == "abort"
    got = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs[:1] + outs[2:]]
    assert got == without


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("async_output_proc", [True, False])
def test_a_failing_matcher_finishes_only_its_request(engines, monkeypatch, async_output_proc, fault):
    """An error of one sequence's grammar matcher at run time (creating it, filling its
    mask, accepting a token) ends that request alone, "abort" with the error; the others in
    its batches (constrained and free) complete as they do without it, every block is
    freed and the engine serves on."""
    llm = engines[async_output_proc]
    tok = llm.get_tokenizer()
    cases = _cases(tok)[3:5]
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts, params = [c[0] for c in cases] + ["Hello"], [c[1] for c in cases] + [free]
    without = _run(llm, prompts, params)
    bad = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=PET))
    bad_prompt = _chat(tok, "Describe a pet as JSON, please.")
    inject_matcher_fault(monkeypatch, llm.engine.core.structured_output, bad_prompt, fault)
    outs = llm.generate(prompts[:1] + [bad_prompt] + prompts[1:],
                        params[:1] + [bad] + params[1:], use_tqdm=False)
    assert_all_blocks_free(llm.engine)
    assert outs[1].error == expected_error(fault)
    assert outs[1].outputs[0].finish_reason == "abort"
    got = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs[:1] + outs[2:]]
    assert got == without
    monkeypatch.undo()
    assert _run(llm, prompts, params) == without


def test_adding_a_request_never_parses_its_constraint_on_the_core_thread(engines, monkeypatch):
    """The core's add_request and the steps after it never parse or check a constraint
    (the front end did); its compile runs on the compile thread."""
    from tandem.structured_output import params as params_mod

    llm = engines[True]
    engine, manager = llm.engine, llm.engine.core.structured_output
    schema = {"type": "object", "properties": {"spy": {"type": "integer"}}, "required": ["spy"],
              "additionalProperties": False}
    sp = SamplingParams(temperature=0, max_tokens=16,
                        structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    parse_threads, compile_threads = [], []
    for name in ("_check_schema", "_check_enforced", "_parse_once"):
        real = getattr(params_mod, name)
        monkeypatch.setattr(params_mod, name, lambda *a, real=real: parse_threads.append(threading.current_thread())
                            or real(*a))
    to_grammar = StructuredOutputsParams.to_grammar
    monkeypatch.setattr(StructuredOutputsParams, "to_grammar",
                        lambda self: parse_threads.append(threading.current_thread()) or to_grammar(self))
    compile_ = manager._compile
    monkeypatch.setattr(manager, "_compile", lambda p: compile_threads.append(threading.current_thread()) or compile_(p))
    engine.add_request("spy", "JSON:", sp)
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    assert parse_threads == []
    assert [t.name.startswith("tandem-grammar") for t in compile_threads] == [True]
    assert json.loads(out.outputs[0].text).keys() == {"spy"}


@pytest.mark.parametrize("async_output_proc", [True, False])
def test_the_grammar_end_wins_over_min_tokens(engines, async_output_proc, caplog):
    """min_tokens past the end of a short grammar: once the grammar can only end, its stop
    token is sampled whatever min_tokens says, so the output is what it is without
    min_tokens (no refused token, no warning); the requests batched with it are
    unchanged."""
    llm = engines[async_output_proc]
    tok = llm.get_tokenizer()
    cases = _cases(tok)[3:5]
    short = StructuredOutputsParams(choice=["yes", "no"])
    schema = StructuredOutputsParams(json={"type": "object", "properties": {"ok": {"type": "boolean"}},
                                           "required": ["ok"], "additionalProperties": False},
                                     disable_any_whitespace=True)
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [_chat(tok, "Say yes or no."), _chat(tok, "Is it ok? JSON.")] + [c[0] for c in cases] + ["Hello"]
    plain = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=c) for c in (short, schema)]
    others = [c[1] for c in cases] + [free]
    reference = _run(llm, prompts, plain + others)
    got = _run(llm, prompts, [p.clone(min_tokens=25) for p in plain] + others)
    assert got == reference
    for ids, text, finish in got[:2]:
        assert finish == "stop" and len(ids) < 25 and ids[-1] in llm.engine.eos_token_ids, (ids, text)
    assert got[0][1] in ("yes", "no") and json.loads(got[1][1]).keys() == {"ok"}
    assert "does not match its grammar" not in caplog.text


def test_a_refused_token_is_left_out_of_the_output(engines, monkeypatch, caplog):
    """A row left no token its grammar allows (other masks can do that: logit_bias, bad
    words; here its bitmask row is cleared) samples a token the grammar refuses: the
    request finishes as "stop" without that token in its output or its usage; the others
    are unaffected."""
    llm = engines[True]
    manager = llm.engine.core.structured_output
    fill = manager.grammar_bitmask

    def clear_marked(seq_ids, requests):
        grammar = fill(seq_ids, requests)
        for row, sid in enumerate(seq_ids):
            if sid in requests and requests[sid].sampling_params.max_tokens == 7:  # the marked request
                grammar.bitmask[row] = 0
        return grammar

    tok = llm.get_tokenizer()
    free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    without = _run(llm, ["Hello"], free)
    monkeypatch.setattr(manager, "grammar_bitmask", clear_marked)
    refused = SamplingParams(temperature=0, max_tokens=7, structured_outputs=StructuredOutputsParams(choice=["yes"]))
    outs = llm.generate([_chat(tok, "Say yes."), "Hello"], [refused, free], use_tqdm=False)
    assert_all_blocks_free(llm.engine)
    c = outs[0].outputs[0]
    assert (c.token_ids, c.text, c.finish_reason) == ([], "", "stop")
    assert outs[0].metrics["num_generation_tokens"] == 0
    assert "does not match its grammar; finishing it" in caplog.text
    assert [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs[1:]] == without


def _one_call_per_sequence(manager, monkeypatch) -> None:
    """Make ``manager`` advance and fill with one xgrammar call per sequence (the path
    before the batched calls), as a reference."""
    import xgrammar as xgr

    def accept_tokens(reqs, toks):
        for req, tok in zip(reqs, toks):
            m = req.structured_output.matcher
            if not m.accept_token(tok) or m.is_terminated():
                req.structured_output.finished = True

    def grammar_bitmask(seq_ids, requests):
        bitmask = xgr.allocate_token_bitmask(len(seq_ids), manager.vocab_size)
        for row, sid in enumerate(seq_ids):
            req = requests.get(sid)
            if req is not None and not req.structured_output.finished:
                req.structured_output.matcher.fill_next_token_bitmask(bitmask, row)
        return GrammarBitmask(seq_ids, bitmask)

    monkeypatch.setattr(manager, "accept_tokens", accept_tokens)
    monkeypatch.setattr(manager, "grammar_bitmask", grammar_bitmask)


def test_batched_grammar_calls_give_the_tokens_of_one_call_per_sequence(engines, monkeypatch):
    """A mixed batch (constrained, greedy and seeded random, and free requests): the
    batched accept and fill over 2 threads, with async output processing (the next
    bitmask filled before the step's other processing), give the tokens of one xgrammar
    call per sequence without async output processing."""
    tok = engines[True].get_tokenizer()
    cases = _cases(tok)[:5]
    free = SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True)
    prompts = [_chat(tok, "Write a short poem.")] + [c[0] for c in cases] + [_chat(tok, "What is 2+2?")]
    params = [free] + [c[1] for c in cases] + [free]
    _one_call_per_sequence(engines[False].engine.core.structured_output, monkeypatch)
    reference = _run(engines[False], prompts, params)
    manager = engines[True].engine.core.structured_output
    monkeypatch.setenv("TANDEM_STRUCTURED_OUTPUT_THREADS", "2")
    monkeypatch.setattr("tandem.structured_output.manager._ROWS_PER_THREAD", 2)  # 2 threads from 4 rows
    assert _run(engines[True], prompts, params) == reference
    assert 2 in manager._batch_matchers
    for (ids, text, finish), check in zip(reference[1:-1], [c[2] for c in cases]):
        assert finish == "stop", text
        check(text)


def test_failed_constrained_step_tells_tp_followers_to_abandon_it(engines, monkeypatch):
    """A TP driver whose constrained step fails before its bitmask is sent sends None in its
    place (tandem.engine.rank_core.run_tp_follower then abandons the step, as the driver
    does) instead of leaving its followers waiting for a bitmask."""
    core = engines[True].engine.core
    sent = []
    monkeypatch.setattr(core, "step_broadcast", sent.append)

    def broken(*a, **k):
        raise RuntimeError("simulated bitmask failure")

    monkeypatch.setattr(core.structured_output, "grammar_bitmask", broken)
    engines[True].engine.add_request("c", "Code:", SamplingParams(
        temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(regex=r"ok-[0-9]{3}")))
    deadline = time.monotonic() + 60  # the grammar compiles in the background first
    with pytest.raises(RuntimeError, match="simulated bitmask failure"):
        while time.monotonic() < deadline:
            core.step()
    steps = [m for m in sent if m is not None]
    assert steps and steps[-1].structured_output_seq_ids and sent[-1] is None
    assert not any(isinstance(m, GrammarBitmask) for m in sent)
    monkeypatch.undo()
    while core.has_unfinished_requests():
        core.step()
    assert_all_blocks_free(engines[True].engine)
    # The core was stepped past the front end: its request "c" is still live there, and the
    # fixture's next generate would wait for it forever.
    engines[True].engine.abort_request("c")
    assert not engines[True].engine.has_unfinished_requests()


PROFILE = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                     "maxItems": 3}},
           "required": ["name", "age", "tags"]}
ORDER = {"type": "object", "properties": {
    "customer": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                  "vip": {"type": "boolean"}}, "required": ["name", "vip"]},
    "total": {"type": "number", "minimum": 0, "maximum": 1000}}, "required": ["customer", "total"]}
SCORES = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 10}, "minItems": 1, "maxItems": 5}
WEATHER = {"type": "object", "properties": {"sky": {"enum": ["sunny", "cloudy", "rainy"]},
                                            "wind": {"enum": ["none", "light", "strong"]}},
           "required": ["sky", "wind"]}


def test_sampled_json_parses_and_validates_within_128_tokens(engines):
    """The embedded model at temperature 0.7, 20 seeds x 4 schemas (default whitespace):
    every output is complete JSON valid for its schema within 128 tokens (unbounded
    whitespace let it fill max_tokens with newlines). A json_object's content has no
    bound, and this model at 0.7 sometimes writes keys past 128 tokens (2 of 20 here): its
    outputs never hold a whitespace run past the bound, and most complete as objects."""
    from tandem.structured_output.params import MAX_WHITESPACE

    llm = engines[True]
    tok = llm.get_tokenizer()
    cases = [(PROFILE, "Who are you?"), (ORDER, "Describe an order as JSON."), (SCORES, "Give me some scores."),
             (WEATHER, "What is the weather like?"),
             (None, 'Reply with a JSON object with one short key and value, like {"a": 1}.')]
    prompts, params, schemas = [], [], []
    for schema, q in cases:
        c = StructuredOutputsParams(json=schema) if schema is not None else StructuredOutputsParams(json_object=True)
        for seed in range(20):
            prompts.append(_chat(tok, q))
            params.append(SamplingParams(temperature=0.7, seed=seed, max_tokens=128, structured_outputs=c))
            schemas.append(schema)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_all_blocks_free(llm.engine)
    objects = 0
    for o, p, schema in zip(outs, params, schemas):
        c = o.outputs[0]
        if schema is None:
            # Raw newlines are whitespace between tokens (a JSON string escapes its own).
            assert "\n" * (MAX_WHITESPACE + 1) not in c.text, c.text
            if c.finish_reason == "stop":
                assert isinstance(json.loads(c.text), dict), c.text
                objects += 1
            continue
        assert c.finish_reason == "stop", (p.seed, schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    assert objects >= 15
