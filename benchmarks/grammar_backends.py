"""xgrammar vs llguidance on a tokenizer: grammar compile time and per-token mask time
(issue 18: which library Tandem's structured outputs use).

For each JSON schema of a small varied set, and each library (alternated, ``--repeats``
times): the time to compile the schema (xgrammar: ``GrammarCompiler.compile_json_schema``
with its cache off; llguidance: ``LLMatcher`` construction, which compiles lazily), and the
time of every ``fill_next_token_bitmask`` call while the matcher walks a valid document of
the schema token by token (both with JSON's flexible whitespace, their default; the work Tandem does per constrained sequence per step). Times
are wall clock on this machine; prints medians and percentiles.

    python benchmarks/grammar_backends.py [--tokenizer PATH] [--repeats 5]

Needs ``pip install xgrammar llguidance``; the default tokenizer is the embedded SmolLM2's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

SCHEMAS = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}, {"name": "Alice Smith", "age": 31}),
    "nested": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]}},
        "required": ["name", "age", "tags", "address"], "additionalProperties": False},
        {"name": "Alice Smith", "age": 31, "tags": ["a", "b"], "address": {"city": "Paris", "zip": "75001"}}),
}


def user_profile():
    from tandem.benchmarks.datasets import load_json_schema

    doc = {"name": "Ann Lee", "age": 40, "email": "ann.lee@mail.com",
           "address": {"street": "1 Main St", "city": "Lyon", "country": "France", "postal_code": "69001"},
           "interests": ["music", "travel"],
           "friends": [{"name": "Bob", "since_year": 2001, "close": True},
                       {"name": "Cleo", "since_year": 2015, "close": False}],
           "bio": "Likes long walks and short meetings."}
    return load_json_schema(), doc


def xgrammar_run(tok, vocab: int, schema: dict, ids: list[int]) -> tuple[float, list[float]]:
    import xgrammar as xgr

    info = xgrammar_run.info = getattr(xgrammar_run, "info", None) or xgr.TokenizerInfo.from_huggingface(
        tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1), cache_enabled=False)
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema))
    compile_s = time.perf_counter() - t
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    fills = []
    for tid in ids:
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        fills.append(time.perf_counter() - t)
        assert matcher.accept_token(tid), tid
    return compile_s, fills


def llguidance_run(tok, vocab: int, schema: dict, ids: list[int]) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    lltok = llguidance_run.tok = getattr(llguidance_run, "tok", None) or llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    t = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema))
    compile_s = time.perf_counter() - t
    assert not matcher.get_error(), matcher.get_error()
    bitmask = lt.allocate_token_bitmask(1, vocab)
    fills = []
    for tid in ids:
        t = time.perf_counter()
        lt.fill_next_token_bitmask(matcher, bitmask, 0)
        fills.append(time.perf_counter() - t)
        assert matcher.consume_token(tid), (tid, matcher.get_error())
    return compile_s, fills


def apply_timing(vocab: int, rows: int, iters: int = 20) -> tuple[str, float]:
    """Median time of Tandem's ``apply_token_bitmask`` on ``[rows, vocab]`` fp32 logits, every
    row constrained, on CUDA when available (CUDA events) else the CPU."""
    import torch

    from tandem.structured_output.bitmask import apply_token_bitmask

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    logits = torch.randn(rows, vocab, device=dev)
    mask = torch.randint(-2**31, 2**31 - 1, (rows, -(-vocab // 32)), dtype=torch.int32, device=dev)
    idx = torch.arange(rows, device=dev)
    times = []
    for _ in range(iters + 2):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            apply_token_bitmask(logits, idx, mask)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            apply_token_bitmask(logits, idx, mask)
            times.append(time.perf_counter() - t)
    return dev.type, statistics.median(times[2:])


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=None, help="HF folder or GGUF (default: the embedded SmolLM2)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--apply-rows", type=int, nargs="*", default=[8, 64, 256],
                   help="also time the bitmask application on this many rows of logits")
    p.add_argument("--apply-vocab", type=int, default=None, help="vocabulary of that timing (default: the tokenizer's)")
    args = p.parse_args()
    from tandem.config import embedded_default_model
    from tandem.model_loader.loader import load_hf_config, load_tokenizer

    path = args.tokenizer or embedded_default_model()
    tok = load_tokenizer(path)
    vocab = getattr(load_hf_config(path), "vocab_size", len(tok)) if args.tokenizer is None else len(tok)
    schemas = dict(SCHEMAS, user_profile=user_profile())
    runs = {"xgrammar": xgrammar_run, "llguidance": llguidance_run}
    print(f"tokenizer {path} ({vocab} ids), load average {os.getloadavg()}")
    for name, (schema, doc) in schemas.items():
        ids = tok.encode(json.dumps(doc), add_special_tokens=False)
        res = {lib: ([], []) for lib in runs}
        for r in range(args.repeats):
            for lib in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                c, fills = runs[lib](tok, vocab, schema, ids)
                res[lib][0].append(c)
                res[lib][1].extend(fills)
        for lib, (compiles, fills) in res.items():
            print(f"{name:13s} {lib:10s} compile median {statistics.median(compiles) * 1e3:7.2f} ms "
                  f"(min {min(compiles) * 1e3:.2f}, max {max(compiles) * 1e3:.2f}); mask per token: median "
                  f"{statistics.median(fills) * 1e6:6.1f} us, mean {statistics.mean(fills) * 1e6:6.1f} us, "
                  f"p90 {pct(fills, 0.9) * 1e6:6.1f} us, max {max(fills) * 1e6:7.0f} us ({len(ids)} tokens x "
                  f"{args.repeats})")
    for rows in args.apply_rows:
        dev, sec = apply_timing(args.apply_vocab or vocab, rows)
        print(f"apply_token_bitmask [{rows}, {args.apply_vocab or vocab}] on {dev}: median {sec * 1e6:.0f} us")


if __name__ == "__main__":
    main()
