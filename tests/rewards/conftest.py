"""A scriptable HTTP server on 127.0.0.1 for the network rewards' fault tests (5xx, 4xx, slow answers)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

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
