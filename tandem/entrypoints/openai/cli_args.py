"""``tandem serve`` flags (kept free of server imports so the CLI parses fast)."""

from __future__ import annotations

import argparse

from tandem.entrypoints.arg_types import port_number, positive_int


def served_names(args: argparse.Namespace) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    model = getattr(args, "model_pos", None) or args.model
    return [model] if model else ["SmolLM2-135M-Instruct"]


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """``tandem serve`` flags (engine flags are added by the caller)."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000, help="TCP port (default 8000; 0: any free port)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) accepted in requests (default: the MODEL argument, or SmolLM2-135M-Instruct)")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default %(default)s)")
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="do not log each request (default: log them)")
    p.add_argument("--timeout-keep-alive", type=int, default=5,
                   help="seconds an idle keep-alive connection stays open (default %(default)s)")
    p.add_argument("--api-server-count", type=positive_int, default=1,
                   help="API-server processes (HTTP, tokenization, detokenization, SSE) on the one port, in front of "
                        "the shared engine cores (default 1: one process)")
    p.add_argument("--headless", action="store_true",
                   help="run this host's engine cores for a head on another host, with no API server (with "
                        "--data-parallel-start-rank, --data-parallel-size-local, --data-parallel-address and "
                        "--data-parallel-rpc-port of the head; see docs/multi_host.md)")
    p.add_argument("--tool-call-parser", choices=["hermes", "llama3_json"], default=None,
                   help="format of tool calls in chat outputs with tool_choice auto (default: from the chat "
                        "template: llama3_json for Llama 3's, else hermes as Qwen2.5 uses)")
