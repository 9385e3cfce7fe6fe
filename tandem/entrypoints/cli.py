"""The ``tandem`` command: generate, serve, bench, eval."""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import asdict
from typing import Any

from tandem.engine.arg_utils import EngineArgs
from tandem.entrypoints.arg_types import non_negative_int, positive_int
from tandem.logging_config import configure_logging
from tandem.version import tandem_version


DEFAULT_MAX_TOKENS = 256
# The default of a sampling flag left out, then the value when the model names none.
GENERATION_DEFAULT = "default: the model's generation_config.json, else"


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Sampling flags; left out, top-p/top-k/min-p/repetition-penalty take the model's
    generation_config.json values (else vLLM's), and temperature takes the model's, else 0."""
    p.add_argument("--max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS,
                   help=f"most tokens per completion (default {DEFAULT_MAX_TOKENS}; a note says when it cut one)")
    p.add_argument("--min-tokens", type=non_negative_int, default=0,
                   help="tokens per completion before EOS or a stop token may be generated (default %(default)s)")
    p.add_argument("--temperature", type=float, default=None,
                   help=f"sampling temperature, 0: greedy ({GENERATION_DEFAULT} 0)")
    p.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling: keep the most likely tokens up to this total probability, in (0, 1] "
                        f"({GENERATION_DEFAULT} 1)")
    p.add_argument("--top-k", type=int, default=None,
                   help=f"keep the k most likely tokens, -1 or 0: all ({GENERATION_DEFAULT} all)")
    p.add_argument("--min-p", type=float, default=None,
                   help=f"drop tokens less likely than this share of the most likely one ({GENERATION_DEFAULT} 0)")
    p.add_argument("--seed-sampling", dest="sampling_seed", type=int, default=None,
                   help="per-request sampling seed (default: none, unseeded)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help=f"penalty on tokens already in the prompt or output, > 0: above 1 discourages them, below 1 "
                        f"encourages them ({GENERATION_DEFAULT} 1: none)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract from the logits of tokens already generated, in [-2, 2] (default %(default)s)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times each token's count so far from its logit, in [-2, 2] "
                        "(default %(default)s)")
    p.add_argument("--stop", action="append", default=None,
                   help="a string that ends a completion, not included in it; repeat for several (default: none)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating after EOS, up to --max-tokens (default: stop at EOS)")
    p.add_argument("-n", "--n", dest="n", type=positive_int, default=1,
                   help="completions per prompt (default %(default)s)")


def _generate(args: argparse.Namespace) -> None:
    from tandem.entrypoints.llm import LLM
    from tandem.sampling_params import SamplingParams

    # Sampling values are checked before the model loads.
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed,
                            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, stop=args.stop, ignore_eos=args.ignore_eos)
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.create_engine_config()  # checked before the model loads
    start = time.perf_counter()
    llm = LLM(**asdict(engine_args))
    load_s = time.perf_counter() - start
    try:
        resolved = llm.engine.resolved
        if params.temperature is None and "temperature" not in resolved.generation_defaults.sampling:
            params = params.clone(temperature=0.0)  # the command's default: greedy
        generation_start = time.perf_counter()
        if len(args.prompt) == 1 and args.n == 1 and sys.stdout.isatty():
            outs = [_print_streamed(llm, args, params)]  # a terminal sees the text as it comes
        else:
            if args.chat:
                outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=False)
            else:
                outs = llm.generate(args.prompt, params, use_tqdm=False)
            for i, out in enumerate(outs):
                for c in out.outputs:
                    if len(outs) > 1 or len(out.outputs) > 1:
                        print(f"--- prompt {i} completion {c.index} ({c.finish_reason})")
                    if c.text:
                        print(c.text)
                    _completion_notes(c, args.max_tokens)
        print(generation_summary(outs, load_s, resolved.weights_mode), file=sys.stderr)
        _print_spec_decoding(llm, time.perf_counter() - generation_start)
    finally:
        llm.engine.shutdown()


def _print_streamed(llm, args: argparse.Namespace, params):
    """Generate the one prompt's completion, printing its text as it grows; returns the
    final ``RequestOutput``."""
    prompt = args.prompt[0]
    outs = llm.stream_chat([{"role": "user", "content": prompt}], params) if args.chat else llm.stream(prompt, params)
    shown, out = "", None
    try:
        for out in outs:
            text = out.outputs[0].text
            # Cumulative text only grows (held-back stop-string prefixes are never shown).
            print(text[len(shown):], end="", flush=True)
            shown = text
    finally:
        if shown:
            print(flush=True)
    _completion_notes(out.outputs[0], args.max_tokens)
    return out


def _print_spec_decoding(llm, elapsed_s: float) -> None:
    """With speculative decoding, the run's acceptance on stderr (the server's
    ``SpecDecoding metrics`` line over the whole generation)."""
    from tandem.entrypoints.llm import spec_decode_counts
    from tandem.engine.stat_logger import format_spec_decoding_line

    stats = spec_decode_counts(llm)
    if stats is not None and stats.num_drafts and elapsed_s > 0:
        print(format_spec_decoding_line(stats, elapsed_s), file=sys.stderr)


def _completion_notes(c, max_tokens: int) -> None:
    """What stdout does not say of a completion, on stderr: that it was empty, or cut."""
    if not c.text:
        print(f"[empty completion: finish_reason {c.finish_reason} after {len(c.token_ids)} token(s), no text]",
              file=sys.stderr)
    if c.finish_reason == "length":
        print(f"[cut at {len(c.token_ids)} tokens: --max-tokens {max_tokens}]", file=sys.stderr)


def generation_summary(outs: list, load_s: float, weights: str | None = None) -> str:
    """One line of speeds: prompt tokens/s (arrival of the first request to the last first
    token), generation tokens/s (tokens after each completion's first, from the last first
    token to the last finish), the model load time (speeds left out when an engine
    front-end reports no request timings) and, given, how the weights run (``weights``:
    :attr:`tandem.config.resolved.ResolvedConfig.weights_mode`)."""
    tail = f"model load {load_s:.1f} s" + (f"; weights {weights}" if weights else "")
    if not all({"arrival_time", "first_token_time", "finished_time"} <= o.metrics.keys() for o in outs):
        return tail
    arrival = min(o.metrics["arrival_time"] for o in outs)
    first = max(o.metrics["first_token_time"] for o in outs)
    end = max(o.metrics["finished_time"] for o in outs)
    n_prompt = sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in outs)
    n_completions = sum(len(o.outputs) for o in outs)
    n_gen = sum(len(c.token_ids) for o in outs for c in o.outputs) - n_completions
    rate = lambda n, s: f"{n / s:.1f} tok/s" if s > 0 and n > 0 else "n/a"  # noqa: E731
    return (f"prompt: {n_prompt} tokens in {first - arrival:.2f} s ({rate(n_prompt, first - arrival)}); "
            f"generation: {n_gen} tokens in {end - first:.2f} s ({rate(n_gen, end - first)}); "
            f"{tail}")


def _serve(args: argparse.Namespace) -> None:
    from tandem.entrypoints.openai.cli_args import serve_engine_config

    cfg = serve_engine_config(args)  # flags and model path checked before the server's imports (torch)
    # Chosen here, as vLLM's serve command does: the API-server processes import the server
    # module, which therefore cannot import their manager back.
    if args.headless:
        from tandem.engine.headless import run_headless

        run_headless(cfg)
        return
    from tandem.entrypoints.openai.cli_args import resolve_api_server_count

    try:
        if resolve_api_server_count(args, cfg) > 1:
            from tandem.entrypoints.openai.api_server_manager import run_multi_api_server

            run_multi_api_server(args, cfg)
        else:
            from tandem.entrypoints.openai.api_server import run_server

            run_server(args, cfg)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    else:
        code = 0
    from tandem.entrypoints.openai.api_server import exit_now

    exit_now(code)


# argparse's messages for a bad value of a flag typed ``int`` or ``float``.
_BUILTIN_TYPE_ERROR = re.compile(r"invalid (int|float) value: ('.*')$")
_EXPECTED = {"int": "an integer", "float": "a number"}


def _dashed(arg: str) -> str:
    """``--max_model_len[=V]`` -> ``--max-model-len[=V]``; anything else as it is."""
    if not arg.startswith("--") or arg == "--":
        return arg
    flag, eq, value = arg.partition("=")
    return flag.replace("_", "-") + eq + value


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (argparse prints the whole usage block
    first, 35 lines for ``serve``) naming the (sub)command whose flags were wrong, and that
    takes no abbreviated flag (``--max-token`` is an error, not ``--max-tokens``: a later
    flag with the same prefix would silently change what an old command line means).
    Subcommand parsers inherit the class, and with it these defaults."""

    def __init__(self, *args: Any, allow_abbrev: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def parse_known_args(self, args: list[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        """:meth:`argparse.ArgumentParser.parse_known_args`, an unknown argument being an
        error of this parser: a subcommand's parser is called through this method, and
        argparse would otherwise report its unknown flags in the top-level parser's name
        (``tandem: error``, pointing to ``tandem --help`` for a ``tandem serve`` flag).
        A flag may be spelled with underscores (``--max_model_len``), as vLLM's parser takes it."""
        if args is None:
            args = sys.argv[1:]
        args = [_dashed(a) for a in args]
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def error(self, message: str):
        # "argument --max-tokens: ..." -> "--max-tokens: ..."; a positional keeps the word.
        message = re.sub(r"^argument (-\S+): ", r"\1: ", message)
        message = _BUILTIN_TYPE_ERROR.sub(lambda m: f"expected {_EXPECTED[m[1]]}, got {m[2]}", message)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="tandem", description="Tandem LLM inference and serving engine")
    parser.add_argument("--version", action="version", version=f"%(prog)s {tandem_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate completions offline and print them")
    g.add_argument("prompt", nargs="+", help="one or more prompts, each completed on its own")
    g.add_argument("--chat", action="store_true",
                   help="send each prompt as a user message through the model's chat template (default: raw text)")
    EngineArgs.add_cli_args(g)
    add_sampling_args(g)
    g.set_defaults(func=_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (FastAPI + uvicorn)")
    EngineArgs.add_cli_args(s, model_positional=True)
    from tandem.entrypoints.openai.cli_args import add_serve_args

    add_serve_args(s)
    s.set_defaults(func=_serve)

    from tandem.benchmarks.cli import add_bench_parser

    add_bench_parser(sub)

    from tandem.eval.cli import add_eval_parser

    add_eval_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Run the ``tandem`` command. Ordinary mistakes end in one line, no traceback: a bad
    flag value or model path (exit 2), no server or a busy port (exit 1), Ctrl-C (130)."""
    prog, parser = "tandem", None
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        prog = f"tandem {args.command}" + (f" {args.bench_command}" if args.command == "bench" else "")
        # The server says when it listens and logs each request; offline commands print results only.
        configure_logging(default_level="INFO" if args.command == "serve" else "WARNING")
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        # Bad input (a flag value, a model path, a prompt over the context): the message,
        # not a traceback, naming the flags the user typed rather than the config's fields.
        from tandem.engine.arg_utils import with_flag_names

        _exit(2, f"{prog}: error: {with_flag_names(str(e), parser)}")
    except ConnectionError as e:  # no server at --base-url, a port in use
        _exit(1, f"{prog}: error: {e}")
    except KeyboardInterrupt:
        _exit(130, f"{prog}: interrupted")


def _exit(code: int, message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    sys.exit(code)


if __name__ == "__main__":
    sys.exit(main())
