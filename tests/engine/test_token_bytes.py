"""Exact bytes and OpenAI strings of single tokens (byte-level BPE and SentencePiece byte fallback)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers

from tandem.engine.token_bytes import TokenBytes, token_id_string

TEXTS = ["東京は日本の首都です。", "😀🎉 Ünïcödé — ok", " café\n\tdéjà vu", "北京是中国的首都。"]


def test_byte_level_tokens_keep_their_bytes(smol_tokenizer):
    tb = TokenBytes(smol_tokenizer)
    for text in TEXTS:
        ids = smol_tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(tb.token_bytes(i) for i in ids) == text.encode("utf-8")
        strings = [tb.token_string(i) for i in ids]
        assert "\ufffd" not in "".join(strings)
        for i, s in zip(ids, strings):
            raw = tb.token_bytes(i)
            if s.startswith("bytes:"):
                assert s == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
                with pytest.raises(UnicodeDecodeError):
                    raw.decode("utf-8")
            else:
                assert s.encode("utf-8") == raw
    assert any(tb.token_string(i).startswith("bytes:") for i in smol_tokenizer.encode(TEXTS[0]))
    # Every token of the vocabulary has its own bytes: no two collide.
    vocab = [tb.token_bytes(i) for i in range(len(smol_tokenizer))]
    assert len(set(vocab)) == len(vocab)
    eos = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tb.token_string(eos) == "<|im_end|>" and tb.is_special(eos) and not tb.is_special(ids[0])
    assert token_id_string(42) == "token_id:42"


def _byte_fallback_tokenizer() -> Tokenizer:
    """A tiny Llama-2-style SentencePiece BPE: ``▁`` for spaces, ``<0xNN>`` byte tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "a", "b", "▁a", "▁ab", "é"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [("▁", "a"), ("▁a", "b")], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


def test_byte_fallback_tokens_keep_their_bytes():
    tok = _byte_fallback_tokenizer()
    tb = TokenBytes(tok)
    text = "ab é 日"
    ids = tok.encode(text).ids
    pieces = [tok.id_to_token(i) for i in ids]
    assert "<0xE6>" in pieces  # 日 falls back to bytes
    assert b"".join(tb.token_bytes(i) for i in ids) == (" " + text).encode("utf-8")
    assert tb.token_string(tok.token_to_id("<0xE6>")) == "bytes:\\xe6"
    assert tb.token_string(tok.token_to_id("▁ab")) == " ab"
    assert tb.token_string(tok.token_to_id("</s>")) == "</s>"
