"""Accuracy parity: a task's result with each overlap feature on and then off.

Every overlap feature must be invisible in the results (docs/architecture.md): with greedy decoding
the same prompts give the same tokens whether the feature is on or off. ``run_parity``
evaluates the task once per setting of each variant in ``OVERLAP_VARIANTS`` (the other
engine options as given) and fails when

- a score differs (any filter, compared exactly), or
- any answer differs: the extracted prediction or the raw output text (generative tasks);
  the chosen letter or the greedy next token (multiple choice), or
- (multiple choice) a continuation's log-probability differs by more than ``logprob_atol``
  or is present in one run and absent from the other.

Variants are named engine-option sets: a variant flips its feature's switch and leaves the
other engine options as given, so ``--all2all-backend simulated --dbo-decode-token-threshold
4`` and the like apply to both of its runs. After the "on" run a variant may say whether the
feature acted at all (``dbo``: how many steps were split; none on a dense model, whose
parity is then vacuous). A variant whose options ``EngineArgs`` does not have is reported
as skipped with the reason. To cover a new feature, append an ``OverlapVariant`` to
``OVERLAP_VARIANTS``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from tandem.eval.runner import EvalResult, _fmt, evaluate


@dataclass(frozen=True)
class OverlapVariant:
    """An overlap feature: the engine options that turn it on and off."""

    name: str
    description: str
    on: dict
    off: dict
    # backend of the "on" run -> a line on how much the feature acted (None: nothing to say)
    activity: Callable[[object], str | None] | None = None

    def missing_options(self) -> list[str]:
        from tandem.engine.arg_utils import EngineArgs

        known = {f.name for f in fields(EngineArgs)}
        return sorted((set(self.on) | set(self.off)) - known)


def _dbo_activity(backend) -> str | None:
    runner = getattr(getattr(getattr(backend, "llm", None), "engine", None), "runner", None)
    n = getattr(runner, "num_dbo_steps", None)
    if n is None:
        return None
    if n == 0:
        return ("DBO split no step (a dense model, or every step under --dbo-*-token-threshold): "
                "this parity check is vacuous")
    return f"DBO split {n} steps into two ubatches"


OVERLAP_VARIANTS: list[OverlapVariant] = [
    OverlapVariant("async_output_proc", "asynchronous output processing (one-step-ahead scheduling)",
                   {"async_output_proc": True}, {"async_output_proc": False}),
    OverlapVariant("dbo", "dual-batch overlap of MoE all-to-all and compute",
                   {"enable_dbo": True}, {"enable_dbo": False}, _dbo_activity),
]


@dataclass
class VariantReport:
    name: str
    description: str
    status: str  # "pass", "fail" or "skipped"
    reason: str = ""
    on: EvalResult | None = None
    off: EvalResult | None = None
    score_diffs: list[str] = field(default_factory=list)
    answer_diffs: list[dict] = field(default_factory=list)
    max_logprob_diff: float | None = None
    activity: str | None = None

    def to_json(self, samples: bool = False) -> dict:
        out = {"name": self.name, "description": self.description, "status": self.status, "reason": self.reason,
               "activity": self.activity,
               "score_diffs": self.score_diffs, "answer_diffs": self.answer_diffs,
               "max_logprob_diff": self.max_logprob_diff}
        for key in ("on", "off"):
            r = getattr(self, key)
            if r is not None:
                d = r.to_json()
                if not samples:
                    d.pop("samples")
                out[key] = d
        return out


def compare_results(a: EvalResult, b: EvalResult, logprob_atol: float = 1e-3) -> tuple[list[str], list[dict], float | None]:
    """Differences between two runs of the same task and documents.

    Returns (score differences, answer differences, largest log-probability difference or
    None for generative tasks).
    """
    score_diffs = []
    for f in a.metrics:
        va, vb = a.metrics[f]["value"], (b.metrics.get(f) or {}).get("value")
        if va != vb and not (isinstance(va, float) and isinstance(vb, float) and math.isnan(va) and math.isnan(vb)):
            score_diffs.append(f"{f}: {a.metrics[f]['metric']} {va!r} != {vb!r}")
    answer_diffs = []
    max_lp = None
    if len(a.samples) != len(b.samples):
        return score_diffs + [f"document count {len(a.samples)} != {len(b.samples)}"], answer_diffs, max_lp
    for sa, sb in zip(a.samples, b.samples):
        why = []
        if sa["doc_id"] != sb["doc_id"]:
            why.append("doc_id")
        if sa["predictions"] != sb["predictions"]:
            why.append("prediction")
        if sa["raw_output"] != sb["raw_output"]:
            why.append("raw_output")
        if "logprobs" in sa:
            for x, y in zip(sa["logprobs"], sb["logprobs"]):
                if (x is None) != (y is None):
                    why.append("logprobs (present in one run only)")
                    break
                if x is not None:
                    d = abs(x - y)
                    max_lp = d if max_lp is None else max(max_lp, d)
                    if d > logprob_atol:
                        why.append(f"logprobs (|diff| {d:.2e} > {logprob_atol:g})")
                        break
            if max_lp is None:
                max_lp = 0.0
        if why:
            answer_diffs.append({"doc_id": sa["doc_id"], "why": why,
                                 "on": {"raw_output": sa["raw_output"], "predictions": sa["predictions"]},
                                 "off": {"raw_output": sb["raw_output"], "predictions": sb["predictions"]}})
    return score_diffs, answer_diffs, max_lp


def default_backend_factory(top_n: int = 20):
    from tandem.eval.backends import OfflineBackend

    return lambda kwargs: OfflineBackend.from_engine_args(top_n=top_n, **kwargs)


def run_parity(task, engine_kwargs: dict, num_fewshot: int | None = None, limit: int | None = None,
               max_tokens: int | None = None, variants: list[str] | None = None, logprob_atol: float = 1e-3,
               make_backend=None, log=None) -> list[VariantReport]:
    """Evaluate ``task`` with each variant on, then off; compare.

    Args:
        engine_kwargs: ``EngineArgs`` fields shared by all runs (a variant's own options
            override them).
        variants: names to run (None: all of ``OVERLAP_VARIANTS``).
        make_backend: ``engine_kwargs -> backend``; default: Tandem's offline engine.

    Raises:
        ValueError: an unknown variant name.
    """
    known = {v.name: v for v in OVERLAP_VARIANTS}
    names = variants or list(known)
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown overlap variants {bad}; known: {sorted(known)}")
    make_backend = make_backend or default_backend_factory()
    reports = []
    for name in names:
        v = known[name]
        missing = v.missing_options()
        if missing:
            reports.append(VariantReport(v.name, v.description, "skipped",
                                         f"not in this engine yet (EngineArgs has no {', '.join(missing)}); "
                                         "it joins the parity run once the engine has it"))
            if log:
                log(f"[parity] {v.name}: skipped ({reports[-1].reason})")
            continue
        runs = {}
        activity = None
        for setting, opts in (("on", v.on), ("off", v.off)):
            if log:
                log(f"[parity] {v.name}={setting} ({opts})")
            backend = make_backend({**engine_kwargs, **opts})
            try:
                runs[setting] = evaluate(task, backend, num_fewshot, limit, max_tokens)
                if setting == "on" and v.activity is not None:
                    activity = v.activity(backend)
            finally:
                backend.close()
        sd, ad, mlp = compare_results(runs["on"], runs["off"], logprob_atol)
        rep = VariantReport(v.name, v.description, "fail" if sd or ad else "pass", "", runs["on"], runs["off"], sd, ad, mlp,
                            activity)
        if sd or ad:
            rep.reason = f"{len(sd)} score(s) and {len(ad)} answer(s) differ"
        reports.append(rep)
    return reports


def format_parity(reports: list[VariantReport]) -> str:
    """A table of each variant's scores on and off, then the verdict per variant."""
    header = ["Variant", "Setting", "Task", "Filter", "n-shot", "Metric", "Value", "Stderr", "Answers differing", "Status"]
    rows = []
    for r in reports:
        if r.status == "skipped":
            rows.append([r.name, "-", "-", "-", "-", "-", "-", "-", "-", f"skipped: {r.reason}"])
            continue
        for setting in ("on", "off"):
            res: EvalResult = getattr(r, setting)
            for f, m in res.metrics.items():
                rows.append([r.name, setting, res.task, f, str(res.num_fewshot), m["metric"], _fmt(m["value"]),
                             _fmt(m["stderr"]), str(len(r.answer_diffs)) + f"/{res.n}",
                             r.status.upper() if r.status != "fail" else f"FAIL ({r.reason})"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "|" + "|".join(c.ljust(w) for c, w in zip(cells, widths)) + "|"  # noqa: E731
    out = [line(header), "|" + "|".join("-" * w for w in widths) + "|"] + [line(row) for row in rows]
    for r in reports:
        if r.activity:
            out.append(f"{r.name}: {r.activity}")
        if r.max_logprob_diff is not None:
            out.append(f"{r.name}: largest |logprob on - logprob off| = {r.max_logprob_diff:.3g}")
        for d in r.answer_diffs[:5]:
            out.append(f"{r.name}: doc {d['doc_id']} differs ({', '.join(d['why'])}): on={d['on']!r} off={d['off']!r}")
    return "\n".join(out)
