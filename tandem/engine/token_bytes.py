"""Exact bytes and OpenAI-style strings of single tokens, for logprobs.

A byte-level BPE token (GPT-2, Llama 3, Qwen, SmolLM2) may hold part of a UTF-8
character: decoding it alone gives U+FFFD, so distinct tokens collide and their bytes no
longer join to the text. The bytes of a token come from the tokenizer's own tables, read
from its ``tokenizers`` decoder:

* ``ByteLevel``: every byte is spelled by one printable character of the GPT-2 table
  (``bytes_to_unicode``, as transformers converts byte-level vocabularies);
* ``ByteFallback`` (SentencePiece, Llama 2 / Mistral): a byte is the token ``<0xNN>``, and
  ``Replace``/``Metaspace`` spell the space ``▁``;
* added tokens (``<|im_end|>``) are their content; any other decoder decodes the token alone.

Strings follow OpenAI's convention: the text when the bytes are valid UTF-8 on their own,
else ``bytes:`` and the bytes as ``\\xNN`` escapes (``bytes:\\xe6\\x97``).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

from tandem.engine.detokenizer import _backend_tokenizer

__all__ = ["TokenBytes", "token_id_string"]

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_id_string(token_id: int) -> str:
    """vLLM's ``return_tokens_as_token_ids`` spelling of a token: ``token_id:N``."""
    return f"token_id:{token_id}"


def _decoder_types(spec: dict) -> list[dict]:
    """The decoders of a ``tokenizers`` decoder spec, a ``Sequence`` flattened."""
    if spec.get("type") == "Sequence":
        return [d for sub in spec.get("decoders", []) for d in _decoder_types(sub)]
    return [spec]


class TokenBytes:
    """Bytes and strings of single tokens of one tokenizer (cached per id).

    Args:
        tokenizer: a Hugging Face fast tokenizer or a ``tokenizers.Tokenizer``.

    Raises:
        TypeError: not a fast tokenizer.
    """

    def __init__(self, tokenizer) -> None:
        self._backend = _backend_tokenizer(tokenizer)
        decoder = self._backend.decoder
        specs = _decoder_types(json.loads(decoder.__getstate__())) if decoder is not None else []
        kinds = {d.get("type") for d in specs}
        self._byte_level = "ByteLevel" in kinds
        self._byte_fallback = "ByteFallback" in kinds
        self._space = next((d.get("replacement") for d in specs if d.get("type") == "Metaspace"), None) or next(
            (d["pattern"].get("String") for d in specs if d.get("type") == "Replace" and d.get("content") == " "
             and isinstance(d.get("pattern"), dict)), None)
        self._added = {i: t.content for i, t in self._backend.get_added_tokens_decoder().items()}
        self._special = {i for i, t in self._backend.get_added_tokens_decoder().items() if t.special}
        if self._byte_level:
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self._char_byte = {c: b for b, c in bytes_to_unicode().items()}
        self.token_bytes = lru_cache(maxsize=None)(self._token_bytes)

    def is_special(self, token_id: int) -> bool:
        """A special added token (EOS, chat markers): its text is left out under
        ``skip_special_tokens``."""
        return token_id in self._special

    def _token_bytes(self, token_id: int) -> bytes:
        """The exact bytes token ``token_id`` adds to a text."""
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in self._char_byte for c in piece):
            return bytes(self._char_byte[c] for c in piece)
        if self._byte_fallback and (m := _BYTE_TOKEN.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        if self._space is not None:
            return piece.replace(self._space, " ").encode("utf-8")
        return self._backend.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_string(self, token_id: int) -> str:
        """The token's text, or ``bytes:\\xNN...`` when its bytes are not valid UTF-8 alone."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
