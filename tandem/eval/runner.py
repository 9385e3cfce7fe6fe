"""Run a task on a backend; score, aggregate, print lm-eval's table, save JSON.

Scores are means of per-document 0/1 values; the standard error is lm-eval's
``mean_stderr``, the sample standard deviation over sqrt(n), which for a proportion p over
n documents is ``sqrt(p * (1 - p) / (n - 1))``.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field

from tandem.eval.extraction import INVALID
from tandem.eval.tasks import Task


@dataclass
class EvalResult:
    task: str
    version: str
    num_fewshot: int
    limit: int | None
    n: int
    # filter -> {"metric", "value", "stderr"}
    metrics: dict[str, dict]
    samples: list[dict]
    wall_time_s: float
    data: dict = field(default_factory=dict)
    backend: dict = field(default_factory=dict)
    groups: dict[str, dict] = field(default_factory=dict)
    greedy: bool = True

    def to_json(self) -> dict:
        return asdict(self)


def mean_stderr(values: list[float]) -> float:
    """Standard error of the mean with the sample standard deviation (lm-eval's
    ``mean_stderr``); NaN below two values."""
    n = len(values)
    if n < 2:
        return math.nan
    mu = sum(values) / n
    var = sum((v - mu) ** 2 for v in values) / (n - 1)
    return math.sqrt(var / n)


def _aggregate(values: list[float]) -> tuple[float, float]:
    return (sum(values) / len(values) if values else math.nan), mean_stderr(values)


def evaluate(task: Task, backend, num_fewshot: int | None = None, limit: int | None = None,
             max_tokens: int | None = None, log=None) -> EvalResult:
    """Evaluate ``task`` on ``backend`` (``OfflineBackend`` or ``ServerBackend``).

    Args:
        num_fewshot: solved examples per prompt (None: the task's default, 5).
        limit: documents to evaluate (None: all); see ``Task.eval_docs``.
        max_tokens: generation budget of generative tasks (None: the task's default).
        log: callable taking a progress line, or None.
    """
    k = task.default_num_fewshot if num_fewshot is None else num_fewshot
    t0 = time.perf_counter()
    docs = task.eval_docs(limit)
    prompts = [task.prompt(d, k) for d in docs]
    if log:
        log(f"{task.name}: {len(docs)} documents, {k}-shot, backend {backend.kind}")
    samples: list[dict] = []
    if task.output_type == "multiple_choice":
        conts = task.choice_continuations
        scores = backend.choice_logprobs(prompts, conts)
        for d, p, sc in zip(docs, prompts, scores):
            best = sc.argmax()
            pred = "ABCD"[best] if best is not None else INVALID
            samples.append({
                "doc_id": d.doc_id, "subject": d.group, "prompt": p, "choices": d.choices, "continuations": conts,
                "target": d.target, "logprobs": sc.logprobs, "method": sc.method, "raw_output": sc.top_token,
                "predictions": {"none": pred}, "correct": {"none": task.is_correct(pred, d)},
                "prompt_num_tokens": sc.prompt_num_tokens, "truncated_prompt_tokens": sc.truncated_prompt_tokens,
                "error": sc.error,
            })
    else:
        budget = max_tokens or task.default_max_tokens
        gens = backend.generate(prompts, budget, task.stop)
        for d, p, g in zip(docs, prompts, gens):
            preds = task.extract(g.text)
            samples.append({
                "doc_id": d.doc_id, "subject": d.group, "prompt": p, "target": d.target, "raw_output": g.text,
                "predictions": preds, "correct": {f: task.is_correct(v, d) for f, v in preds.items()},
                "finish_reason": g.finish_reason, "num_output_tokens": None if g.token_ids is None else len(g.token_ids),
                "prompt_num_tokens": g.prompt_num_tokens, "truncated_prompt_tokens": g.truncated_prompt_tokens,
                "error": g.error,
            })
    metrics = {}
    filters = list(samples[0]["correct"]) if samples else list(task.filters)
    for f in filters:
        value, stderr = _aggregate([float(s["correct"][f]) for s in samples])
        metrics[f] = {"metric": task.metric, "value": value, "stderr": stderr}
    groups = {}
    if any(s["subject"] for s in samples):
        by: dict[str, list[dict]] = {}
        for s in samples:
            by.setdefault(s["subject"], []).append(s)
        for g, ss in sorted(by.items()):
            groups[g] = {}
            for f in filters:
                value, stderr = _aggregate([float(s["correct"][f]) for s in ss])
                groups[g][f] = {"n": len(ss), "value": value, "stderr": stderr}
    wall = time.perf_counter() - t0
    errors = sum(1 for s in samples if s.get("error"))
    if log and errors:
        log(f"warning: {errors} of {len(samples)} requests failed (see 'error' in the samples); they count as wrong")
    return EvalResult(task.name, task.version, k, limit, len(samples), metrics, samples, wall, dict(task.data_info),
                      backend.describe(), groups)


def _fmt(x: float) -> str:
    return "N/A" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"


def format_table(results: list[EvalResult], groups: bool = False) -> str:
    """lm-eval's results table (markdown): Tasks | Version | Filter | n-shot | Metric | | Value | | Stderr."""
    header = ["Tasks", "Version", "Filter", "n-shot", "Metric", "", "Value", "", "Stderr"]
    rows = []
    for r in results:
        for i, (f, m) in enumerate(r.metrics.items()):
            rows.append([r.task if i == 0 else "", r.version if i == 0 else "", f, str(r.num_fewshot), m["metric"], "↑",
                         _fmt(m["value"]), "±", _fmt(m["stderr"])])
        if groups:
            for g, per in r.groups.items():
                for f, m in per.items():
                    rows.append([f" - {g}", r.version, f, str(r.num_fewshot), r.metrics[f]["metric"], "↑",
                                 _fmt(m["value"]), "±", _fmt(m["stderr"])])
    right = {1, 3, 6, 8}
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "|" + "|".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))) + "|"

    sep = "|" + "|".join(("-" * (w - 1) + ":") if i in right else "-" * w for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), sep] + [line(row) for row in rows])


def summary_line(r: EvalResult) -> str:
    b = r.backend
    return (f"tandem ({b.get('backend')}, model={b.get('model')}), limit: {r.limit}, num_fewshot: {r.num_fewshot}, "
            f"n: {r.n}, wall time: {r.wall_time_s:.1f} s")


def _no_nan(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_no_nan(v) for v in x]
    return x


def write_json(path: str, payload: dict) -> None:
    """Write ``payload`` as JSON (NaN written as null), atomically."""
    payload = _no_nan(payload)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".part"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1, ensure_ascii=False, default=str)
    os.replace(tmp, path)
