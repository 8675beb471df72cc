"""The one Prometheus text-exposition parser: the harness reads targets' ``/metrics`` with it
(:mod:`paasbench.metrics.prometheus`), the reference server reads and passes through its vLLM instances' with
it (:mod:`reference_server.vllm_worker`). It lives below both because the server may not import the harness.

Prometheus 0.0.4 text, and the OpenMetrics subset servers actually emit: label values are quoted strings
read character by character, so a ``}``, ``,`` or escaped quote inside one is part of the value, never the
end of the label set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: Labels                  # sorted by key
    value: float

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


@dataclass(frozen=True, slots=True)
class SampleLine:
    """One sample line as written: its labels in their order and its value's own text (for passing it on)."""

    name: str
    labels: list[tuple[str, str]]
    value_text: str


class ParseError(ValueError):
    pass


def parse(text: str) -> list[Sample]:
    """Parse Prometheus text format. Comments/HELP/TYPE/EOF lines are skipped; a malformed sample line
    raises :class:`ParseError` naming the line, so a broken exporter is not silently read as zeros."""
    out: list[Sample] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            s = parse_line(line)
            out.append(Sample(s.name, tuple(sorted(s.labels)), parse_value(s.value_text)))
        except (ValueError, IndexError) as exc:
            raise ParseError(f"/metrics line {lineno}: {exc}: {raw[:120]!r}") from None
    return out


def totals(samples: list[Sample]) -> dict[str, float]:
    """Metric name -> the sum over its series (``_total``, ``_sum``, ``_count`` kept as the exporter names them)."""
    out: dict[str, float] = {}
    for s in samples:
        out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def parse_line(line: str) -> SampleLine:
    """One (stripped, non-comment) sample line; ValueError/IndexError when it is malformed. A trailing
    timestamp is dropped: scrapes are stamped by whoever reads them."""
    i, n = 0, len(line)
    while i < n and (line[i].isalnum() or line[i] in "_:"):
        i += 1
    name = line[:i]
    if not name or name[0].isdigit():
        raise ValueError("bad metric name")
    labels: list[tuple[str, str]] = []
    if i < n and line[i] == "{":
        i, labels = _parse_labels(line, i + 1)
    rest = line[i:].split()
    if not rest:
        raise ValueError("missing value")
    parse_value(rest[0])
    return SampleLine(name, labels, rest[0])


def format_line(name: str, labels: list[tuple[str, str]], value_text: str) -> str:
    """A sample line: the inverse of :func:`parse_line` (label values escaped as the format asks)."""
    if not labels:
        return f"{name} {value_text}"
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return f"{name}{{{inner}}} {value_text}"


def parse_value(token: str) -> float:
    low = token.lower()
    if low in ("+inf", "inf"):
        return math.inf
    if low == "-inf":
        return -math.inf
    if low == "nan":
        return math.nan
    return float(token)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _parse_labels(line: str, i: int) -> tuple[int, list[tuple[str, str]]]:
    labels: list[tuple[str, str]] = []
    n = len(line)
    while True:
        while i < n and line[i] in " ,":
            i += 1
        if i >= n:
            raise ValueError("unterminated label set")
        if line[i] == "}":
            return i + 1, labels
        eq = line.index("=", i)
        key = line[i:eq].strip()
        i = eq + 1
        if line[i] != '"':
            raise ValueError(f"label {key!r} value is not quoted")
        i += 1
        buf: list[str] = []
        while line[i] != '"':
            ch = line[i]
            if ch == "\\":
                nxt = line[i + 1]
                buf.append({"n": "\n", "\\": "\\", '"': '"'}.get(nxt, "\\" + nxt))
                i += 2
            else:
                buf.append(ch)
                i += 1
        labels.append((key, "".join(buf)))
        i += 1
