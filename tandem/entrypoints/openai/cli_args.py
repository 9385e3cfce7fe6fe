"""``tandem serve`` flags (kept free of server imports so the CLI parses fast)."""

from __future__ import annotations

import argparse

from typing import TYPE_CHECKING

from tandem.entrypoints.arg_types import api_key, chat_template, non_negative_int, port_number, positive_int

if TYPE_CHECKING:
    from tandem.config import EngineConfig


# CPU cores an API server gets when their count is left to Tandem: one busy core for HTTP,
# detokenization and SSE plus room for its threads (tokenizer, zmq I/O) and the kernel's TCP work.
CPUS_PER_API_SERVER = 3
# API servers per local GPU replica at most (one replica's outputs no longer gain beyond).
MAX_API_SERVERS_PER_REPLICA = 4


def default_api_server_count(cpus: int, local_ranks: int, local_replicas: int, on_gpu: bool) -> int:
    """The API servers ``tandem serve`` starts when ``--api-server-count`` is not given.

    On the CPU the engine cores use every core: one server. On GPUs, the CPUs the local
    engine ranks leave free, ``CPUS_PER_API_SERVER`` each, at most
    ``MAX_API_SERVERS_PER_REPLICA`` per local replica and at least one. The front end costs
    tens of microseconds of CPU per output token (benchmarks/RESULTS.md, issue 35): a replica
    streaming ~20k tokens/s keeps about two cores busy, which one process cannot give.
    """
    if not on_gpu:
        return 1
    spare = max(0, cpus - local_ranks) // CPUS_PER_API_SERVER
    return max(1, min(spare, MAX_API_SERVERS_PER_REPLICA * local_replicas))


def resolve_api_server_count(args: argparse.Namespace, cfg: "EngineConfig") -> int:
    """``args.api_server_count``, or :func:`default_api_server_count` for this host (sets it)."""
    if args.api_server_count is None:
        import os

        parallel = cfg.parallel_config
        on_gpu = cfg.device_config.torch_device.type == "cuda"  # no CUDA context is created
        args.api_server_count = default_api_server_count(len(os.sched_getaffinity(0)), len(parallel.local_ranks),
                                                         parallel.data_parallel_local_size, on_gpu)
    return args.api_server_count


def served_names(args: argparse.Namespace) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    model = getattr(args, "model_pos", None) or args.model
    return [model] if model else ["SmolLM2-135M-Instruct"]


def api_keys(args: argparse.Namespace) -> list[str]:
    """The keys of which a ``/v1`` request must present one (``Authorization: Bearer KEY``):
    ``--api-key``'s, else ``TANDEM_API_KEY``'s (vLLM: ``VLLM_API_KEY``); none: no key needed."""
    if args.api_key:
        return list(args.api_key)
    from tandem import envs

    key = envs.TANDEM_API_KEY
    return [key] if key else []


def serve_engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine config of ``tandem serve``'s flags, for serving (usage context
    ``"openai_api_server"``: the served default batch limits, tandem.platform), its model
    path checked: both before the server's modules (and torch) are imported.

    Raises:
        ValueError: a bad engine flag, naming it; flags that do not fit the host's role
            (``--headless`` or head); a model path that does not exist or that the loader
            does not read; a ``--tensor-parallel-size`` that does not split the model's heads.
    """
    from tandem.model_loader.model_path import check_model_path
    from tandem.engine.arg_utils import EngineArgs
    from tandem.engine.launch import check_tensor_parallel_size

    cfg = EngineArgs.from_cli_args(args).create_engine_config("openai_api_server")
    cfg.parallel_config.check_host_role(headless=getattr(args, "headless", False))
    check_model_path(cfg.model_config.model)
    check_tensor_parallel_size(cfg)  # here, on the main thread: not on the server's loading thread
    return cfg


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """``tandem serve`` flags (engine flags are added by the caller)."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000, help="TCP port (default 8000; 0: any free port)")
    # One name per flag (repeat it for several): a flag taking a variable number of values
    # would also take the MODEL argument after it (vLLM's nargs="+" does).
    p.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                   help="a model name accepted in requests; repeat for several, the first is reported (default: "
                        "the MODEL argument, or SmolLM2-135M-Instruct)")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default %(default)s)")
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="do not log each request (default: log them)")
    p.add_argument("--timeout-keep-alive", type=int, default=5,
                   help="seconds an idle keep-alive connection stays open (default %(default)s)")
    # 0 by default, as vLLM's: a drain only helps if it ends before the supervisor's kill
    # (Kubernetes' terminationGracePeriodSeconds, 30 s by default, less any preStop sleep;
    # `docker stop`, 10 s), which only the deployment knows; past it the clients would get a
    # reset connection instead of an error.
    p.add_argument("--shutdown-timeout", type=non_negative_int, default=0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, drain for up to SECONDS: new /v1 requests and /health get HTTP 503 while "
                        "the requests in flight run to their end, then those left are aborted (HTTP 500; a stream "
                        "gets an error event) and the server exits 0; a second SIGTERM/SIGINT aborts them at once. "
                        "0: abort every request in flight at once (default %(default)s, as vLLM's: set it below the "
                        "time your supervisor waits before SIGKILL, e.g. Kubernetes' terminationGracePeriodSeconds "
                        "less any preStop sleep)")
    p.add_argument("--api-server-count", type=positive_int, default=None,
                   help="API-server processes (HTTP, tokenization, detokenization, SSE) on the one port, in front of "
                        "the shared engine cores (default: chosen from the CPUs and the replicas, see "
                        "default_api_server_count: 1 on the CPU, up to 4 per GPU replica)")
    p.add_argument("--headless", action="store_true",
                   help="run this host's engine cores for a head on another host, with no API server (with "
                        "--data-parallel-start-rank, --data-parallel-size-local, --data-parallel-address and "
                        "--data-parallel-rpc-port of the head; see docs/multi_host.md)")
    p.add_argument("--tool-call-parser", choices=["hermes", "llama3_json"], default=None,
                   help="format of tool calls in chat outputs with tool_choice auto (default: from the chat "
                        "template: llama3_json for Llama 3's, else hermes as Qwen2.5 uses)")
    # Auto tool choice is on by default, unlike vLLM's: vLLM refuses it without a parser named,
    # while Tandem always has one (from the chat template), and its clients rely on it.
    p.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=True,
                   help="serve chat requests with tool_choice auto (or tools and no tool_choice), the output parsed "
                        "for calls by --tool-call-parser; --no-enable-auto-tool-choice: HTTP 400 for them, as vLLM "
                        "without the flag (default %(default)s)")
    p.add_argument("--chat-template", type=chat_template, default=None, metavar="TEMPLATE",
                   help="the Jinja chat template of chat requests and /tokenize messages, instead of the "
                        "tokenizer's: a file, or the template itself on one line (\\n: a newline) (default: the "
                        "tokenizer's)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="spell the tokens of logprobs 'token_id:N' (for tokens that are not valid UTF-8 alone) "
                        "unless a request's return_tokens_as_token_ids says otherwise (default: their text)")
    # Repeated, not nargs="+": a variable number of values would take the MODEL argument after it.
    p.add_argument("--api-key", type=api_key, action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every /v1 route (HTTP 401 otherwise; /health, "
                        "/metrics, /version, /tokenize and the like stay open, as vLLM's); repeat for several keys "
                        "(default: $TANDEM_API_KEY, else none: no key needed)")
