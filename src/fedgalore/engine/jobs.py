"""A client's job and its result: all that crosses a process boundary (integers and serialised
payloads; :mod:`fedgalore.engine.runtime`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from fedgalore.protocol.payload import Payload

__all__ = ["ClientJob", "ClientResult"]


@dataclass
class ClientJob:
    """One client's training in round ``round``, with the round seed s_k it was broadcast."""

    round: int
    total_rounds: int
    client: int
    round_seed: int


@dataclass
class ClientResult:
    """What came back from a client: its serialised upload, or why there is none."""

    client: int
    upload: bytes | Payload | None  # serialised Payload (a transferred one in process), None on failure
    error: str | None = None
    time: float = 0.0
    stats: dict = field(default_factory=dict)
    #: who wrote ``error``: ``"client"`` (the site's own text, as the server view lets it leave) or ``"server"``
    #: (the server's or the backend's own decision: a timeout, a rejection, no reply). Structural: the server never
    #: reads the origin from the text (fedgalore.privacy.view.ServerView.error)
    origin: str = "server"
