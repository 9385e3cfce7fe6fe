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

Stopping (SIGTERM/SIGINT) follows ``--shutdown-timeout SECONDS`` (vLLM's flag): 0, the
default, aborts every request in flight at once; otherwise the server drains: new ``/v1``
requests and ``/health`` answer 503 while the requests in flight run to their end, for up to
SECONDS, then the rest are aborted; a second signal aborts them at once (:class:`_Stopper`).

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


class ServerDrain:
    """The ``/v1`` requests this server is serving (a stream counts until its last byte is
    sent), and whether it drains them: stopping with ``--shutdown-timeout`` > 0, it answers
    new ``/v1`` requests and ``/health`` with 503 and waits for the ones in flight."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self.rejected = 0  # new /v1 requests answered 503 while draining
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        """A ``/v1`` request starts."""
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        """A ``/v1`` request has ended (its response sent, or its client gone)."""
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until no ``/v1`` request is in flight; True if none is."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return self.in_flight == 0


class _DrainGate:
    """Count the ``/v1`` requests in flight in ``drain`` and, while it drains, answer new ones
    with 503 (``Connection: close``: a client's pooled connection moves to another replica).
    Pure ASGI, as :class:`_RequestIdHeader`: a streamed response is counted until it ends."""

    def __init__(self, app, drain: ServerDrain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not (scope.get("path", "") + "/").startswith("/v1/"):
            return await self.app(scope, receive, send)
        if self.drain.draining:
            self.drain.rejected += 1
            response = _error(503, "the server is shutting down; send the request to another replica")
            response.headers["Connection"] = "close"
            return await response(scope, receive, send)
        self.drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()


def build_app(llm: AsyncLLM, served_model_names: list[str], model_root: str | None = None,
              tool_call_parser: str | None = None, api_server_index: int = 0, api_server_count: int = 1,
              metrics_dir: str | None = None, api_keys: Sequence[str] = (), chat_template: str | None = None,
              enable_auto_tool_choice: bool = True, return_tokens_as_token_ids: bool = False) -> FastAPI:
    """The FastAPI application around a running ``AsyncLLM``.

    ``app.state`` holds ``llm``, ``serving`` (``OpenAIServing``), ``metrics`` and ``drain``
    (:class:`ServerDrain`).
    ``api_server_index`` / ``api_server_count``: which of several API-server processes this
    is; ``metrics_dir``: their shared Prometheus multiprocess folder (``/metrics`` then sums
    over all of them). ``api_keys``: if any, one must come with every ``/v1`` request
    (:class:`_BearerAuth`). ``chat_template``: replaces the tokenizer's (chat requests,
    ``/tokenize`` messages, the default tool-call parser). ``enable_auto_tool_choice``
    False: a chat request whose tool choice is auto is a 400, as vLLM's without the flag.
    ``return_tokens_as_token_ids``: the default of the request field of that name.
    """
    if chat_template is not None:
        llm.tokenizer.chat_template = chat_template  # the API server's own tokenizer: cores apply no template
    serving = OpenAIServing(llm, served_model_names, tool_call_parser, return_tokens_as_token_ids)
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
    app.state.drain = drain = ServerDrain()

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
    app.add_middleware(_DrainGate, drain=drain)  # outside the key check: a draining server refuses everyone
    app.add_middleware(_RequestIdHeader)  # added last, outermost: a 401 or 503 also echoes the request id

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
        if drain.draining:
            return _error(503, "the server is shutting down")
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
# Stopping: seconds uvicorn waits for open connections once every live request has ended
# (drained or aborted), then the engine cores' budget (their final message, then a second
# to exit before they are killed): SIGTERM of an idle server exits within about 3 s.
GRACEFUL_HTTP_S = 1.0
ENGINE_STOP_TIMEOUT_S = 2.0
# How the manager of several API servers ends their drains at once (a second signal to it):
# SIGTERM/SIGINT cannot say it, as the process group's signals reach the API servers too
# (Ctrl-C, `timeout`, systemd), each once, and the manager then forwards its own SIGTERM.
ABORT_SIGNAL = signal.SIGUSR1


def _uvicorn_server(config, on_signal: Callable[[int], None], signals: Sequence[int]):
    """uvicorn's server whose ``signals`` call ``on_signal(sig)`` instead of uvicorn's
    handler: :class:`_Stopper` decides when the server exits (uvicorn alone stops accepting
    at once, waits for every response to finish, then raises the signal again once it has
    stopped, and the process ends killed by it, status 143)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame) -> None:
            on_signal(sig)

    return Server(config)


class _Stopper:
    """What SIGTERM/SIGINT do to a serving process, by ``--shutdown-timeout`` (vLLM's).

    ``timeout`` 0: every live request ends at once (HTTP 500; a stream with an error event,
    then ``[DONE]``) and the server stops. Otherwise the server drains: new ``/v1`` requests
    and ``/health`` answer 503, the listening socket stays open (a load balancer sees the
    503s, a client no refused connection), the requests in flight run for up to ``timeout``
    s, then those left end as above and the server stops. Before the engine is loaded a
    signal stops the server at once, whatever the timeout.

    ``repeat_aborts``: a second SIGTERM/SIGINT aborts the drain at once (a lone server). An
    API server under :mod:`~tandem.entrypoints.openai.api_server_manager` gets its group's
    signal and its manager's, so repeats do nothing there and :data:`ABORT_SIGNAL` aborts.
    ``who``: the prefix of the log lines (which API server).
    """

    def __init__(self, gate: "_LoadingGate", timeout: float, repeat_aborts: bool, who: str = "") -> None:
        self.gate = gate
        self.timeout = timeout
        self.repeat_aborts = repeat_aborts
        self.who = who
        self.server = None  # the uvicorn server it stops (set once built)
        self.stop_signal: int | None = None  # the first signal received
        self._drain_task: asyncio.Task | None = None
        self._drain_from = 0  # requests in flight when the drain began
        self._drain_start = 0.0

    def on_signal(self, sig: int) -> None:
        """The signal handler (main thread): start the drain or stop now, on the event loop."""
        first = self.stop_signal is None
        if first:
            self.stop_signal = sig
        if sig == ABORT_SIGNAL or (not first and self.repeat_aborts):
            self._on_loop(self._stop_now, sig)
        elif first:
            self._on_loop(self._begin, sig)

    def _on_loop(self, fn: Callable[[int], None], sig: int) -> None:
        loop = self.gate.loop
        if loop is None or loop.is_closed():
            self.server.should_exit = True  # the app has not started: nothing to drain or abort
            return
        loop.call_soon_threadsafe(fn, sig)

    def _begin(self, sig: int) -> None:
        app = self.gate.app
        if app is None or self.timeout <= 0 or self.server.should_exit:
            self._stop_now(sig)
            return
        drain: ServerDrain = app.state.drain
        drain.draining = True
        self._drain_from, self._drain_start = drain.in_flight, time.monotonic()
        logger.info("%ssignal %d: draining %d request(s) in flight for up to %g s (--shutdown-timeout); new requests "
                    "and /health get 503; a second SIGTERM/SIGINT aborts them at once", self.who, sig,
                    drain.in_flight, self.timeout)
        self._drain_task = asyncio.get_running_loop().create_task(self._drain(sig))

    async def _drain(self, sig: int) -> None:
        await self.gate.app.state.drain.wait_idle(self.timeout)
        self._finish(f"the server is stopping (signal {sig}) and the request was still running after the "
                     f"{self.timeout:g} s of --shutdown-timeout")

    def _stop_now(self, sig: int) -> None:
        if self._drain_task is not None and not self._drain_task.done():
            self._drain_task.cancel()
            self._finish(f"the server is stopping (signal {sig} ended the drain)")
            return
        if self.server.should_exit:
            return  # already stopping: every request has ended or been aborted
        app = self.gate.app
        if app is not None:
            n = app.state.drain.in_flight
            if n:
                logger.info("%ssignal %d: stopping; aborting %d request(s) in flight", self.who, sig, n)
            app.state.llm.abort_all(f"the server is stopping (signal {sig})")
        self.server.should_exit = True

    def _finish(self, reason: str) -> None:
        app = self.gate.app
        drain: ServerDrain = app.state.drain
        left = drain.in_flight
        if left:
            app.state.llm.abort_all(reason)
        logger.info("%sdrain ended after %.1f s: %d request(s) finished, %d aborted; %d new request(s) refused",
                    self.who, time.monotonic() - self._drain_start, self._drain_from - left, left, drain.rejected)
        self.server.should_exit = True


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
    from tandem.engine.launch import kill_spawned

    core_log = logging.getLogger("tandem.engine.core_client")
    core_log.disabled = True  # it would log the cores' deaths as a failure
    start = time.monotonic()
    try:
        while thread.is_alive() and time.monotonic() < start + ENGINE_STOP_TIMEOUT_S + 3.0:
            if not kill_spawned() and time.monotonic() > start + 0.5:
                return  # none spawned here (attached), or none left
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
    interrupted (SIGTERM/SIGINT: drained or aborted by ``args.shutdown_timeout``,
    :class:`_Stopper`) or until an engine core dies (then exit 1 after failing every live
    request); shuts the engine down. With ``args.api_server_count`` > 1 this is one of the
    API servers of :mod:`~tandem.entrypoints.openai.api_server_manager`: a repeated
    SIGTERM/SIGINT does not abort its drain, :data:`ABORT_SIGNAL` does.

    Raises:
        Exception: what ``load_llm`` raised (once the server has stopped).
        SystemExit: 1 when an engine core died.
    """
    import uvicorn

    names = served_names(args)
    keys = api_keys(args)
    host, port = sock.getsockname()[:2]
    managed = args.api_server_count > 1
    who = f"API server {api_server_index} of {args.api_server_count}, " if managed else ""
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
                        enable_auto_tool_choice=args.enable_auto_tool_choice,
                        return_tokens_as_token_ids=args.return_tokens_as_token_ids)
        app.state.on_engine_dead = on_engine_dead
        usable = llm.num_kv_blocks - cfg.parallel_config.data_parallel_size  # one null block per replica
        logger.info("%slistening on http://%s:%d: model %s (served as %s), max_model_len %d, max_num_seqs %d, "
                    "max_num_batched_tokens %d, KV cache %d tokens (%d blocks of %d) over %d replica(s), "
                    "api_server_count %d, pid %d", who,
                    host, port, cfg.model_config.model, ", ".join(names), llm.max_model_len, llm.resolved.max_num_seqs,
                    llm.resolved.max_num_batched_tokens, usable * cfg.cache_config.block_size, usable,
                    cfg.cache_config.block_size, cfg.parallel_config.data_parallel_size, args.api_server_count,
                    os.getpid())
        if keys:
            logger.info("the /v1 routes require an API key (%d accepted)", len(keys))
        return app

    thread, loaded = _load_in_thread(load_llm)
    gate = _LoadingGate(loaded, make_app, on_failed=stop_soon)
    stopper = _Stopper(gate, args.shutdown_timeout, repeat_aborts=not managed, who=who)
    signals = (signal.SIGINT, signal.SIGTERM, ABORT_SIGNAL) if managed else (signal.SIGINT, signal.SIGTERM)
    llm = None
    try:
        config = uvicorn.Config(gate, log_level=args.uvicorn_log_level, access_log=not args.disable_uvicorn_access_log,
                                timeout_keep_alive=args.timeout_keep_alive, timeout_graceful_shutdown=GRACEFUL_HTTP_S)
        server = stopper.server = _uvicorn_server(config, stopper.on_signal, signals)
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
        if stopper.stop_signal is not None:
            return  # stopped while loading
        if loaded.done():
            raise loaded.exception()  # loading failed
        raise RuntimeError("the HTTP server stopped before the engine was loaded")
    if dead or gate.app_failed:
        raise SystemExit(1)
