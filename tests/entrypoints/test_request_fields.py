"""Issue 22 kinds 3, 4 and 6 through ``tandem serve`` and the ``openai`` client: token
strings that keep their identity (bytes, ``bytes:\\xNN``, k distinct top logprobs, text
offsets), ``continuous_usage_stats``, and every request field honoured or rejected."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

MODEL_NAME = "SmolLM2-135M-Instruct"  # as served by the conftest fixture
MULTIBYTE = "東京は日本の首都です。😀🎉 Ünïcödé — 北京是中国的首都。"


def _is_byte_token(s: str) -> bool:
    return s.startswith("bytes:")


def _token_bytes(s: str) -> bytes:
    """A completions token string back to its bytes (OpenAI's ``bytes:\\xNN`` or text)."""
    if _is_byte_token(s):
        return bytes(int(h, 16) for h in s[len("bytes:"):].split("\\x")[1:])
    return s.encode("utf-8")


# ----------------------------------------------------------------- kind 3: token strings
@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_of_split_characters(client, stream):
    kw = dict(model=MODEL_NAME, prompt=MULTIBYTE, max_tokens=12, temperature=0.0, logprobs=5, echo=True)
    if stream:
        text, tokens, tops, offsets = "", [], [], []
        for chunk in client.completions.create(stream=True, **kw):
            for c in chunk.choices:
                text += c.text
                if c.logprobs is not None:
                    tokens += c.logprobs.tokens
                    tops += c.logprobs.top_logprobs
                    offsets += c.logprobs.text_offset
    else:
        (c,) = client.completions.create(**kw).choices
        text, tokens, tops, offsets = c.text, c.logprobs.tokens, c.logprobs.top_logprobs, c.logprobs.text_offset
    assert text.startswith(MULTIBYTE)
    assert sum(map(_is_byte_token, tokens)) >= 6  # CJK and emoji split over tokens
    assert "\ufffd" not in "".join(tokens)
    # The tokens' bytes join to the text; offsets point at each token's characters.
    assert b"".join(map(_token_bytes, tokens)).decode("utf-8") == text
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] <= len(text)
    for tok, off in zip(tokens, offsets):
        if not _is_byte_token(tok):
            assert text[off:off + len(tok)] == tok
    for top in tops[1:]:
        assert len(top) >= 5  # k distinct entries: split tokens no longer collide on U+FFFD


def test_chat_logprob_bytes_join_to_the_content(client):
    # The model goes on repeating: 首都です。😀🎉 (split characters) then English.
    messages = [{"role": "user", "content": "Repeat exactly: " + MULTIBYTE}, {"role": "assistant", "content": "東京は日本の"}]
    kw = dict(model=MODEL_NAME, messages=messages, max_tokens=40, temperature=0.0, logprobs=True, top_logprobs=5,
              extra_body={"continue_final_message": True, "add_generation_prompt": False})
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens
    text = choice.message.content
    assert any(ord(ch) > 0x2000 for ch in text), text
    assert sum(e.token.startswith("bytes:") for e in content) >= 4
    assert bytes(b for e in content if e.bytes is not None for b in e.bytes) == text.encode("utf-8")
    for e in content:
        assert len({t.token for t in e.top_logprobs}) == 5
        if e.bytes is not None:
            assert _token_bytes(e.token) == bytes(e.bytes)
    if choice.finish_reason == "stop":
        assert content[-1].bytes is None  # <|im_end|> is not in the content
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed += c.logprobs.content
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]


# ------------------------------------------------------- kind 4: continuous usage stats
@pytest.mark.parametrize("include_usage", [False, True])
def test_completion_continuous_usage_stats(client, include_usage):
    """As vLLM: usage in every chunk only with include_usage too; alone it is ignored."""
    kw = dict(model=MODEL_NAME, prompt=["The capital of France is", "One, two,"], max_tokens=6, n=2,
              temperature=0.0, extra_body={"ignore_eos": True})
    ref = client.completions.create(**kw)
    opts = {"include_usage": include_usage, "continuous_usage_stats": True}
    seen: dict[int, int] = {}
    final = None
    prompt_lens = {}
    for chunk in client.completions.create(stream=True, stream_options=opts, **kw):
        if not chunk.choices:
            final = chunk.usage
            continue
        (c,) = chunk.choices
        if not include_usage:
            assert chunk.usage is None
            continue
        assert chunk.usage is not None, "a content chunk without usage"
        prompt_lens.setdefault(c.index // 2, chunk.usage.prompt_tokens)
        assert chunk.usage.prompt_tokens == prompt_lens[c.index // 2]
        assert chunk.usage.completion_tokens > seen.get(c.index, 0) or c.finish_reason
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        seen[c.index] = chunk.usage.completion_tokens
    assert (final is not None) == include_usage
    if include_usage:
        assert seen == {i: 6 for i in range(4)}
        assert sum(prompt_lens.values()) == ref.usage.prompt_tokens
        assert final.completion_tokens == ref.usage.completion_tokens == 24


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_continuous_usage_stats(client, include_usage):
    kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Count to five."}], max_tokens=5,
              temperature=0.0, n=2)
    ref = client.chat.completions.create(**kw)
    last: dict[int, int] = {}
    opts = {"include_usage": include_usage, "continuous_usage_stats": True}
    for chunk in client.chat.completions.create(stream=True, stream_options=opts, **kw):
        if not chunk.choices:  # the final usage chunk
            assert include_usage and chunk.usage.completion_tokens == ref.usage.completion_tokens
            continue
        (c,) = chunk.choices
        if not include_usage:
            assert chunk.usage is None
            continue
        assert chunk.usage.prompt_tokens == ref.usage.prompt_tokens
        assert chunk.usage.completion_tokens >= last.get(c.index, 0)
        last[c.index] = chunk.usage.completion_tokens
    if include_usage:
        assert sum(last.values()) == ref.usage.completion_tokens


# ---------------------------------------------------------- kind 6: request fields
def _ids_of(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.split(":", 1)[1]) for t in tokens]


def test_return_tokens_as_token_ids(client, smol_tokenizer):
    kw = dict(model=MODEL_NAME, prompt=MULTIBYTE, max_tokens=6, temperature=0.0, logprobs=3, echo=True)
    plain = client.completions.create(**kw).choices[0]
    r = client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    ids = _ids_of(r.logprobs.tokens)
    assert ids[:len(smol_tokenizer.encode(MULTIBYTE))] == smol_tokenizer.encode(MULTIBYTE)
    assert r.text == plain.text and r.logprobs.text_offset == plain.logprobs.text_offset
    for top in r.logprobs.top_logprobs[1:]:
        _ids_of(list(top))
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0.0, logprobs=True, top_logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True})
    for e in chat.choices[0].logprobs.content:
        _ids_of([e.token, *(t.token for t in e.top_logprobs)])


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_allowed_token_ids(client, endpoint):
    allowed = [7042, 38634, 30, 28, 216]  # " Paris", "Paris", ".", ",", " "
    kw = dict(model=MODEL_NAME, max_tokens=12, temperature=1.0, seed=3, logprobs=True if endpoint == "chat" else 0,
              extra_body={"allowed_token_ids": allowed, "ignore_eos": True, "return_tokens_as_token_ids": True})
    if endpoint == "chat":
        r = client.chat.completions.create(messages=[{"role": "user", "content": "Name a city."}], **kw)
        ids = _ids_of([e.token for e in r.choices[0].logprobs.content])
    else:
        r = client.completions.create(prompt="My favourite word is", **kw)
        ids = _ids_of(r.choices[0].logprobs.tokens)
    assert len(ids) == 12 and set(ids) <= set(allowed)


def test_bad_words(client, smol_tokenizer):
    kw = dict(model=MODEL_NAME, prompt="The capital of France is", max_tokens=12, temperature=0.0, logprobs=0)
    as_ids = {"return_tokens_as_token_ids": True}
    base = _ids_of(client.completions.create(**kw, extra_body=as_ids).choices[0].logprobs.tokens)
    at = base.index(7042)  # " Paris"
    r = client.completions.create(**kw, extra_body={"bad_words": ["Paris"], **as_ids})
    ids = _ids_of(r.choices[0].logprobs.tokens)
    assert 7042 not in ids and 38634 not in ids and "Paris" not in r.choices[0].text
    # A two-token word from the greedy text (" Paris" and what follows it): only its last
    # token is banned, right after its first.
    word = smol_tokenizer.decode(base[at:at + 2]).strip()
    assert smol_tokenizer.encode(" " + word, add_special_tokens=False) == base[at:at + 2]
    r = client.completions.create(**kw, extra_body={"bad_words": [word], **as_ids})
    ids = _ids_of(r.choices[0].logprobs.tokens)
    assert ids[:at + 1] == base[:at + 1] and ids[at + 1] != base[at + 1]
    assert not any(ids[i:i + 2] == base[at:at + 2] for i in range(len(ids) - 1))


def test_chat_prompt_logprobs(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       temperature=0.0, extra_body={"prompt_logprobs": 2})
    plp = r.model_extra["prompt_logprobs"]
    assert len(plp) == r.usage.prompt_tokens and plp[0] is None
    for pos in plp[1:]:
        assert 1 <= len(pos) <= 3 and all(v["logprob"] <= 0.0 and v["decoded_token"] for v in pos.values())


BAD = [
    ("seed", {"seed": 2**63}),
    ("seed", {"seed": -(2**63) - 1}),
    ("top_k", {"top_k": 2**64}),
    ("min_tokens", {"min_tokens": 2**64}),
    ("max_tokens", {"max_tokens": 2**64}),
    ("temperature", {"temperature": "RAW:1e400"}),  # a JSON number that parses to inf
    ("allowed_token_ids", {"allowed_token_ids": []}),
    ("allowed_token_ids", {"allowed_token_ids": [49152]}),
    ("allowed_token_ids", {"allowed_token_ids": [-1]}),
    ("bad_words", {"bad_words": [""]}),
    ("prompt_logprobs", {"prompt_logprobs": 1, "stream": True}),
    ("prompt_logprobs", {"prompt_logprobs": 21}),
    ("no_such_field", {"no_such_field": 1}),
    ("stream", {"stream": "yes"}),  # booleans are JSON booleans, as OpenAI's API takes them
    ("ignore_eos", {"ignore_eos": 1}),
    ("skip_special_tokens", {"skip_special_tokens": "false"}),
    ("stream_options", {"stream": True, "stream_options": {"include_usage": True, "bogus": 1}}),
    ("guided_json", {"guided_json": {"type": "nonsense"}}),  # supported field, invalid schema
    ("regex", {"regex": "("}),  # SGLang's fields
    ("ebnf", {"ebnf": "root ::= "}),
    ("stop_regex", {"stop_regex": "("}),
    ("stop_regex", {"stop_regex": ["and", "x*"]}),  # matches the empty string: would stop at once
]


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize("param,fields", BAD, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD)])
def test_fields_out_of_range_or_unknown_are_rejected(server, endpoint, param, fields):
    body = {"model": MODEL_NAME, "max_tokens": 2, **fields}
    body |= {"prompt": "Hi"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    raw = json.dumps(body).replace('"RAW:1e400"', "1e400")
    r = httpx.post(f"{server.url}/v1/{endpoint}", content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert param in err["message"], err


def test_largest_seed_is_accepted(client):
    for seed in (2**63 - 1, -(2**63)):
        r = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, temperature=1.0, seed=seed, n=2)
        assert r.usage.completion_tokens == 4  # the second completion's seed wraps around
    r = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, temperature=1.0, extra_body={"top_k": 10**9})
    assert r.usage.completion_tokens == 2  # larger than the vocabulary: no top-k


def test_openai_client_sees_unknown_field(client):
    with pytest.raises(openai.BadRequestError, match="logprob_typo"):
        client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, extra_body={"logprob_typo": 3})
