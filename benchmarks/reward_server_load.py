"""Load test of the reward server on loopback: throughput and latency at batch 16, and behaviour under 4× overload.

Starts `python -m diffusion_rl.rewards.server` (a real process, default settings but `--max-queue`) on 127.0.0.1 with
the `jpeg_incompressibility` reward, then:

1. steady load: `--clients` clients, each sending requests of `--batch` 64-px images back to back (one keep-alive
   connection each) for `--seconds` or `--requests` requests in all: requests/s, images/s, p50/p99 latency;
2. overload: requests sent open-loop at 4× the rate measured in 1 (up to `--max-inflight` client threads) for
   `--seconds`: how many were answered 200, 503 (shed), other codes, or failed to connect; the latency of the 200s;
   and whether the server still answers /health afterwards.

Bounded in count and time; only 127.0.0.1 is contacted. Prints JSON (with /proc/loadavg before and after: the
machine may be shared, so the numbers are indicative) and writes benchmarks/results/reward_server_load.json.

    python benchmarks/reward_server_load.py [--batch 16] [--clients 4] [--seconds 10] [--requests 400]
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from diffusion_rl.rewards.remote import encode_png_base64

ROOT = Path(__file__).resolve().parents[1]
OVERLOAD = 4.0


def loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "n/a"


def start_server(max_queue: int) -> tuple[subprocess.Popen, str, int]:
    command = [sys.executable, "-m", "diffusion_rl.rewards.server", "--reward", "jpeg_incompressibility"]
    command += ["--host", "127.0.0.1", "--port", "0", "--max-queue", str(max_queue), "--log-level", "WARNING"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = process.stdout.readline().strip()
    if not line.startswith("serving reward"):
        process.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    url = line.rsplit(" ", 1)[-1]
    host, port = url.removeprefix("http://").split(":")
    return process, host, int(port)


def make_body(batch: int, seed: int = 0) -> bytes:
    images = np.random.default_rng(seed).integers(0, 256, (batch, 64, 64, 3), dtype=np.uint8)
    payload = {"images": [encode_png_base64(im) for im in images], "prompts": ["a prompt"] * batch}
    return json.dumps(payload).encode()


class Client:
    """One keep-alive connection per thread; reconnects after the server closes it (e.g. after a 503)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.local = threading.local()

    def post(self, body: bytes) -> tuple[int, float]:
        """(status or -1 for a connection error, seconds)."""
        start = time.perf_counter()
        for attempt in range(2):
            conn = getattr(self.local, "conn", None)
            if conn is None:
                conn = self.local.conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
            try:
                conn.request("POST", "/score", body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                response.read()
                if response.getheader("connection", "").lower() == "close":
                    conn.close()
                    self.local.conn = None
                return response.status, time.perf_counter() - start
            except (OSError, http.client.HTTPException):
                conn.close()
                self.local.conn = None
                if attempt:
                    return -1, time.perf_counter() - start
        return -1, time.perf_counter() - start


class Tally:
    """Statuses of the answers and the latency of the 200s, from many threads."""

    def __init__(self):
        self.lock, self.statuses, self.latencies = threading.Lock(), Counter(), []

    def send(self, client: Client, body: bytes) -> None:
        status, seconds = client.post(body)
        with self.lock:
            self.statuses[status] += 1
            if status == 200:
                self.latencies.append(seconds)

    def summary(self) -> dict:
        out = {"statuses": {str(k): v for k, v in sorted(self.statuses.items())}}
        if self.latencies:
            values = np.array(self.latencies) * 1000
            out["p50_ms"] = round(float(np.percentile(values, 50)), 1)
            out["p99_ms"] = round(float(np.percentile(values, 99)), 1)
        return out


def steady(client: Client, body: bytes, clients: int, seconds: float, requests: int) -> dict:
    """`clients` closed-loop clients, until `seconds` pass or `requests` have been sent."""
    deadline, tally = time.perf_counter() + seconds, Tally()
    tickets = iter(range(requests))  # next() on a shared iterator: each request is taken once

    def worker() -> None:
        while time.perf_counter() < deadline and next(tickets, None) is not None:
            tally.send(client, body)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    ok = tally.statuses[200]
    return {"clients": clients, "seconds": round(elapsed, 2), "requests": sum(tally.statuses.values()),
            "requests_per_s": round(ok / elapsed, 2), **tally.summary()}  # fmt: skip


def overload(client: Client, body: bytes, rate: float, seconds: float, max_inflight: int) -> dict:
    """Requests sent open-loop at `rate` per second for `seconds` (at most max_inflight at once), then drained."""
    tally, start, submitted = Tally(), time.perf_counter(), 0
    with ThreadPoolExecutor(max_workers=max_inflight) as pool:
        while (now := time.perf_counter() - start) < seconds:
            due = int(now * rate) + 1
            for _ in range(due - submitted):
                pool.submit(tally.send, client, body)
            submitted = due
            time.sleep(0.002)
    elapsed = time.perf_counter() - start  # includes draining what was sent
    return {"target_rate_per_s": round(rate, 2), "sent": submitted, "seconds_incl_drain": round(elapsed, 2),
            "answered_200_per_s": round(tally.statuses[200] / elapsed, 2), **tally.summary()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--max-queue", type=int, default=16)
    parser.add_argument("--max-inflight", type=int, default=96)
    args = parser.parse_args()

    result = {"date": time.strftime("%Y-%m-%d"), "loadavg_before": loadavg(), "batch": args.batch,
              "image_size": 64, "reward": "jpeg_incompressibility", "server_max_queue": args.max_queue}  # fmt: skip
    process, host, port = start_server(args.max_queue)
    try:
        client = Client(host, port)
        body = make_body(args.batch)
        client.post(body)  # warm-up
        result["steady"] = steady(client, body, args.clients, args.seconds, args.requests)
        result["steady"]["images_per_s"] = round(result["steady"]["requests_per_s"] * args.batch, 1)
        rate = OVERLOAD * max(result["steady"]["requests_per_s"], 1.0)
        result["overload_4x"] = overload(Client(host, port), body, rate, args.seconds, args.max_inflight)
        health = http.client.HTTPConnection(host, port, timeout=30)
        health.request("GET", "/health")
        result["alive_after_overload"] = health.getresponse().status == 200 and process.poll() is None
        health.close()
    finally:
        process.terminate()
        process.wait(timeout=30)
        process.stdout.close()
    result["loadavg_after"] = loadavg()
    out = ROOT / "benchmarks" / "results" / "reward_server_load.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
