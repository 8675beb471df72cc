"""A minimal blocking OpenAI-SSE client for the reference-server tests (stdlib only, so the tests check
the server against the wire format rather than against our own harness client)."""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Streamed:
    status: int
    headers: dict[str, str]
    events: list[dict[str, Any]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)      # arrival of each token-carrying event (since send)
    done: bool = False
    text: str = ""
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    body: str = ""
    t_send: float = 0.0                                    # time.perf_counter() at send (a common clock)

    @property
    def ttft(self) -> float:
        return self.times[0]

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]

    def itls_between(self, start: float, end: float) -> list[float]:
        """Inter-token gaps whose later token arrived in ``[start, end]`` (perf_counter clock)."""
        return [b - a for a, b in zip(self.times, self.times[1:]) if start <= self.t_send + b <= end]


def _conn(url: str) -> tuple[http.client.HTTPConnection, str]:
    u = urllib.parse.urlsplit(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=120), u.path.rstrip("/")


def post(url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any], dict[str, str]]:
    conn, base = _conn(url)
    conn.request("POST", base + path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    data = r.read().decode()
    conn.close()
    return r.status, (json.loads(data) if data else {}), dict(r.getheaders())


def get(url: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    conn, base = _conn(url)
    conn.request("GET", base + path, headers=headers or {})
    r = conn.getresponse()
    data = r.read().decode()
    conn.close()
    return r.status, data


def stream(url: str, body: dict[str, Any], path: str = "/v1/completions", headers: dict[str, str] | None = None,
           on_event=None) -> Streamed:
    conn, base = _conn(url)
    body = {"stream": True, "stream_options": {"include_usage": True}, **body}
    t0 = time.perf_counter()
    conn.request("POST", base + path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    out = Streamed(r.status, dict(r.getheaders()), t_send=t0)
    if r.status != 200:
        out.body = r.read().decode()
        conn.close()
        return out
    texts = []
    while True:
        line = r.fp.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        payload = line[6:]
        if payload == b"[DONE]":
            out.done = True
            break
        ev = json.loads(payload)
        out.events.append(ev)
        for ch in ev.get("choices", []):
            piece = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
            if ch.get("finish_reason") is None:
                out.times.append(time.perf_counter() - t0)
            texts.append(piece or "")
        if ev.get("usage"):
            out.usage = ev["usage"]
        if ev.get("paasbench_timings"):
            out.timings = ev["paasbench_timings"]
        if on_event is not None:
            on_event(out)
    out.text = "".join(texts)
    conn.close()
    return out


def metric(text: str, name: str, labels: str = "") -> float:
    """Value of one Prometheus sample, e.g. ``metric(body, "paasbench_pool_utilization", 'pool="decode"')``."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    raise KeyError(key)
