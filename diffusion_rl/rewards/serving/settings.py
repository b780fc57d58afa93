"""The reward server's settings (no web-stack imports: the CLI builds these before FastAPI is needed)."""

from __future__ import annotations

from dataclasses import dataclass, field

from diffusion_rl.rewards.serving.requests import Limits


@dataclass(frozen=True)
class ServerSettings:
    limits: Limits = field(default_factory=Limits)
    token: str | None = None  # bearer token required on /score and /metrics; None = no auth
    read_timeout_s: float = 30.0  # a connection's whole request must arrive within this
    request_timeout_s: float = 600.0  # 504 when scoring takes longer
    max_connections: int = 128  # authenticated /score requests read or scored at once: 503 beyond
    max_open_connections: int = 1024  # open sockets; beyond, the oldest with no request in progress is closed
