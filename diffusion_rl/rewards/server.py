"""Serve a reward over HTTP, so that training processes share one copy of it (one GPU model, one OCR engine).

    python -m diffusion_rl.rewards.server --reward ocr --kwargs '{"det_limit_side_len": 320}' --port 8000

Requests arriving together are scored as one batch: the batcher waits up to `max_wait_ms` after the first request
for more, up to `max_batch` images, then calls the reward once per image size. If that call raises, each request
is scored on its own, and a request on which the reward still raises image by image: an image on which it raises
gets null, the others their scores (as the trainer's RewardCombiner retries sample by sample). The wire format is in
`diffusion_rl.rewards.remote` (the `remote` reward is the client): JSON with base64 PNG images, never pickle.

    GET  /health -> 200 {"status": "ok", "reward": name, "max_batch": N, "max_wait_ms": M}
    POST /score  -> 200 {"scores": [float | null, ...]} (null = failed sample; "error" says why when the reward
                    raised on some of them); 400 for a malformed request, with a message saying what is wrong.

Bind to 127.0.0.1 (the default) unless the network is trusted: anyone who can reach the port can use the reward.
"""

import argparse
import json
import logging
import queue
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from diffusion_rl.errors import UserError
from diffusion_rl.rewards.base import RewardFn, check_reward_output

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 512 * 1024 * 1024  # a request larger than this is refused (413)
JOB_TIMEOUT_S = 3600.0  # a request thread gives up waiting for the batcher after this long (the reward hung)


class BadRequest(ValueError):
    """A request that breaks the wire format; the message goes back to the client with HTTP 400."""


@dataclass
class _Job:
    """One request's samples, waiting to be scored in a batch."""

    images: np.ndarray  # uint8 [n, H, W, 3]
    prompts: list[str]
    metadata: list[dict[str, Any]]
    done: threading.Event = field(default_factory=threading.Event)
    scores: list[float | None] | None = None
    error: str | None = None  # what the reward raised, if it did

    def __len__(self) -> int:
        return len(self.images)


class BatchingScorer:
    """Collects jobs from many request threads and scores them in batches on one worker thread."""

    def __init__(self, reward_fn: RewardFn, name: str = "reward", max_batch: int = 64, max_wait_ms: float = 20.0):
        if max_batch < 1 or max_wait_ms < 0:
            raise UserError(f"serve-reward: need max_batch >= 1 and max_wait_ms >= 0; got {max_batch}, {max_wait_ms}")
        self.reward_fn, self.name = reward_fn, name
        self.max_batch, self.max_wait_s = max_batch, max_wait_ms / 1000
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._carry: _Job | None = None  # a job that did not fit in the previous batch
        self._thread = threading.Thread(target=self._run, name="reward-batcher", daemon=True)
        self._thread.start()

    def score(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> _Job:
        """Queue the samples, wait for their batch, and return the finished job."""
        job = _Job(images, prompts, metadata)
        self._queue.put(job)
        if not job.done.wait(JOB_TIMEOUT_S):
            job.error = f"the reward did not finish within {JOB_TIMEOUT_S:.0f} s"
            job.scores = [None] * len(job)
        return job

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            batch = self._collect()
            if batch is None:
                return
            for group in _group_by_size(batch):
                self._score_group(group)

    def _collect(self) -> list[_Job] | None:
        """The next batch: the first waiting job, then whatever arrives within max_wait of it, up to max_batch."""
        first, self._carry = self._carry, None
        if first is None:
            first = self._queue.get()
            if first is None:
                return None
        batch, size = [first], len(first)
        deadline = time.monotonic() + self.max_wait_s
        while size < self.max_batch:
            try:
                job = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if job is None:  # closing: score what we have, then stop
                self._queue.put(None)
                break
            if size + len(job) > self.max_batch:
                self._carry = job
                break
            batch.append(job)
            size += len(job)
        return batch

    def _score_group(self, jobs: list[_Job]) -> None:
        """Score jobs whose images share one size with one reward call. If it raises, score each job on its own,
        so that one bad request does not fail the others, and a job on which it still raises image by image."""
        try:
            scores = self._call(jobs)
        except Exception as e:
            if len(jobs) > 1:
                for job in jobs:
                    self._score_group([job])
                return
            scores = self._score_one_by_one(jobs[0], e)
        start = 0
        for job in jobs:
            job.scores = [float(s) if np.isfinite(s) else None for s in scores[start : start + len(job)]]
            start += len(job)
            job.done.set()

    def _score_one_by_one(self, job: _Job, job_error: Exception) -> np.ndarray:
        """The job's scores, one reward call per image: NaN where the reward raises; the errors go in job.error."""
        scores = np.full(len(job), np.nan, dtype=np.float32)
        failed: dict[int, Exception] = {}
        if len(job) == 1:  # the job's call was the image's call
            failed[0] = job_error
        else:
            for i in range(len(job)):
                one = _Job(job.images[i : i + 1], job.prompts[i : i + 1], job.metadata[i : i + 1])
                try:
                    scores[i] = self._call([one])[0]
                except Exception as e:
                    failed[i] = e
        if failed:
            first, error = next(iter(failed.items()))
            logger.error(
                "reward '%s' raised on %d of %d samples of a request (first: sample %d)",
                self.name,
                len(failed),
                len(job),
                first,
                exc_info=error,
            )
            job.error = (
                f"reward '{self.name}' raised on {len(failed)} of {len(job)} samples (their scores are null); "
                f"sample {first}: {type(error).__name__}: {error}"
            )
        return scores

    def _call(self, jobs: list[_Job]) -> np.ndarray:
        images = np.concatenate([job.images for job in jobs])
        prompts = [p for job in jobs for p in job.prompts]
        metadata = [m for job in jobs for m in job.metadata]
        return check_reward_output(self.name, self.reward_fn(images, prompts, metadata), len(images))


def _group_by_size(jobs: list[_Job]) -> list[list[_Job]]:
    groups: dict[tuple[int, ...], list[_Job]] = {}
    for job in jobs:
        groups.setdefault(job.images.shape[1:], []).append(job)
    return list(groups.values())


def parse_score_request(body: bytes) -> tuple[np.ndarray, list[str], list[dict[str, Any]]]:
    """(images uint8 [n, H, W, 3], prompts, metadata) from a /score request body, or BadRequest saying why not."""
    from diffusion_rl.rewards.remote import decode_png_base64

    try:
        request = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"the body is not JSON ({e})") from None
    if not isinstance(request, dict):
        raise BadRequest('expected a JSON object {"images": [...], "prompts": [...], "metadata": [...]}')
    unknown = sorted(set(request) - {"images", "prompts", "metadata"})
    if unknown:
        raise BadRequest(f"unknown keys {unknown}; expected images, prompts and (optional) metadata")
    encoded, prompts = request.get("images"), request.get("prompts")
    if not isinstance(encoded, list) or not encoded or not all(isinstance(s, str) for s in encoded):
        raise BadRequest("'images' must be a non-empty list of base64 PNG strings")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise BadRequest("'prompts' must be a list of strings")
    metadata = request.get("metadata")
    metadata = [{} for _ in encoded] if metadata is None else metadata
    if not isinstance(metadata, list) or not all(isinstance(m, dict) for m in metadata):
        raise BadRequest("'metadata' must be a list of objects (or left out)")
    if not len(encoded) == len(prompts) == len(metadata):
        raise BadRequest(f"got {len(encoded)} images, {len(prompts)} prompts, {len(metadata)} metadata; need one each")
    images = []
    for i, text in enumerate(encoded):
        try:
            images.append(decode_png_base64(text))
        except Exception as e:  # binascii.Error, PIL.UnidentifiedImageError, ...: all mean a bad image
            raise BadRequest(f"images[{i}] is not a base64-encoded image ({type(e).__name__}: {e})") from None
    shapes = {image.shape for image in images}
    if len(shapes) > 1:
        raise BadRequest(f"all images of one request must have the same size; got {sorted(shapes)}")
    return np.stack(images), prompts, metadata


class _Handler(BaseHTTPRequestHandler):
    server: "RewardHTTPServer"

    def do_GET(self) -> None:
        if self.path.rstrip("/") != "/health":
            self._send(404, {"error": f"no such path {self.path}; use GET /health or POST /score"})
            return
        scorer = self.server.scorer
        health = {"status": "ok", "reward": scorer.name, "max_batch": scorer.max_batch}
        self._send(200, {**health, "max_wait_ms": scorer.max_wait_s * 1000})

    def do_POST(self) -> None:
        if self.path.rstrip("/") != "/score":
            self._send(404, {"error": f"no such path {self.path}; use POST /score"})
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._send(411, {"error": "a Content-Length header is required"})
            return
        if int(length) > MAX_BODY_BYTES:
            self._send(413, {"error": f"request of {length} bytes is over {MAX_BODY_BYTES}; send smaller chunks"})
            return
        body = self.rfile.read(int(length))
        try:
            images, prompts, metadata = parse_score_request(body)
        except BadRequest as e:
            self._send(400, {"error": str(e)})
            return
        job = self.server.scorer.score(images, prompts, metadata)
        answer: dict[str, Any] = {"scores": job.scores}
        if job.error:
            answer["error"] = job.error
        self._send(200, answer)

    def _send(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # route http.server's access log to logging
        logger.debug("%s %s", self.address_string(), format % args)


class RewardHTTPServer(ThreadingHTTPServer):
    """The HTTP front of a BatchingScorer. `url` is where it listens (the real port when created with port 0)."""

    daemon_threads = True

    def __init__(self, scorer: BatchingScorer, host: str, port: int):
        super().__init__((host, port), _Handler)
        self.scorer = scorer

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def server_close(self) -> None:
        super().server_close()
        self.scorer.close()


def make_server(
    reward_fn: RewardFn,
    host: str = "127.0.0.1",
    port: int = 0,
    max_batch: int = 64,
    max_wait_ms: float = 20.0,
    name: str = "reward",
) -> RewardHTTPServer:
    """A server bound to (host, port) and ready to `serve_forever()`; port 0 picks a free port (see `.url`)."""
    scorer = BatchingScorer(reward_fn, name=name, max_batch=max_batch, max_wait_ms=max_wait_ms)
    try:
        return RewardHTTPServer(scorer, host, port)
    except OSError as e:
        scorer.close()
        raise UserError(f"serve-reward: cannot listen on {host}:{port} ({e}); pick another --port") from None


def serve(
    reward_fn: RewardFn,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch: int = 64,
    max_wait_ms: float = 20.0,
    name: str = "reward",
) -> None:
    """Serve `reward_fn` until interrupted (Ctrl-C / SIGINT)."""
    server = make_server(reward_fn, host, port, max_batch, max_wait_ms, name)
    # The ready line goes to stdout, flushed: scripts (and our tests) wait for it and read the port from it.
    print(f"serving reward '{name}' on {server.url}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        logger.info("serve-reward: interrupted, shutting down")
    finally:
        server.server_close()


# ---- command line (`diffusion-rl serve-reward` adds the same arguments) ----


def add_serve_reward_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reward", required=True, help="registered reward name, or package.module:function")
    parser.add_argument("--kwargs", default="{}", help="the reward's keyword arguments as a JSON object")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one")
    parser.add_argument("--max-batch", type=int, default=64, help="most images scored in one reward call")
    parser.add_argument("--max-wait-ms", type=float, default=20.0, help="how long a batch waits for more requests")


def run_server_from_args(args: argparse.Namespace) -> None:
    """Build the reward named in `args` (from add_serve_reward_arguments) and serve it until interrupted."""
    from diffusion_rl.rewards import make_reward

    try:
        kwargs = json.loads(args.kwargs)
    except json.JSONDecodeError as e:
        raise UserError(f"serve-reward: --kwargs is not valid JSON ({e}): {args.kwargs!r}") from None
    if not isinstance(kwargs, dict):
        raise UserError(f"serve-reward: --kwargs must be a JSON object like '{{\"key\": 1}}', got {args.kwargs!r}")
    reward_fn = make_reward(args.reward, **kwargs)
    serve(reward_fn, args.host, args.port, args.max_batch, args.max_wait_ms, name=args.reward)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffusion_rl.rewards.server", description=__doc__.split("\n")[0])
    add_serve_reward_arguments(parser)
    parser.add_argument("--log-level", default="INFO", help="DEBUG logs every request")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run_server_from_args(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
