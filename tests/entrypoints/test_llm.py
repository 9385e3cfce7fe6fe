"""The offline ``LLM`` API: user input errors are ValueErrors naming the field, streaming
one prompt, and a script that uses it ends without third-party noise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata

import pytest

from tandem.sampling_params import SamplingParams
from tests.conftest import make_llm
from tests.entrypoints.chat_cases import BAD_MESSAGES, GOOD_MESSAGES


@pytest.fixture(scope="module")
def llm():
    llm = make_llm(num_kv_blocks=64, max_model_len=256)
    yield llm
    llm.engine.shutdown()


GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.mark.parametrize("prompts, field", [
    (42, "prompts"), (None, "prompts"), (3.5, "prompts"), (b"hi", "prompts"),
    ([None], "prompt"), ([42.0], "prompt"), ({"text": "hi"}, "prompt"),
])
def test_generate_bad_prompts(llm, prompts, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        llm.generate(prompts, GREEDY)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("params, field", [
    (42, r"sampling_params"), ("greedy", r"sampling_params"), ({"temperature": 0}, r"sampling_params"),
    ([GREEDY, 1], r"sampling_params\[1\]"), ([GREEDY], r"sampling_params has 1 entries"),
])
def test_generate_bad_sampling_params(llm, params, field):
    with pytest.raises(ValueError, match=rf"^{field}"):
        llm.generate(["a", "b"], params)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("messages, field", [
    (42, "messages"), (None, "messages"), ("hi", "messages"), ([], "messages"), ({"role": "user"}, "messages"),
    ([{"content": "hi"}], r"messages\[0\]"), ([[]], r"messages\[0\]"),
    ([{"role": "user", "content": "hi"}, "x"], r"messages\[1\]"),
])
def test_chat_bad_messages(llm, messages, field):
    with pytest.raises(ValueError, match=rf"^{field}"):
        llm.chat(messages, GREEDY)


@pytest.mark.parametrize("case", sorted(BAD_MESSAGES))
def test_chat_malformed_messages_name_the_field(llm, case):
    """Every malformed message shape, in chat and stream_chat alike, before anything is queued
    (not jinja2's UndefinedError or a TypeError from the template)."""
    messages, field = BAD_MESSAGES[case]
    for call in (llm.chat, llm.stream_chat):
        with pytest.raises(ValueError, match=rf"^{re.escape(field)}: "):
            call(messages, GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_chat_names_the_conversation_in_a_list(llm):
    with pytest.raises(ValueError, match=r"^messages\[1\]\[0\]\.content: "):
        llm.chat([[{"role": "user", "content": "Hi"}], [{"role": "user"}]], GREEDY)


def test_chat_accepted_message_forms(llm):
    """Text parts, a system or developer message, an assistant's tool calls with null content
    and the tool's answer: the prompt is the template applied to the conversation as OpenAI
    means it (parts joined with newlines, as vLLM joins them; null content empty)."""
    tok = llm.get_tokenizer()
    one_token = SamplingParams(temperature=0, max_tokens=1)
    outs = llm.chat([m for m, _ in GOOD_MESSAGES.values()], one_token, use_tqdm=False)
    for (_, want), out in zip(GOOD_MESSAGES.values(), outs):
        assert out.prompt == tok.apply_chat_template(want, tokenize=False, add_generation_prompt=True)
        assert len(out.outputs[0].token_ids) == 1
    parts, _ = GOOD_MESSAGES["text parts"]
    *_, last = llm.stream_chat(parts, one_token)
    assert last.finished and last.prompt == outs[list(GOOD_MESSAGES).index("text parts")].prompt


def test_model_must_be_a_path():
    from tandem.entrypoints.llm import LLM

    with pytest.raises(ValueError, match="^model must be a path"):
        LLM(model=42)


def test_stream_grows_to_what_generate_returns(llm):
    outs = list(llm.stream("The capital of France is", GREEDY))
    texts = [o.outputs[0].text for o in outs]
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and len(outs) > 1
    assert texts[-1] == llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0].outputs[0].text


def test_stream_left_early_aborts(llm):
    it = llm.stream("Once upon a time", SamplingParams(temperature=0, max_tokens=100))
    next(it)
    it.close()
    assert not llm.engine.has_unfinished_requests()


def test_triton_is_pinned_to_the_tested_version():
    """The run install (the core's requirements) pins the Triton the tests run with."""
    import tomllib

    with open("pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    pins = [m.group(1) for d in deps if (m := re.match(r"triton==([\w.]+)", d))]
    assert pins == [metadata.version("triton")], deps


def test_a_script_using_llm_exits_without_third_party_noise():
    code = ("from tandem import LLM, SamplingParams\n"
            "print(LLM(num_kv_blocks=64, max_model_len=256).generate(['hi'], SamplingParams(max_tokens=2))[0]"
            ".outputs[0].text != None)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert res.returncode == 0 and res.stdout.strip() == "True", res.stderr
    assert "leaked" not in res.stderr and "nanobind" not in res.stderr, res.stderr[-2000:]
