"""vLLM's and SGLang's request/response extensions through ``tandem serve`` (the conftest's
server), used as those engines' clients use them: vLLM's chat ``echo``; SGLang's
``stop_regex``, ``matched_stop``, ``regex`` and ``ebnf``. Their invalid values are in
``test_request_fields.BAD``; ``--return-tokens-as-token-ids`` and custom roles are in
``test_server_vllm_flags`` (they need flags)."""

from __future__ import annotations

import json

import httpx
import pytest
import regex

MODEL_NAME = "SmolLM2-135M-Instruct"  # as served by the conftest fixture
PROMPT = "The capital of France is"  # greedy: " Paris.\n\nThe answer is: 2018-01-22 ..."
GREEDY = {"model": MODEL_NAME, "temperature": 0.0}
# Continued by the model: " Paris."
CONTINUED = [{"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": "The capital of France is"}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


def _post(server, endpoint: str, body: dict) -> dict:
    r = httpx.post(f"{server.url}/v1/{endpoint}", json={**GREEDY, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _chunks(server, endpoint: str, body: dict) -> list[dict]:
    """The streamed response's chunks, parsed (without ``[DONE]``)."""
    r = httpx.post(f"{server.url}/v1/{endpoint}", json={**GREEDY, **body, "stream": True}, timeout=120)
    assert r.status_code == 200, r.text
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _text(choice: dict) -> str:
    if "text" in choice:
        return choice["text"]
    return (choice["delta"] if "delta" in choice else choice["message"]).get("content") or ""


def _streamed(chunks: list[dict]) -> tuple[str, dict]:
    """(the joined text of choice 0, its final chunk's choice)."""
    mine = [c for chunk in chunks for c in chunk["choices"] if c["index"] == 0]
    assert all(c["matched_stop"] is None for c in mine[:-1])  # only the final chunk says what ended it
    return "".join(_text(c) for c in mine), mine[-1]


def _plain_completion(server, max_tokens: int = 30) -> str:
    out = _post(server, "completions", {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True})
    return out["choices"][0]["text"]


# ---------------------------------------------------------------------- chat echo (vLLM)
@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_prepends_the_continued_assistant_message(server, stream):
    body = {"messages": CONTINUED, "max_tokens": 8, "n": 2, **CONTINUE}
    plain = [c["message"]["content"] for c in _post(server, "chat/completions", body)["choices"]]
    assert plain[0] and not plain[0].startswith(CONTINUED[-1]["content"])
    body["echo"] = True
    if not stream:
        echoed = [c["message"]["content"] for c in _post(server, "chat/completions", body)["choices"]]
        assert echoed == [CONTINUED[-1]["content"] + p for p in plain]
        return
    chunks = _chunks(server, "chat/completions", body)
    # The role chunk of each choice, then each choice's echo chunk, then the generated deltas.
    heads = [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks[:4]]
    assert heads == [(0, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""}),
                     (0, {"content": CONTINUED[-1]["content"]}), (1, {"content": CONTINUED[-1]["content"]})]
    for i in (0, 1):
        text = "".join(c["delta"].get("content") or "" for chunk in chunks for c in chunk["choices"] if c["index"] == i)
        assert text == CONTINUED[-1]["content"] + plain[i]


def test_chat_echo_needs_an_assistant_message_last(server):
    body = {"messages": CONTINUED[:1], "max_tokens": 4}
    plain = _post(server, "chat/completions", body)["choices"][0]["message"]["content"]
    assert _post(server, "chat/completions", {**body, "echo": True})["choices"][0]["message"]["content"] == plain


# -------------------------------------------------------------------- stop_regex (SGLang)
DATE = r"\d{4}-\d\d"  # of fixed length: the first match to complete is the leftmost


@pytest.mark.parametrize("include", [False, True])
def test_stop_regex_cuts_completions_at_the_match(server, include):
    full = _plain_completion(server)
    m = regex.search(DATE, full)
    assert m is not None and m.start() > 0, full
    want = full[:m.end()] if include else full[:m.start()]
    body = {"prompt": PROMPT, "max_tokens": 30, "ignore_eos": True, "stop_regex": DATE,
            "include_stop_str_in_output": include}
    (choice,) = _post(server, "completions", body)["choices"]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"], choice["matched_stop"]) == \
        (want, "stop", DATE, DATE)
    # Streamed: the digits that began the match were held back, never sent (sent text stays sent).
    text, last = _streamed(_chunks(server, "completions", body))
    assert (text, last["finish_reason"], last["matched_stop"]) == (want, "stop", DATE)


def test_stop_regex_in_chat_and_in_a_list(server):
    body = {"messages": CONTINUED, "max_tokens": 8, **CONTINUE}
    plain = _post(server, "chat/completions", body)["choices"][0]["message"]["content"]
    assert plain.startswith(" Paris"), plain
    patterns = ["Lond[a-z]+", r"P[a-z]r"]
    for stream in (False, True):
        if stream:
            text, choice = _streamed(_chunks(server, "chat/completions", {**body, "stop_regex": patterns}))
        else:
            (choice,) = _post(server, "chat/completions", {**body, "stop_regex": patterns})["choices"]
            text = choice["message"]["content"]
        assert (text, choice["finish_reason"], choice["matched_stop"]) == (" ", "stop", patterns[1])


# ------------------------------------------------------------------ matched_stop (SGLang)
def _matched(server, endpoint: str, body: dict, stream: bool) -> tuple[str, str, int | str | None]:
    if stream:
        text, choice = _streamed(_chunks(server, endpoint, body))
    else:
        (choice,) = _post(server, endpoint, body)["choices"]
        text = _text(choice)
    return text, choice["finish_reason"], choice["matched_stop"]


@pytest.mark.parametrize("stream", [False, True])
def test_matched_stop_names_what_ended_the_completion(server, smol_tokenizer, stream):
    full = _plain_completion(server)
    base = {"prompt": PROMPT, "max_tokens": 30, "ignore_eos": True}
    at = full.index("answer")
    assert _matched(server, "completions", {**base, "stop": ["zzz", "answer"]}, stream) == \
        (full[:at], "stop", "answer")
    newline = smol_tokenizer.convert_tokens_to_ids("Ċ")  # "\n"
    assert _matched(server, "completions", {**base, "stop_token_ids": [newline]}, stream) == \
        (full[:full.index("\n")], "stop", newline)
    assert _matched(server, "completions", {**base, "max_tokens": 3}, stream)[1:] == ("length", None)


@pytest.mark.parametrize("stream", [False, True])
def test_matched_stop_is_the_eos_token_in_chat(server, smol_tokenizer, stream):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 60}
    text, finish, matched = _matched(server, "chat/completions", body, stream)
    assert text and finish == "stop" and matched == smol_tokenizer.convert_tokens_to_ids("<|im_end|>")


# -------------------------------------------------------------- regex and ebnf (SGLang)
PHONE = r"[0-9]{3}-[0-9]{4}"


@pytest.mark.parametrize("stream", [False, True])
def test_regex_constrains_the_completion(server, stream):
    body = {"prompt": "My phone number is", "max_tokens": 20, "regex": PHONE}
    text, finish, _ = _matched(server, "completions", body, stream)
    assert regex.fullmatch(PHONE, text) and finish == "stop", text


def test_ebnf_constrains_the_chat_answer(server):
    body = {"messages": [{"role": "user", "content": "Is Paris in France?"}], "max_tokens": 5,
            "ebnf": 'root ::= "yes" | "no"'}
    (choice,) = _post(server, "chat/completions", body)["choices"]
    assert choice["message"]["content"] in ("yes", "no")


@pytest.mark.parametrize("fields, param", [
    ({"regex": PHONE, "guided_regex": PHONE}, "regex"),
    ({"ebnf": 'root ::= "a"', "response_format": {"type": "json_object"}}, "ebnf"),
    ({"regex": PHONE, "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tool_choice"),
])
def test_regex_and_ebnf_beside_another_constraint_are_refused(server, fields, param):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        **GREEDY, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["param"] == param, err
