"""Serve a reward over HTTP, so that training processes share one copy of it (one GPU model, one OCR engine).

    diffusion-rl serve-reward --reward ocr --kwargs '{"det_limit_side_len": 320}' --port 8000
    python -m diffusion_rl.rewards.server --reward ocr --port 8000            (the same)

The stack is FastAPI on uvicorn (serving/app.py): one event loop takes the requests, a batcher thread scores them
(serving/batching.py), and each request is checked before any image is decoded (serving/requests.py). The wire
format is in `diffusion_rl.rewards.remote` (the `remote` reward is the client): JSON with base64 PNG images, never
pickle.

    GET  /health -> 200 {"status": "ok", "reward": name, "max_batch": N, "max_wait_ms": M}
    GET  /metrics -> Prometheus text (requests by status, images, batches, queue, latency quantiles)
    POST /score  -> 200 {"scores": [float | null, ...]} (null = failed sample; "error" says why when the reward
                    raised on some of them); 4xx/5xx {"error": message} (serving/app.py lists them).

Auth: with a token (`--token`, or the environment variable DIFFUSION_RL_REWARD_TOKEN), /score and /metrics need
"Authorization: Bearer <token>". Listening on anything but a loopback address without a token is refused unless
`--allow-no-token` is given (then a warning says that anyone who can reach the port can use the reward).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import socket
import sys
from collections.abc import Sequence

from diffusion_rl.errors import UserError
from diffusion_rl.rewards.base import RewardFn
from diffusion_rl.rewards.remote import TOKEN_ENV
from diffusion_rl.rewards.serving.batching import BatchingScorer, check_batching
from diffusion_rl.rewards.serving.requests import BadRequest, Limits, parse_score_request
from diffusion_rl.rewards.serving.settings import ServerSettings
from diffusion_rl.rewards.video import FRAME_REDUCTIONS, framewise
from diffusion_rl.utils.json_input import parse_json

logger = logging.getLogger(__name__)


INSTALL_COMMAND = "pip install 'diffusion-rl[serve]'"

__all__ = ["BadRequest", "BatchingScorer", "Limits", "ServerSettings", "make_server", "parse_score_request"]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def make_server(
    reward_fn: RewardFn,
    host: str = "127.0.0.1",
    port: int = 0,
    max_batch: int = 64,
    max_wait_ms: float = 20.0,
    name: str = "reward",
    *,
    token: str | None = None,
    allow_no_token: bool = False,
    max_queue: int = 64,
    reward_timeout_s: float | None = None,
    settings: ServerSettings | None = None,
):
    """A server (serving/app.py's RewardServer) bound to (host, port) and ready to `serve_forever()`; port 0 picks a
    free port (see `.url`)."""
    try:
        from diffusion_rl.rewards.serving.app import RewardServer
    except ImportError as e:
        raise UserError(f"serve-reward needs FastAPI and uvicorn ({e}); install them with {INSTALL_COMMAND}") from None
    settings = settings or ServerSettings()
    settings = ServerSettings(**{**settings.__dict__, "token": token}) if token is not None else settings
    if settings.token is not None and not settings.token.strip():
        raise UserError("serve-reward: the token is empty; give a non-empty --token or unset it")
    if settings.token is None and not is_loopback(host):
        if not allow_no_token:
            raise UserError(
                f"serve-reward: --host {host} is reachable from other machines and there is no token: anyone who can "
                f"reach the port could use the reward. Give --token (or set {TOKEN_ENV}; the `remote` reward sends "
                "it), or pass --allow-no-token on a trusted network"
            )
        logger.warning(
            "serve-reward: listening on %s WITHOUT a token (--allow-no-token): anyone who can reach port %s can use "
            "the reward and load this machine",
            host,
            port,
        )
    scorer = BatchingScorer(reward_fn, name, max_batch, max_wait_ms, max_queue, reward_timeout_s)
    try:
        return RewardServer(scorer, host, port, settings)
    except OSError as e:
        scorer.close()
        raise cannot_listen(host, port, e) from None


def cannot_listen(host: str, port: int, error: OSError) -> UserError:
    return UserError(f"serve-reward: cannot listen on {host}:{port} ({error}); pick another --port")


def check_port_free(host: str, port: int) -> None:
    """A UserError when (host, port) cannot be listened on now (taken, or an address not on this machine); port 0
    is always free. The server binds again later: this only spares loading a reward for a port it cannot have."""
    if port == 0:
        return
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no obstacle
            probe.bind((host, port))
    except OSError as e:
        raise cannot_listen(host, port, e) from None


def serve(server, name: str) -> None:
    """Serve until interrupted (Ctrl-C / SIGINT, SIGTERM)."""
    # The ready line goes to stdout, flushed: scripts (and our tests) wait for it and read the port from it.
    print(f"serving reward '{name}' on {server.url}", flush=True)
    try:
        server.serve_forever()
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
    parser.add_argument("--token", default=None, help=f"bearer token required on /score and /metrics (or {TOKEN_ENV})")
    parser.add_argument("--allow-no-token", action="store_true", help="listen off loopback without a token")
    parser.add_argument("--max-queue", type=int, default=64, help="requests waiting to be scored; 503 beyond")
    parser.add_argument(
        "--max-connections", type=int, default=128, help="authenticated requests read or scored at once; 503 beyond"
    )
    parser.add_argument(
        "--max-open-connections",
        type=int,
        default=1024,
        help="open connections; beyond, the oldest with no request in progress (idle, unauthenticated) is closed",
    )
    parser.add_argument("--read-timeout-s", type=float, default=30.0, help="a request must arrive within this")
    parser.add_argument("--request-timeout-s", type=float, default=600.0, help="504 when scoring takes longer")
    parser.add_argument("--reward-timeout-s", type=float, default=None, help="deadline of one reward call")
    parser.add_argument("--max-body-mb", type=float, default=256.0, help="largest request body, MiB (413 beyond)")
    parser.add_argument("--max-image-pixels", type=int, default=4096 * 4096, help="per image, from its PNG header")
    parser.add_argument("--max-request-pixels", type=int, default=64 * 1024 * 1024, help="per request, summed")
    parser.add_argument(
        "--frames",
        default="mean",
        choices=FRAME_REDUCTIONS,
        help="how an image reward scores a video sent whole: its frames' mean or min, or the first or last frame's",
    )


def server_from_args(args: argparse.Namespace):
    """The server for `args` (from add_serve_reward_arguments), its reward built."""
    from diffusion_rl.rewards import make_reward

    try:
        kwargs = parse_json(args.kwargs)
    except json.JSONDecodeError as e:
        raise UserError(f"serve-reward: --kwargs is not valid JSON ({e}): {args.kwargs!r}") from None
    if not isinstance(kwargs, dict):
        raise UserError(f"serve-reward: --kwargs must be a JSON object like '{{\"key\": 1}}', got {args.kwargs!r}")
    if not 0 <= args.port <= 65535:
        raise UserError(f"serve-reward: --port must be in [0, 65535] (0 picks a free one), got {args.port}")
    positive = {
        "--read-timeout-s": args.read_timeout_s,
        "--request-timeout-s": args.request_timeout_s,
        "--max-body-mb": args.max_body_mb,
        "--max-connections": args.max_connections,
        "--max-open-connections": args.max_open_connections,
        "--max-image-pixels": args.max_image_pixels,
        "--max-request-pixels": args.max_request_pixels,
        "--reward-timeout-s": 1 if args.reward_timeout_s is None else args.reward_timeout_s,
    }
    bad = [f"{flag} {value}" for flag, value in positive.items() if not value > 0]
    if bad:
        raise UserError(f"serve-reward: these must be > 0: {', '.join(bad)}")
    check_batching(args.max_batch, args.max_wait_ms, args.max_queue)  # before the build, not when the scorer starts
    limits = Limits(int(args.max_body_mb * 1024 * 1024), args.max_image_pixels, args.max_request_pixels)
    settings = ServerSettings(limits, args.token or os.environ.get(TOKEN_ENV) or None, args.read_timeout_s,
                              args.request_timeout_s, args.max_connections, args.max_open_connections)  # fmt: skip
    check_port_free(args.host, args.port)  # before the reward's model loads (minutes, for a large one)
    reward_fn = framewise(make_reward(args.reward, **kwargs), args.frames, args.reward)  # videos, frame by frame
    return make_server(reward_fn, args.host, args.port, args.max_batch, args.max_wait_ms, args.reward,
                       allow_no_token=args.allow_no_token, max_queue=args.max_queue,
                       reward_timeout_s=args.reward_timeout_s, settings=settings)  # fmt: skip


def run_server_from_args(args: argparse.Namespace) -> None:
    """Build the reward named in `args` and serve it until interrupted."""
    serve(server_from_args(args), args.reward)


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
