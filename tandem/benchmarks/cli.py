"""``tandem bench`` subcommands."""

from __future__ import annotations

import argparse

from tandem.engine.arg_utils import EngineArgs
from tandem.entrypoints.arg_types import positive_int, unit_fraction


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    t = bench.add_parser("throughput", help="offline throughput on random prompts")
    EngineArgs.add_cli_args(t)
    t.add_argument("--input-len", type=positive_int, default=128,
                   help="tokens of each random prompt (default %(default)s)")
    t.add_argument("--output-len", type=positive_int, default=128,
                   help="tokens generated per prompt (default %(default)s)")
    t.add_argument("--num-prompts", type=positive_int, default=100, help="prompts in the run (default %(default)s)")
    t.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly --output-len tokens, past EOS (default %(default)s)")
    t.add_argument("--output-json", default=None, help="also write the results to this JSON file (default: none)")
    t.add_argument("--structured-output-ratio", type=unit_fraction, default=0.0,
                   help="share of the requests constrained to a JSON schema, 0-1 (default %(default)s)")
    t.add_argument("--json-schema-path", default=None,
                   help="the schema of the constrained requests (default: the serving benchmark's user profile)")

    def run(args: argparse.Namespace) -> None:
        from tandem.model_loader.model_path import check_model_path

        # Flags and model path checked before the benchmark's imports (torch) and its load.
        check_model_path(EngineArgs.from_cli_args(args).create_engine_config().model_config.model)
        from tandem.benchmarks.throughput import main

        main(args)

    t.set_defaults(func=run)

    sv = bench.add_parser("serve", help="online serving benchmark against a running OpenAI-compatible server")
    from tandem.benchmarks.serve import add_cli_args

    add_cli_args(sv)

    def run_serve(args: argparse.Namespace) -> None:
        from tandem.benchmarks.serve import main

        main(args)

    sv.set_defaults(func=run_serve)
