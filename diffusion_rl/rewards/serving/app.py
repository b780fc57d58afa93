"""The reward server's HTTP side: a FastAPI app on uvicorn, with auth, limits, timeouts and metrics.

    GET  /health   200 {"status": "ok", "reward": name, "max_batch": N, "max_wait_ms": M}   (no auth: for probes)
    GET  /metrics  Prometheus text: requests by status, images scored and failed, batches, queue, latency
    POST /score    {"images": [base64 PNG], "prompts": [...], "metadata": [...]} -> {"scores": [float | null]}

Answers: 400 malformed (any unparseable JSON included), 401 missing/wrong bearer token, 404 unknown path, 408 body
not received within the read timeout, 411/413 body size, 500 reward broke its contract, 503 busy (queue full, or
`max_connections` authenticated requests in progress), 504 scoring took longer than the request timeout. Every
error body is {"error": message}.

Protection against slow, half-sent and unauthenticated requests: a connection must deliver its whole request
(headers and body) within `read_timeout_s` of connecting (or of its previous answer) or it is closed. Two separate
caps: at most `max_connections` requests that passed the token check are read and scored at once (503 beyond), so
connections that never finish their headers or carry no token take no slot of real work; and at most
`max_open_connections` sockets are open — past that, the oldest connection with no request in progress (still
sending its headers, refused, or idle between requests) is closed to make room, so a flood of idle connections
cannot lock a client out. At most `max_queue` requests wait for scoring (503 beyond, with Retry-After). Requests
are handled on the event loop, never one thread each; PNG decoding runs in anyio's bounded worker pool. A body is
read into one buffer of its declared size (bounded by max_body_bytes, and counted as it streams), and after a
large request the freed memory is handed back to the system (glibc's malloc_trim).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import hmac
import logging
import socket
import threading
import time
from collections import Counter, deque

import anyio.to_thread
import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from diffusion_rl.rewards.serving.batching import BatchingScorer, Busy
from diffusion_rl.rewards.serving.requests import BadRequest, TooLarge, parse_score_request
from diffusion_rl.rewards.serving.settings import ServerSettings

logger = logging.getLogger(__name__)

LATENCY_WINDOW = 2048  # the last requests whose latency /metrics summarises


class Metrics:
    """Counters and a latency window, updated on the event loop; rendered in the Prometheus text format."""

    def __init__(self):
        self.by_status: Counter[int] = Counter()
        self.read_timeouts = 0
        self.evicted = 0  # connections closed to make room under max_open_connections
        self.latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)

    def render(self, scorer: BatchingScorer) -> str:
        lines = ["# TYPE reward_server_requests_total counter"]
        lines += [f'reward_server_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.by_status.items())]
        stats = scorer.stats
        lines += [
            "# TYPE reward_server_images_scored_total counter",
            f"reward_server_images_scored_total {stats.images}",
            "# TYPE reward_server_images_failed_total counter",
            f"reward_server_images_failed_total {stats.failed_images}",
            "# TYPE reward_server_batches_total counter",
            f"reward_server_batches_total {stats.batches}",
            "# TYPE reward_server_queue_requests gauge",
            f"reward_server_queue_requests {scorer.pending}",
            "# TYPE reward_server_read_timeouts_total counter",
            f"reward_server_read_timeouts_total {self.read_timeouts}",
            "# TYPE reward_server_evicted_connections_total counter",
            f"reward_server_evicted_connections_total {self.evicted}",
        ]
        if self.latencies:
            ordered = sorted(self.latencies)
            lines.append("# TYPE reward_server_score_latency_seconds summary")
            for q in (0.5, 0.9, 0.99):
                value = ordered[min(len(ordered) - 1, int(q * len(ordered)))]
                lines.append(f'reward_server_score_latency_seconds{{quantile="{q}"}} {value:.6f}')
            lines.append(f"reward_server_score_latency_seconds_count {len(ordered)}")
        return "\n".join(lines) + "\n"


def make_app(scorer: BatchingScorer, settings: ServerSettings, metrics: Metrics):
    """The FastAPI app serving `scorer`."""
    app = FastAPI(title=f"reward server: {scorer.name}", docs_url=None, redoc_url=None, openapi_url=None)
    active = 0  # authenticated /score requests being read or scored (the event loop is their only writer)

    def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
        metrics.by_status[status] += 1
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        where = "use GET /health, GET /metrics or POST /score"
        message = f"no such path {request.url.path}; {where}" if exc.status_code == 404 else str(exc.detail)
        return error(exc.status_code, message)

    def unauthorized(request: Request) -> JSONResponse | None:
        if settings.token is None:
            return None
        given = request.headers.get("authorization", "")
        scheme, _, credential = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(credential.encode(), settings.token.encode()):
            return None
        return error(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})

    @app.get("/health")
    async def health() -> JSONResponse:
        metrics.by_status[200] += 1
        health = {"status": "ok", "reward": scorer.name, "max_batch": scorer.max_batch}
        return JSONResponse({**health, "max_wait_ms": round(scorer.max_wait_s * 1000, 3)})

    @app.get("/metrics")
    async def metrics_endpoint(request: Request):
        if (denied := unauthorized(request)) is not None:
            return denied
        metrics.by_status[200] += 1
        return PlainTextResponse(metrics.render(scorer))

    @app.post("/score")
    async def score(request: Request):
        nonlocal active
        if (denied := unauthorized(request)) is not None:  # before taking a slot: no token, no slot
            return denied
        if active >= settings.max_connections:
            return error(
                503, f"busy: {active} requests in progress (max_connections); retry later", {"Retry-After": "1"}
            )
        active += 1
        try:
            answer = await score_authorized(request)
        finally:
            active -= 1
        if getattr(request.state, "body_bytes", 0) >= TRIM_ABOVE_BYTES:  # its buffers are garbage now
            await anyio.to_thread.run_sync(release_memory)
        return answer

    async def score_authorized(request: Request):
        start = time.perf_counter()
        try:
            body = await _read_body(request, settings.limits.max_body_bytes)
            request.state.body_bytes = len(body)
            text = await anyio.to_thread.run_sync(_text_of, body)
            del body  # one copy of the body at a time: the bytes, then the text, then the parsed JSON
            images, prompts, metadata = await anyio.to_thread.run_sync(parse_score_request, text, settings.limits)
        except BadRequest as e:  # TooLarge included (413)
            return error(e.status, str(e))
        except _ClientGone:
            return error(400, "the client closed the connection before sending the whole body")
        try:
            job = scorer.submit(images, prompts, metadata)
        except Busy as e:
            return error(503, f"busy: {e}; retry later", {"Retry-After": "1"})
        try:
            # shield: a timed-out request must not cancel the job, which the batcher is about to finish
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job.future)), timeout=settings.request_timeout_s)
        except asyncio.TimeoutError:
            return error(504, f"scoring took longer than request_timeout_s={settings.request_timeout_s:g} s")
        if job.fatal:
            return error(500, job.fatal)
        answer: dict = {"scores": job.scores}
        if job.error:
            answer["error"] = job.error
        metrics.by_status[200] += 1
        metrics.latencies.append(time.perf_counter() - start)
        return JSONResponse(answer)

    return app


class _ClientGone(Exception):
    pass


async def _read_body(request, max_bytes: int) -> bytearray:
    """The request body, refusing (TooLarge) a declared or actual size over max_bytes without reading it all; read
    into one buffer (of the declared size when there is one), never a list of chunks joined into a second copy."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise BadRequest("the Content-Length header is not a number")
        if int(declared) > max_bytes:
            raise TooLarge(f"request of {declared} bytes is over max_body_bytes={max_bytes}; send smaller chunks")
    body = bytearray()
    try:
        async for chunk in request.stream():
            if len(body) + len(chunk) > max_bytes:
                raise TooLarge(f"request body is over max_body_bytes={max_bytes}; send smaller chunks")
            body += chunk
    except ClientDisconnect:
        raise _ClientGone() from None
    return body


def _text_of(body: bytearray) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"the body is not JSON (not UTF-8: {e.reason} at byte {e.start})") from None


TRIM_ABOVE_BYTES = 8 * 1024 * 1024  # after a body this large, hand the freed memory back (release_memory)


def release_memory() -> None:
    """Give freed heap memory back to the system (glibc's malloc_trim): a large request's buffers are freed, but
    glibc keeps the pages, and the server stayed at 1.25 GB after one 200 MB body. A no-op elsewhere."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def timed_protocol(read_timeout_s: float, metrics: Metrics, max_open: int = 1024) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request is not fully received within read_timeout_s of
    the connection opening (or of its previous answer): a client that sends half a request holds no thread and no
    slot for longer than that. Past `max_open` open connections, a new one closes the oldest that has no request in
    progress (or itself, when every one has)."""
    opened: dict[H11Protocol, None] = {}  # the open connections, oldest first (the event loop is the only writer)

    class TimedH11Protocol(H11Protocol):
        _read_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            opened[self] = None
            if len(opened) > max_open:
                idle = next((p for p in opened if p is not self and p._no_request_in_progress()), self)
                opened.pop(idle, None)
                metrics.evicted += 1
                idle.transport.close()
                if idle is self:
                    return
            self._arm()

        def _no_request_in_progress(self) -> bool:
            """Still sending its headers, answered already (e.g. 401) or idle between requests: nothing to lose."""
            return (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.DONE or self.conn.their_state is h11.MUST_CLOSE:
                self._disarm()  # the whole request is in: the app has it

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request on this keep-alive connection gets its own deadline

        def connection_lost(self, exc) -> None:
            opened.pop(self, None)
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._read_deadline = self.loop.call_later(read_timeout_s, self._read_timed_out)

        def _disarm(self) -> None:
            if self._read_deadline is not None:
                self._read_deadline.cancel()
                self._read_deadline = None

        def _read_timed_out(self) -> None:
            self._read_deadline = None
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
                metrics.read_timeouts += 1
                if self.conn.their_state is h11.SEND_BODY:
                    logger.info("closing %s: its request did not arrive within %g s", self.client, read_timeout_s)
                self.transport.close()

    return TimedH11Protocol


class RewardServer:
    """A reward server bound to a socket: `url`, `serve_forever()` (blocks), `shutdown()`, `server_close()`."""

    def __init__(self, scorer: BatchingScorer, host: str, port: int, settings: ServerSettings):
        self.scorer, self.settings = scorer, settings
        self.metrics = Metrics()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
        except OSError:
            self.socket.close()
            raise
        self.socket.listen(2048)
        config = uvicorn.Config(
            make_app(scorer, settings, self.metrics),
            http=timed_protocol(settings.read_timeout_s, self.metrics, settings.max_open_connections),
            lifespan="off",
            log_config=None,
            access_log=False,
            limit_concurrency=None,  # it counts idle connections too; the app caps authenticated work instead
            timeout_keep_alive=5,
            timeout_graceful_shutdown=5,
        )
        self._server = uvicorn.Server(config)
        self._running = False
        self._stopped = threading.Event()

    @property
    def url(self) -> str:
        host, port = self.socket.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def serve_forever(self, poll_interval: float | None = None) -> None:
        """Serve until shutdown() (or SIGINT/SIGTERM when run on the main thread). poll_interval is accepted for
        the old http.server API and unused."""
        self._running = True
        try:
            self._server.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        self._server.should_exit = True
        if self._running:
            self._stopped.wait(timeout=15)

    def server_close(self) -> None:
        self.socket.close()
        self.scorer.close()
