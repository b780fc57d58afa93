"""The reward server's HTTP side: a FastAPI app on uvicorn, with auth, limits, timeouts and metrics.

    GET  /health   200 {"status": "ok", "reward": name, "max_batch": N, "max_wait_ms": M}   (no auth: for probes)
    GET  /metrics  Prometheus text: requests by status, images scored and failed, batches, queue, latency
    POST /score    {"images": [base64 PNG], "prompts": [...], "metadata": [...]} -> {"scores": [float | null]}

Answers: 400 malformed (any unparseable JSON included), 401 missing/wrong bearer token, 404 unknown path, 408 body
not received within the read timeout, 411/413 body size, 500 reward broke its contract, 503 busy (queue full, or
uvicorn's connection limit), 504 scoring took longer than the request timeout. Every error body is
{"error": message}.

Protection against slow or half-sent requests: a connection must deliver its whole request (headers and body)
within `read_timeout_s` of connecting (or of its previous answer) or it is closed; at most `max_connections`
connections are served at once (uvicorn's limit_concurrency: 503 beyond); at most `max_queue` requests wait for
scoring (503 beyond, with Retry-After). Requests are handled on the event loop, never one thread each; PNG
decoding runs in anyio's bounded worker pool.
"""

from __future__ import annotations

import asyncio
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
        start = time.perf_counter()
        if (denied := unauthorized(request)) is not None:
            return denied
        try:
            body = await _read_body(request, settings.limits.max_body_bytes)
            images, prompts, metadata = await anyio.to_thread.run_sync(parse_score_request, body, settings.limits)
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


async def _read_body(request, max_bytes: int) -> bytes:
    """The request body, refusing (TooLarge) a declared or actual size over max_bytes without reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise BadRequest("the Content-Length header is not a number")
        if int(declared) > max_bytes:
            raise TooLarge(f"request of {declared} bytes is over max_body_bytes={max_bytes}; send smaller chunks")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise TooLarge(f"request body is over max_body_bytes={max_bytes}; send smaller chunks")
            chunks.append(chunk)
    except ClientDisconnect:
        raise _ClientGone() from None
    return b"".join(chunks)


def timed_protocol(read_timeout_s: float, metrics: Metrics) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request is not fully received within read_timeout_s of
    the connection opening (or of its previous answer): a client that sends half a request holds no thread and no
    slot for longer than that."""

    class TimedH11Protocol(H11Protocol):
        _read_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.DONE or self.conn.their_state is h11.MUST_CLOSE:
                self._disarm()  # the whole request is in: the app has it

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request on this keep-alive connection gets its own deadline

        def connection_lost(self, exc) -> None:
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
            http=timed_protocol(settings.read_timeout_s, self.metrics),
            lifespan="off",
            log_config=None,
            access_log=False,
            limit_concurrency=settings.max_connections,
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
