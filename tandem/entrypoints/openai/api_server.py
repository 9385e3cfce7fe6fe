"""The OpenAI-compatible HTTP server (FastAPI + uvicorn): ``tandem serve [MODEL]``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{model_id}``, ``GET /health``, ``GET /metrics`` (Prometheus), ``POST /tokenize``,
``POST /detokenize``, ``GET /tokenizer_info``, ``GET /version``, ``GET /debug/engine_stats``.

``--api-server-count N`` (N > 1) runs N such servers in their own processes on the one
port, in front of the shared engine cores (:mod:`tandem.entrypoints.openai.api_server_manager`).

With ``--api-key`` (or ``TANDEM_API_KEY``) every ``/v1`` route answers 401 unless the request
carries ``Authorization: Bearer KEY``; the other routes stay open, as vLLM's.

The server listens before the engine loads: until it is ready every route answers 503
(``/health`` included), and a stop (SIGTERM/SIGINT) meanwhile kills the loading cores.

Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}``. User input
never yields a 500: invalid JSON, validation failures (FastAPI's 422 included),
out-of-range values, over-long prompts and out-of-vocabulary token ids are 400; unknown
models (as OpenAI and vLLM: ``NotFoundError``, param ``model``) and unknown routes 404. A
client that disconnects aborts its request (streaming: the response task is cancelled;
non-streaming: the handler races a disconnect listener).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import logging
import errno
import hashlib
import hmac
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.config import EngineConfig
from tandem.engine.async_llm import AsyncLLM, EngineDeadError
from tandem.entrypoints.openai import protocol as P
from tandem.entrypoints.openai.cli_args import api_keys, serve_engine_config, served_names
from tandem.entrypoints.openai.metrics import ServerMetrics
from tandem.entrypoints.openai.serving import (OpenAIError, OpenAIServing, SSEStream, bad_request, error_body,
                                               model_not_found)
from tandem.version import tandem_version

logger = logging.getLogger("tandem.serve")

_HTTP_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
               413: "RequestTooLarge", 500: "InternalServerError", 503: "ServiceUnavailableError"}


def _error(status: int, message: str, param: str | None = None, err_type: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, err_type or _HTTP_TYPES.get(status, "Error"), param), status_code=status)


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    parts, param = [], None
    for e in errors[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if param is None and loc:
            param = loc[0]
        where = ".".join(loc)
        if e.get("type") == "extra_forbidden":
            parts.append(f"Unrecognized request argument supplied: {where}")
            continue
        parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    return "; ".join(parts) or "invalid request", param


def _reject_constant(name: str):
    raise json.JSONDecodeError(f"{name} is not valid JSON", name, 0)


async def _parse(raw: Request, model: type[BaseModel]):
    body = await raw.body()
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"Invalid JSON in the request body: {e}") from None
    except RecursionError:
        raise bad_request("Invalid JSON in the request body: nested too deeply.") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except RecursionError:
        raise bad_request("the request body is nested too deeply.") from None
    except ValidationError as e:
        msg, param = _validation_message(e.errors(include_url=False))
        raise bad_request(msg, param) from None


async def _until_disconnect(raw: Request) -> None:
    while True:
        msg = await raw.receive()
        if msg["type"] == "http.disconnect":
            return


async def _with_cancellation(raw: Request, coro):
    """Run ``coro``; if the client disconnects first, cancel it (aborting its requests)."""
    task = asyncio.ensure_future(coro)
    waiter = asyncio.ensure_future(_until_disconnect(raw))
    try:
        done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        waiter.cancel()
        raise
    waiter.cancel()
    if task in done:
        return task.result()
    task.cancel()
    return None


class _SSEResponse(StreamingResponse):
    """``text/event-stream`` response that aborts its engine requests when it ends, in every
    way it can end (done, client disconnect, send error, never started)."""

    def __init__(self, stream: SSEStream) -> None:
        super().__init__(stream, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.abort()


class _RequestIdHeader:
    """Echo the client's ``X-Request-Id`` header on the response (pure ASGI: streaming and
    disconnect detection pass through untouched)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = next((v for k, v in scope.get("headers", []) if k == b"x-request-id"), None)
        if rid is None:
            return await self.app(scope, receive, send)

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid)]
            await send(message)

        return await self.app(scope, receive, send_with_id)


class _BearerAuth:
    """Answer 401 to a ``/v1`` request without ``Authorization: Bearer KEY`` for one of
    ``keys``; other routes (``/health``, ``/metrics``, ``/version``, ``/tokenize``) stay open,
    as vLLM's. Pure ASGI, as :class:`_RequestIdHeader`. Keys are compared as SHA-256 digests
    with ``hmac.compare_digest``, against every key: the time taken tells nothing of a key's
    length or of which key came close."""

    def __init__(self, app, keys: Sequence[str]) -> None:
        self.app = app
        self._digests = [hashlib.sha256(k.encode("utf-8")).digest() for k in keys]

    def _authorized(self, scope) -> bool:
        header = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        digest = hashlib.sha256(token.strip()).digest()
        matched = False
        for known in self._digests:
            matched |= hmac.compare_digest(digest, known)
        return scheme.lower() == b"bearer" and matched

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        guarded = scope["type"] == "http" and scope.get("method") != "OPTIONS" and (path + "/").startswith("/v1/")
        if not guarded or self._authorized(scope):
            return await self.app(scope, receive, send)
        response = _error(401, "Invalid or missing API key: send 'Authorization: Bearer KEY' with a key the server "
                               "was started with (--api-key or TANDEM_API_KEY).")
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def build_app(llm: AsyncLLM, served_model_names: list[str], model_root: str | None = None,
              tool_call_parser: str | None = None, api_server_index: int = 0, api_server_count: int = 1,
              metrics_dir: str | None = None, api_keys: Sequence[str] = (), chat_template: str | None = None,
              enable_auto_tool_choice: bool = True) -> FastAPI:
    """The FastAPI application around a running ``AsyncLLM``.

    ``app.state`` holds ``llm``, ``serving`` (``OpenAIServing``) and ``metrics``.
    ``api_server_index`` / ``api_server_count``: which of several API-server processes this
    is; ``metrics_dir``: their shared Prometheus multiprocess folder (``/metrics`` then sums
    over all of them). ``api_keys``: if any, one must come with every ``/v1`` request
    (:class:`_BearerAuth`). ``chat_template``: replaces the tokenizer's (chat requests,
    ``/tokenize`` messages, the default tool-call parser). ``enable_auto_tool_choice``
    False: a chat request whose tool choice is auto is a 400, as vLLM's without the flag.
    """
    if chat_template is not None:
        llm.tokenizer.chat_template = chat_template  # the API server's own tokenizer: cores apply no template
    serving = OpenAIServing(llm, served_model_names, tool_call_parser)
    metrics = ServerMetrics(llm, served_model_names[0], metrics_dir)

    async def watch_engine() -> None:
        while llm.is_running:
            await asyncio.sleep(0.5)
        if llm.client.dead_error is not None and getattr(app.state, "on_engine_dead", None) is not None:
            app.state.on_engine_dead()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.loop = asyncio.get_running_loop()
        llm.start()  # the output loop runs from the start: a core's death is seen without traffic
        watch = asyncio.create_task(watch_engine())
        yield
        watch.cancel()
        serving.shutdown()

    app = FastAPI(title="Tandem OpenAI-compatible server", version=tandem_version(),
                  lifespan=lifespan)
    app.state.llm = llm
    app.state.serving = serving
    app.state.metrics = metrics

    # ------------------------------------------------------------ error handlers
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        msg, param = _validation_message(list(exc.errors()))
        return _error(400, msg, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError):
        return _error(500, str(exc))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):
        logger.exception("internal error")
        return _error(500, f"internal error: {exc!r}")

    if api_keys:
        app.add_middleware(_BearerAuth, keys=api_keys)
    app.add_middleware(_RequestIdHeader)  # added last, outermost: a 401 also echoes the request id

    def request_id(raw: Request, body_id: str | None) -> str:
        return raw.headers.get("x-request-id") or body_id or P.random_uuid()

    def respond(result, raw: Request):
        if result is None:  # the client went away
            return Response(status_code=499)
        if isinstance(result, SSEStream):
            return _SSEResponse(result)
        return JSONResponse(result.model_dump())

    # ------------------------------------------------------------------ routes
    @app.post("/v1/completions")
    async def completions(raw: Request):
        req = await _parse(raw, P.CompletionRequest)
        rid = request_id(raw, req.request_id)
        return respond(await _with_cancellation(raw, serving.create_completion(req, rid)), raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        req = await _parse(raw, P.ChatCompletionRequest)
        # tool_choice left out with tools given is auto (OpenAI, vLLM).
        if not enable_auto_tool_choice and req.tools and req.tool_choice in (None, "auto"):
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice (this server runs with '
                              '--no-enable-auto-tool-choice); give tool_choice "none", "required" or a function.',
                              "tool_choice")
        rid = request_id(raw, req.request_id)
        return respond(await _with_cancellation(raw, serving.create_chat_completion(req, rid)), raw)

    def model_card(name: str) -> P.ModelCard:
        return P.ModelCard(id=name, root=model_root or name, max_model_len=llm.max_model_len)

    @app.get("/v1/models")
    async def models():
        return JSONResponse(P.ModelList(data=[model_card(name) for name in served_model_names]).model_dump())

    # ``path``: served names may hold slashes (``Qwen/Qwen2.5-0.5B-Instruct``).
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in served_model_names:
            raise model_not_found(model_id)
        return JSONResponse(model_card(model_id).model_dump())

    @app.get("/health")
    async def health():
        if not llm.is_running:
            return _error(503, f"the engine is not running: {llm.dead_error}")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": tandem_version()}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        req = await _parse(raw, P.TokenizeRequest)
        return JSONResponse((await serving.tokenize(req)).model_dump(exclude_none=True))

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        req = await _parse(raw, P.DetokenizeRequest)
        return JSONResponse((await serving.detokenize(req)).model_dump())

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return JSONResponse(serving.tokenizer_info())

    @app.get("/debug/engine_stats")
    async def engine_stats():
        """Engine state read in every engine core between two steps, and which API server
        answered (tests, debugging)."""
        stats = await llm.engine_stats()
        stats["api_server"] = {"index": api_server_index, "count": api_server_count, "pid": os.getpid(),
                               "num_requests": llm.num_requests}
        return JSONResponse(stats)

    return app


def bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """Bind the server's socket before the model loads (as vLLM does), so that a busy
    port is reported at once, not after loading. ``reuse_port``: ``SO_REUSEPORT``, for
    several API-server processes listening on one port.

    Raises:
        ConnectionError: the address cannot be bound (port in use, address not local).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        hint = "; choose another with --port" if e.errno == errno.EADDRINUSE else ""
        raise ConnectionError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None
    sock.set_inheritable(True)
    return sock


# Seconds between an engine core's death and the server's exit (clients get their errors first).
DEAD_ENGINE_EXIT_DELAY_S = 2.0
# Stopping: seconds uvicorn waits for open connections once every live request has been
# ended, then the engine cores' budget (their final message, then a second to exit before
# they are killed): SIGTERM of an idle server exits within about 3 s.
GRACEFUL_HTTP_S = 1.0
ENGINE_STOP_TIMEOUT_S = 2.0


def _uvicorn_server(config, on_stop: Callable[[str], None]):
    """uvicorn's server that, on SIGINT/SIGTERM, also calls ``on_stop(reason)`` (which ends
    every live request at once: HTTP 500; a stream with an error event, then ``[DONE]``), so
    that stopping never waits for long generations (uvicorn alone waits for every response
    to finish), and then returns: the stop asked for is a clean exit (uvicorn alone raises
    the signal again once it has stopped, and the process ends killed by it, status 143)."""
    import uvicorn

    class Server(uvicorn.Server):
        stop_signal: int | None = None

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self.stop_signal = sig
            on_stop(f"the server is stopping (signal {sig})")

    return Server(config)


class _LoadingGate:
    """The ASGI application uvicorn serves: it answers every request with 503 (``/health``
    included) while the engine loads, then hands everything to the server's FastAPI app,
    whose lifespan it runs once that app exists.

    Args:
        loaded: the future of the loaded ``AsyncLLM`` (set by the loading thread).
        make_app: builds the server's app around it (on the event loop).
        on_failed: called on the event loop when loading failed (the server then stops).
    """

    def __init__(self, loaded: concurrent.futures.Future, make_app: Callable[[AsyncLLM], FastAPI],
                 on_failed: Callable[[], None]) -> None:
        self.loaded = loaded
        self.make_app = make_app
        self.on_failed = on_failed
        self.app: FastAPI | None = None
        self.app_failed = False  # the engine loaded, its app did not start (the server exits 1)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._lifespan = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._serve_lifespan(receive, send)
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] == "http":
            await _error(503, "the model is loading; retry when /health answers 200")(scope, receive, send)

    def abort_all(self, reason: str) -> None:
        """End every live request (safe from a signal handler)."""
        if self.app is not None and self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.app.state.llm.abort_all, reason)

    async def _serve_lifespan(self, receive, send) -> None:
        await receive()  # lifespan.startup
        self.loop = asyncio.get_running_loop()
        waiter = asyncio.create_task(self._open_when_loaded())
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        waiter.cancel()
        if self._lifespan is not None:
            await self._lifespan.__aexit__(None, None, None)
        await send({"type": "lifespan.shutdown.complete"})

    async def _open_when_loaded(self) -> None:
        try:
            llm = await asyncio.wrap_future(self.loaded)
        except asyncio.CancelledError:
            raise
        except BaseException:  # noqa: BLE001 - raised again once the server has stopped
            self.on_failed()
            return
        try:
            app = self.make_app(llm)
            lifespan = app.router.lifespan_context(app)
            await lifespan.__aenter__()
        except Exception:  # noqa: BLE001 - else the server would answer 503 forever
            logger.exception("the server's app failed to start")
            self.app_failed = True
            self.on_failed()
            return
        self._lifespan, self.app = lifespan, app


def _load_in_thread(load: Callable[[], AsyncLLM]) -> tuple[threading.Thread, concurrent.futures.Future]:
    """Run ``load()`` on a daemon thread; its result or error lands in the future."""
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_running_or_notify_cancel()  # a waiter that gives up cannot cancel the load

    def run() -> None:
        try:
            fut.set_result(load())
        except BaseException as e:  # noqa: BLE001 - handed to the server's thread
            fut.set_exception(e)

    thread = threading.Thread(target=run, name="tandem-engine-load", daemon=True)
    thread.start()
    return thread, fut


def _stop_loading(thread: threading.Thread) -> None:
    """Stopped while the engine loads: kill the engine cores this process spawned (again
    until the loading thread ends: it may spawn them late), so that the loading thread sees
    them gone and cleans up; its error is the stop, not a fault. An API server attached to
    another process's cores spawned none: its loading thread ends with the process."""
    import multiprocessing

    core_log = logging.getLogger("tandem.engine.core_client")
    core_log.disabled = True  # it would log the cores' deaths as a failure
    start = time.monotonic()
    try:
        while thread.is_alive() and time.monotonic() < start + ENGINE_STOP_TIMEOUT_S + 3.0:
            children = multiprocessing.active_children()
            if not children and time.monotonic() > start + 0.5:
                return  # none spawned here (attached), or none left
            for p in children:
                p.kill()
            thread.join(0.1)
    finally:
        core_log.disabled = False


def exit_now(code: int) -> None:
    """End a server process that has stopped everything it started, without the
    interpreter's teardown: finalizing torch's and the tokenizers' modules takes 1-2 s on a
    busy CPU, and SIGTERM of a server must end it within 3 s (no atexit handler of Tandem's
    is left by then)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_server(args: argparse.Namespace, cfg: EngineConfig | None = None) -> None:
    """Bind the address, answer HTTP at once (503 while loading), load the engine cores,
    and serve until interrupted (SIGINT/SIGTERM: exit 0) or until an engine core dies (exit
    1, after failing every live request). One API server: ``tandem serve --api-server-count
    N`` > 1 runs :func:`tandem.entrypoints.openai.api_server_manager.run_multi_api_server`
    instead. ``cfg``: the engine config of ``args`` (:func:`serve_engine_config`).

    Raises:
        ValueError: a bad engine flag or model path (before anything loads), a core failed to
            start on bad input (``EngineConfigError``, once the server has stopped).
        EngineDeadError: a core failed to start otherwise.
        ConnectionError: the address cannot be bound (before anything loads).
        SystemExit: 1 when an engine core died.
    """
    cfg = cfg or serve_engine_config(args)
    sock = bind_socket(args.host, args.port)
    logger.info("loading %s; /health answers 503 until it is ready", cfg.model_config.model)
    serve_http(lambda: AsyncLLM(cfg), sock, args)


def serve_http(load_llm: Callable[[], AsyncLLM], sock: socket.socket, args: argparse.Namespace,
               api_server_index: int = 0, metrics_dir: str | None = None) -> None:
    """Serve on the bound socket at once while ``load_llm()`` builds the engine front end on
    another thread (every request is a 503 until it is ready), then serve it until
    interrupted or until an engine core dies (then exit 1 after failing every live
    request); shuts the engine down.

    Raises:
        Exception: what ``load_llm`` raised (once the server has stopped).
        SystemExit: 1 when an engine core died.
    """
    import uvicorn

    names = served_names(args)
    keys = api_keys(args)
    host, port = sock.getsockname()[:2]
    server = None

    def stop_soon(delay: float = 0.0) -> None:
        asyncio.get_running_loop().call_later(delay, setattr, server, "should_exit", True)

    def make_app(llm: AsyncLLM) -> FastAPI:
        def on_engine_dead() -> None:
            logger.error("engine core died: %s; the server stops", llm.client.dead_error)
            stop_soon(DEAD_ENGINE_EXIT_DELAY_S)

        cfg = llm.config
        app = build_app(llm, names, model_root=cfg.model_config.model, tool_call_parser=args.tool_call_parser,
                        api_server_index=api_server_index, api_server_count=args.api_server_count,
                        metrics_dir=metrics_dir, api_keys=keys, chat_template=args.chat_template,
                        enable_auto_tool_choice=args.enable_auto_tool_choice)
        app.state.on_engine_dead = on_engine_dead
        usable = llm.num_kv_blocks - cfg.parallel_config.data_parallel_size  # one null block per replica
        who = f"API server {api_server_index} of {args.api_server_count}, " if args.api_server_count > 1 else ""
        sched = cfg.scheduler_config
        logger.info("%slistening on http://%s:%d: model %s (served as %s), max_model_len %d, max_num_seqs %d, "
                    "max_num_batched_tokens %d, KV cache %d tokens (%d blocks of %d) over %d replica(s), pid %d", who,
                    host, port, cfg.model_config.model, ", ".join(names), llm.max_model_len, sched.max_num_seqs,
                    sched.max_num_batched_tokens, usable * cfg.cache_config.block_size, usable,
                    cfg.cache_config.block_size, cfg.parallel_config.data_parallel_size, os.getpid())
        if keys:
            logger.info("the /v1 routes require an API key (%d accepted)", len(keys))
        return app

    thread, loaded = _load_in_thread(load_llm)
    gate = _LoadingGate(loaded, make_app, on_failed=stop_soon)
    llm = None
    try:
        config = uvicorn.Config(gate, log_level=args.uvicorn_log_level, access_log=not args.disable_uvicorn_access_log,
                                timeout_keep_alive=args.timeout_keep_alive, timeout_graceful_shutdown=GRACEFUL_HTTP_S)
        server = _uvicorn_server(config, gate.abort_all)
        server.run(sockets=[sock])
    finally:
        sock.close()
        if not loaded.done():
            _stop_loading(thread)
        if loaded.done() and loaded.exception() is None:
            llm = loaded.result()
            dead = llm.client.dead_error is not None
            llm.shutdown(ENGINE_STOP_TIMEOUT_S)
    if llm is None:
        if server.stop_signal is not None:
            return  # stopped while loading
        if loaded.done():
            raise loaded.exception()  # loading failed
        raise RuntimeError("the HTTP server stopped before the engine was loaded")
    if dead or gate.app_failed:
        raise SystemExit(1)
