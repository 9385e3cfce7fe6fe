"""xgrammar vs llguidance on a tokenizer: grammar compile time and per-token mask time
(issue 18: which library Tandem's structured outputs use); with ``--host-step``, the
engine core's grammar work per step instead.

For each JSON schema of a small varied set, and each library (alternated, ``--repeats``
times): the time to compile the schema (xgrammar: ``GrammarCompiler.compile_json_schema``
with its cache off; llguidance: ``LLMatcher`` construction, which compiles lazily), and the
time of every ``fill_next_token_bitmask`` call while the matcher walks a valid document of
the schema token by token (both with JSON's flexible whitespace, their default; the work Tandem does per constrained sequence per step). Times
are wall clock on this machine; prints medians and percentiles.

    python benchmarks/grammar_backends.py [--tokenizer PATH] [--repeats 5]

``--host-step``: the host work that stands between a step's tokens and the next step's
sampling when every sequence is constrained to the bench's user-profile schema: advance
N matchers by their tokens and fill N bitmask rows, per step, N from ``--seqs``. Two
copies of the same sequences are driven with the same tokens: one the way Tandem did it
before (one xgrammar call per sequence and per row: accept, ``is_terminated``, fill) and
one through ``StructuredOutputManager`` (one batched accept, one batched fill on
``--threads`` threads); the two are timed alternately every step and their bitmasks
checked equal. Tokens are drawn uniformly from each row's allowed set (what a model with
random weights does under the mask, as in the GPU benchmark of RESULTS.md; a sequence
restarts, as a new request, after ``--output-len`` tokens) or (``--draw document``) are
those of a valid profile document and EOS; a sequence also restarts when its grammar
ends, and the sequences start at staggered points of their life. Also printed: the time
the engine core takes to decode one request constrained to that schema (per request, on
the core's loop thread), parsing its schema every time vs once per process.

    python benchmarks/grammar_backends.py --host-step [--tokenizer PATH --vocab V] \
        [--seqs 8 64 256] [--steps 60] [--repeats 3] [--threads 1 2]

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
    row constrained (the runner's in-order case), on CUDA when available (CUDA events) else the CPU."""
    import torch

    from tandem.structured_output.bitmask import apply_token_bitmask

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    logits = torch.randn(rows, vocab, device=dev)
    mask = torch.randint(-2**31, 2**31 - 1, (rows, -(-vocab // 32)), dtype=torch.int32, device=dev)
    times = []
    for _ in range(iters + 2):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            apply_token_bitmask(logits, None, mask)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            apply_token_bitmask(logits, None, mask)
            times.append(time.perf_counter() - t)
    return dev.type, statistics.median(times[2:])


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class _Seqs:
    """``n`` constrained sequences of one schema, driven through one way of doing a step's
    grammar work; ``restart(i)`` gives sequence ``i`` a fresh request."""

    def __init__(self, manager, schema: dict, n: int) -> None:
        from tandem.structured_output import StructuredOutputsParams

        self.manager, self.params = manager, StructuredOutputsParams(json=schema)
        self.reqs = [self._new() for _ in range(n)]

    def _new(self):
        from tandem.request import Request
        from tandem.sampling_params import SamplingParams

        req = Request("bench", [0], SamplingParams(structured_outputs=self.params), 0.0)
        self.manager.init_request(req)
        req.structured_output._compiled.result()
        return req

    def restart(self, i: int) -> None:
        self.reqs[i] = self._new()


def per_sequence_step(seqs: _Seqs, toks: list[int]):
    """Tandem's grammar work per step before the batched calls: the scheduler's
    per-sequence accept, then a fresh bitmask and one fill per row (the previous
    ``grammar_bitmask``). Returns the bitmask and the accept's seconds."""
    import xgrammar as xgr

    t = time.perf_counter()
    for req, tok in zip(seqs.reqs, toks):
        m = req.structured_output.matcher
        if not m.accept_token(tok) or m.is_terminated():
            req.structured_output.finished = True
    t_accept = time.perf_counter() - t
    bitmask = xgr.allocate_token_bitmask(len(seqs.reqs), seqs.manager.vocab_size)
    for row, req in enumerate(seqs.reqs):
        if not req.structured_output.matcher.is_terminated():
            req.structured_output.matcher.fill_next_token_bitmask(bitmask, row)
    return bitmask, t_accept


def batched_step(seqs: _Seqs, toks: list[int]):
    """The same through the engine's path: ``Scheduler.advance_grammars``'s gathering
    and one batched accept, then one batched fill into the reused buffer
    (``StructuredOutputManager``)."""
    t = time.perf_counter()
    requests = {r.seq_id: r for r in seqs.reqs}
    reqs, batch_toks = [], []
    for sid, tok in zip(requests, toks):
        req = requests.get(sid)
        if req is not None and req.structured_output is not None:
            reqs.append(req)
            batch_toks.append(tok)
    seqs.manager.accept_tokens(reqs, batch_toks)
    t_accept = time.perf_counter() - t
    return seqs.manager.grammar_bitmask(list(requests), requests).bitmask, t_accept


def _draw(bitmask, vocab: int, rng) -> list[int]:
    """One token per row, uniform over the row's allowed ids."""
    import numpy as np

    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return [int(rng.choice(np.flatnonzero(row))) for row in bits]


def _mask(seqs: _Seqs):
    return seqs.manager.grammar_bitmask([r.seq_id for r in seqs.reqs], {r.seq_id: r for r in seqs.reqs}).bitmask


def host_step_run(tok, vocab: int, n: int, steps: int, output_len: int, threads: int, seed: int,
                  document: bool) -> dict[str, list[tuple[float, float, float]]]:
    """Seconds per step (wall, wall of the accept, CPU time of the process) of the per-sequence and of the
    batched grammar work for ``n`` sequences over ``steps`` steps, after a staggered start
    (untimed). Tokens: uniform over the allowed ones, or (``document``) those of a valid
    document, then EOS."""
    import numpy as np
    import torch

    from tandem.structured_output.manager import StructuredOutputManager

    os.environ["TANDEM_STRUCTURED_OUTPUT_THREADS"] = str(threads)
    rng = np.random.default_rng(seed)
    schema, doc = user_profile()
    doc_ids = tok.encode(json.dumps(doc), add_special_tokens=False) + [tok.eos_token_id]
    if document:
        output_len = len(doc_ids)
    old, new = (_Seqs(StructuredOutputManager(tok, vocab, {tok.eos_token_id}), schema, n) for _ in range(2))
    produced = [0] * n

    def draw(mask) -> list[int]:
        return [doc_ids[p] for p in produced] if document else _draw(mask, vocab, rng)

    def restart_done(force: bool) -> None:
        for i in range(n):
            if new.reqs[i].structured_output.finished or (force and produced[i] >= output_len):
                old.restart(i)
                new.restart(i)
                produced[i] = 0

    # Staggered start: sequence i first produces i * output_len / n tokens.
    start = [i * output_len // n for i in range(n)]
    while any(p < t for p, t in zip(produced, start)):
        toks = draw(_mask(new))
        idx = [i for i in range(n) if produced[i] < start[i]]
        for seqs in (old, new):
            seqs.manager.accept_tokens([seqs.reqs[i] for i in idx], [toks[i] for i in idx])
        for i in idx:
            produced[i] += 1
        restart_done(False)
    times = {"per-sequence": [], "batched": []}  # (wall, wall of the accept, CPU of all threads) s per step
    mask = _mask(new)
    for step in range(steps):
        toks = draw(mask)
        runs = [(old, per_sequence_step, times["per-sequence"]), (new, batched_step, times["batched"])]
        masks = []
        for seqs, fn, out in (runs if step % 2 == 0 else runs[::-1]):
            t, c = time.perf_counter(), time.process_time()
            bitmask, t_accept = fn(seqs, toks)
            out.append((time.perf_counter() - t, t_accept, time.process_time() - c))
            masks.append(bitmask)
        assert torch.equal(*masks), f"the two ways' bitmasks differ at step {step}"
        produced = [p + 1 for p in produced]
        restart_done(True)
        # A restarted sequence's first token comes from its fresh grammar (untimed here;
        # the engine fills that row with the others).
        mask = _mask(new)
    for seqs in (old, new):
        seqs.manager.shutdown()
    return times


def request_decode_timing(repeats: int = 20) -> None:
    """The engine core's decode of one request constrained to the profile schema (msgspec
    runs the params' parse): with the process's memory of parsed constraints cleared
    before each decode (every decode parses, as before that memory) and kept, alternated."""
    from tandem.engine.messages import EngineCoreRequest, MsgpackDecoder, MsgpackEncoder
    from tandem.sampling_params import SamplingParams
    from tandem.structured_output import StructuredOutputsParams, params

    schema, _ = user_profile()
    msg = MsgpackEncoder().encode(EngineCoreRequest(
        "r", [1] * 128, SamplingParams(max_tokens=256, structured_outputs=StructuredOutputsParams(json=schema)), 256, 0.0))
    decoder = MsgpackDecoder(EngineCoreRequest)
    times = {"parse every time": [], "parsed once": []}
    for r in range(repeats):
        for name in (list(times) if r % 2 == 0 else list(times)[::-1]):
            if name == "parse every time":
                params._PARSED.clear()
            t = time.perf_counter()
            decoder.decode(msg)
            times[name].append(time.perf_counter() - t)
    print("engine core decode of one profile-schema request: " + "; ".join(
        f"{k} median {statistics.median(v) * 1e3:.3f} ms (min {min(v) * 1e3:.3f}, max {max(v) * 1e3:.3f})"
        for k, v in times.items()))


def host_step_main(args, tok, vocab: int) -> None:
    from tandem.structured_output import manager

    request_decode_timing()

    print(f"host work per step, user-profile schema, tokens: {args.draw}, {args.steps} timed steps x {args.repeats} "
          f"repeats; per-sequence vs batched, alternated every step")
    for n in args.seqs:
        for threads in args.threads:
            used = max(1, min(threads, n // manager._ROWS_PER_THREAD))
            runs = [host_step_run(tok, vocab, n, args.steps, args.output_len, threads, r, args.draw == "document")
                    for r in range(args.repeats)]
            print(f"N={n:4d} TANDEM_STRUCTURED_OUTPUT_THREADS={threads} (fill threads {used}), ms per step, "
                  f"median (p10-p90) / mean; load average {os.getloadavg()}:")
            for way in ("per-sequence", "batched"):
                total = [t for run in runs for t, _, _ in run[way]]
                accept = [a for run in runs for _, a, _ in run[way]]
                mask = [t - a for run in runs for t, a, _ in run[way]]
                cpu = [c for run in runs for _, _, c in run[way]]
                reps = ", ".join(f"{statistics.median([t for t, _, _ in run[way]]) * 1e3:.3f}" for run in runs)
                print(f"    {way:12s} wall {_ms(total)}; accept {_ms(accept)}; mask {_ms(mask)}; CPU {_ms(cpu)}; "
                      f"wall repeat medians {reps}")
            ratios = [o / b for run in runs for (o, _, _), (b, _, _) in zip(run["per-sequence"], run["batched"])]
            means = [statistics.mean([t for run in runs for t, _, _ in run[way]]) for way in ("per-sequence", "batched")]
            print(f"    per-sequence / batched wall, per step: median {statistics.median(ratios):.2f}x "
                  f"(p10 {pct(ratios, 0.1):.2f}, p90 {pct(ratios, 0.9):.2f}); of the means {means[0] / means[1]:.2f}x")


def _ms(xs: list[float]) -> str:
    return (f"{statistics.median(xs) * 1e3:.3f} ({pct(xs, 0.1) * 1e3:.3f}-{pct(xs, 0.9) * 1e3:.3f}) / "
            f"{statistics.mean(xs) * 1e3:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=None, help="HF folder or GGUF (default: the embedded SmolLM2)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--apply-rows", type=int, nargs="*", default=[8, 64, 256],
                   help="also time the bitmask application on this many rows of logits")
    p.add_argument("--apply-vocab", type=int, default=None, help="vocabulary of that timing (default: the tokenizer's)")
    p.add_argument("--host-step", action="store_true", help="time the engine's grammar work per step instead")
    p.add_argument("--seqs", type=int, nargs="+", default=[8, 64, 256], help="(--host-step) constrained sequences")
    p.add_argument("--threads", type=int, nargs="+", default=None,
                   help="(--host-step) fill threads to try (default: TANDEM_STRUCTURED_OUTPUT_THREADS's default)")
    p.add_argument("--steps", type=int, default=60, help="(--host-step) timed steps per repeat")
    p.add_argument("--output-len", type=int, default=256, help="(--host-step) tokens per request (uniform draws)")
    p.add_argument("--draw", choices=("uniform", "document"), default="uniform",
                   help="(--host-step) tokens uniform over the allowed ones (a random-weights model, as the GPU "
                        "benchmark), or those of a valid profile document")
    p.add_argument("--vocab", type=int, default=None,
                   help="logits width (default: the embedded model's, else the tokenizer's length)")
    args = p.parse_args()
    from tandem.config import embedded_default_model
    from tandem.model_loader.loader import load_hf_config, load_tokenizer

    path = args.tokenizer or embedded_default_model()
    tok = load_tokenizer(path)
    vocab = args.vocab or (getattr(load_hf_config(path), "vocab_size", len(tok)) if args.tokenizer is None else len(tok))
    if args.host_step:
        from tandem import envs

        args.threads = args.threads or [envs.TANDEM_STRUCTURED_OUTPUT_THREADS]
        print(f"tokenizer {path} ({vocab} ids), {os.cpu_count()} CPUs, load average {os.getloadavg()}")
        host_step_main(args, tok, vocab)
        print(f"load average after {os.getloadavg()}")
        return
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
