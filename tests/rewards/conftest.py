"""Fixtures of the reward tests: a scriptable HTTP server on 127.0.0.1 for the network rewards' fault tests (5xx,
4xx, slow answers), and hand-written transformer forward passes for the checkpoint-mapping tests."""

from __future__ import annotations

import json
import math
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch

# respond(method, path, body) -> (status, JSON answer); it may sleep to play a slow server
Respond = Callable[[str, str, Any], tuple[int, Any]]


@dataclass
class FakeServer:
    url: str
    requests: list[tuple[str, str, Any]] = field(default_factory=list)  # (method, path, decoded JSON body)
    headers: list[dict[str, str]] = field(default_factory=list)  # each request's headers, in the same order

    def paths(self, method: str = "POST") -> list[str]:
        return [path for m, path, _ in self.requests if m == method]


def _handler(fake: FakeServer, respond: Respond) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _handle(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            fake.requests.append((method, self.path, body))
            fake.headers.append(dict(self.headers))
            status, answer = respond(method, self.path, body)
            data = json.dumps(answer).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout tests)
                pass

        def do_GET(self) -> None:
            self._handle("GET")

        def do_POST(self) -> None:
            self._handle("POST")

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


@pytest.fixture
def fake_server():
    """start(respond) -> FakeServer listening on 127.0.0.1 (a free port), stopped at the end of the test."""
    servers: list[ThreadingHTTPServer] = []

    def start(respond: Respond) -> FakeServer:
        fake = FakeServer(url="")
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake, respond))
        server.daemon_threads = True
        fake.url = f"http://127.0.0.1:{server.server_address[1]}"
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return fake

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def closed_port_url() -> str:
    """http://127.0.0.1:PORT where nothing listens (a port just freed): connections are refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# ---- transformer forward passes written out with plain tensor ops, to check the checkpoint mappings of reward
# models (hps.py, imagereward.py) against the authors' layouts without going through transformers' modules ----


def hand_layer_norm(x, weight, bias, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / (var + eps).sqrt() * weight + bias


def hand_gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))  # exact GELU


def hand_attention(x_q, x_kv, q, k, v, out, heads, additive_mask=None):
    """Multi-head attention; q, k, v, out are (weight, bias) pairs; additive_mask broadcasts to [B, h, Tq, Tk]."""
    batch, t_q, dim = x_q.shape
    head_dim = q[0].shape[0] // heads

    def split(x, wb):
        return (x @ wb[0].T + wb[1]).view(batch, x.shape[1], heads, head_dim).transpose(1, 2)

    scores = split(x_q, q) @ split(x_kv, k).transpose(-1, -2) / math.sqrt(head_dim)
    if additive_mask is not None:
        scores = scores + additive_mask
    mixed = (scores.softmax(-1) @ split(x_kv, v)).transpose(1, 2).reshape(batch, t_q, heads * head_dim)
    return mixed @ out[0].T + out[1]


def hand_prenorm_block(x, p, heads, eps, additive_mask=None):
    """x + attn(LN1(x)), then + MLP(LN2(x)) with a fused qkv (rows q | k | v): CLIP / ViT blocks. `p` holds
    ln1, qkv, proj, ln2, fc1, fc2 as (weight, bias) pairs."""
    qkv_w, qkv_b = p["qkv"]
    (qw, kw, vw), (qb, kb, vb) = qkv_w.chunk(3), qkv_b.chunk(3)
    h = hand_layer_norm(x, *p["ln1"], eps)
    x = x + hand_attention(h, h, (qw, qb), (kw, kb), (vw, vb), p["proj"], heads, additive_mask)
    h = hand_layer_norm(x, *p["ln2"], eps)
    return x + hand_gelu(h @ p["fc1"][0].T + p["fc1"][1]) @ p["fc2"][0].T + p["fc2"][1]


def hand_patches(pixels_BCHW, conv_weight, conv_bias=None):
    """[B, N, W] patch embeddings of a stride = kernel convolution, as a matmul over flattened patches."""
    width, _, patch, _ = conv_weight.shape
    b, c, h, w = pixels_BCHW.shape
    patches = pixels_BCHW.unfold(2, patch, patch).unfold(3, patch, patch)  # [B, C, gh, gw, P, P]
    patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(b, -1, c * patch * patch)
    out = patches @ conv_weight.reshape(width, -1).T
    return out if conv_bias is None else out + conv_bias


@pytest.fixture
def hand():
    """The hand-written forward pieces above."""
    import types

    return types.SimpleNamespace(
        layer_norm=hand_layer_norm,
        gelu=hand_gelu,
        attention=hand_attention,
        prenorm_block=hand_prenorm_block,
        patches=hand_patches,
    )
