"""Did the server see the workload we meant to send? Prompt lengths and prefix hit, checked against the server.

A benchmark's first duty is to run the workload it claims to run. Two things can silently differ on a server
we do not control:

* **Prompt length.** Prompts are sized in ``--tokenizer``; the server counts in its own. With the wrong one a
  "64K" benchmark runs at ~163K (cl100k prompts against a Llama tokenizer: 2.55x), and every figure is
  of another workload. Two checks, one definition (docs/metrics.md, "Workload verification"):

  - *pre-flight* (:mod:`paasbench.load.preflight`): before any load, a few of the run's own prompts go to
    the server's ``/tokenize``; its answer is judged here, at :data:`LENGTH_TOLERANCE`.
  - *usage* (:func:`prompt_length_check`): every request's ``usage.prompt_tokens`` against its intended
    length, less that constant overhead. The overhead is the mode of ``prompt_tokens - intended`` over the
    compared requests, taken only where it cannot be a tokenizer's scaling: held by most of them (at least
    three), of two different intended lengths, or equal to what ``/tokenize`` measured.

* **Prefix hit** (:func:`hit_check`): the server-reported cached share against the hit the sent traffic
  offered (an infinite cache filled by the run's own requests, :func:`sent_traffic_hit`). A cache left warm
  by the previous run, or one too small for the working set, shows as a gap.

* **Host-bound twin** (:func:`host_bound_warning`): against the sim twin, the share of the wall E2E its steps
  ran past their modeled length because the worker's own host time did. Above :data:`HOST_BOUND_WARN` the
  wall-clock figures measure this machine's CPU, not the device the twin models.

* **Arrival clock** (:func:`arrival_warning`): a run that should stamp chunk arrivals with the kernel's receive
  time, some of whose streams were stamped by the event loop's read instead.

``run``, ``sweep`` and the report read the same summary fields and print the same :func:`warnings`.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from paas_common.tokenizer import per_tokenizer
from paasbench.metrics.records import KERNEL_CLOCK
from paasbench.trace.inspect import prefix_hits
from paasbench.trace.model import Trace, TraceRequest

LENGTH_TOLERANCE = 0.02   # |server/intended - 1| beyond this: the run is of another workload
HIT_TOLERANCE = 0.02      # |measured - offered| prefix hit beyond this (2 points): said loudly
MIN_OVERHEAD_SUPPORT = 4  # requests that must share the constant overhead before it is believed ...
MIN_OVERHEAD_SHARE = 0.75  # ... and more than this share of the compared requests
MIN_OVERHEAD_SPREAD = 2   # tokens by which a scaling would have told the longest of them from the shortest
TOKENIZER_FIX = ("pass the server model's own tokenizer with --tokenizer DIR (the directory holding its "
                 "tokenizer.json)")


# ------------------------------------------------------------------------------------------ tokenizer identity

@per_tokenizer(maxsize=8)
def tokenizer_identity(name: str) -> dict[str, str]:
    """What the prompts were sized in, for summary and sweep.json meta: the name as given (a path relative to
    the working directory) and a sha256 of its content (the tokenizer.json file, or a tiktoken encoding's
    ranked token bytes), so two runs can be told apart when a file changed under the same name (also within
    one process: cached by name and file state)."""
    from paas_common.tokenizer import is_hf_path, load_tokenizer

    tok = load_tokenizer(name)
    h = hashlib.sha256()
    if is_hf_path(name):
        path = Path(name)
        file = path / "tokenizer.json" if path.is_dir() else path
        h.update(file.read_bytes())
        shown = os.path.relpath(path) if path.is_absolute() else name
    else:
        enc = tok.raw
        h.update(enc._pat_str.encode())  # noqa: SLF001 - tiktoken keeps its split pattern there
        for token, rank in sorted(enc._mergeable_ranks.items(), key=lambda kv: kv[1]):  # noqa: SLF001
            h.update(rank.to_bytes(4, "little") + len(token).to_bytes(2, "little") + token)
        shown = name
    return {"name": shown, "sha256": h.hexdigest()}


# ------------------------------------------------------------------------------------------------- lengths

def _overhead(intended: np.ndarray, reported: np.ndarray, tokenize_overhead: int | None) -> tuple[int, str]:
    """The server's constant per-request overhead (chat template, BOS) and where it came from: ``usage``,
    ``tokenize`` (the pre-flight's measurement) or ``none`` (0: no constant overhead, e.g. a mismatched
    tokenizer). ``usage`` is the mode of ``reported - intended`` where nothing but a constant explains it:
    it is >= 0, held by at least :data:`MIN_OVERHEAD_SUPPORT` requests and by more than
    :data:`MIN_OVERHEAD_SHARE` of them (a template adds the same tokens to every prompt; a mismatched
    tokenizer's differences scatter), and it is 0, equal to the pre-flight's measurement, or held by requests
    of lengths far enough apart that a scaling through the shortest would give the longest at least
    :data:`MIN_OVERHEAD_SPREAD` more tokens, ``mode * (longest / shortest - 1)`` (a scaling grows with the
    length, a template does not).

    Before, more than half of at least 3 requests, of two different lengths, was taken as proof: of 400 seeded
    groups of 4 prompts of 32-128 tokens counted as characters / 4 (a 1.1x mismatch, whose differences scatter
    by a few tokens), 8 shared a difference that way and were called exact, so a sweep step of 4 requests hid
    its wrong workload; none now (tests/test_verify_workload.py)."""
    diff = reported - intended
    values, counts = np.unique(diff, return_counts=True)
    mode = int(values[int(np.argmax(counts))])
    held = diff == mode
    support = int(held.sum())
    lengths = intended[held]
    spread = mode * (int(lengths.max()) / max(1, int(lengths.min())) - 1)
    constant = support >= MIN_OVERHEAD_SUPPORT and support > MIN_OVERHEAD_SHARE * diff.size and mode >= 0
    if constant and (mode == 0 or mode == tokenize_overhead or spread >= MIN_OVERHEAD_SPREAD):
        return mode, "usage"
    if tokenize_overhead is not None:
        return tokenize_overhead, "tokenize"
    return 0, "none"


def prompt_length_check(intended: Sequence[int], reported: Sequence[float | None],
                        tokenize_overhead: int | None = None) -> dict[str, Any]:
    """``summary.prompt_lengths``: each request's server-reported ``prompt_tokens`` (less the constant
    overhead) against its intended length. ``ratio`` is token-weighted (sum server / sum intended),
    ``exact_share`` the share of requests whose count is exact, ``off`` when the ratio is beyond
    :data:`LENGTH_TOLERANCE`. Requests without ``usage.prompt_tokens`` are counted as ``not_reported``."""
    want = np.asarray(intended, dtype=np.float64)
    got = np.asarray([np.nan if v is None else v for v in reported], dtype=np.float64)
    has = ~np.isnan(got) & (want > 0)
    out: dict[str, Any] = {"compared": int(has.sum()), "not_reported": int((np.isnan(got) & (want > 0)).sum()),
                           "ratio": None, "exact_share": None, "overhead_tokens": None, "overhead_from": None,
                           "off": False}
    if not has.any():
        return out
    want_i, got_i = want[has].astype(np.int64), got[has].astype(np.int64)
    overhead, source = _overhead(want_i, got_i, tokenize_overhead)
    server = got_i - overhead
    ratio = float(server.sum() / want_i.sum())
    out.update(ratio=ratio, exact_share=float(np.mean(server == want_i)), overhead_tokens=overhead,
               overhead_from=source, off=abs(ratio - 1.0) > LENGTH_TOLERANCE)
    return out


def length_text(check: dict[str, Any] | None) -> str:
    """One line for consoles and reports: ``1.000x server/intended, 100% exact of 55 (overhead 7)``."""
    if not check or not check.get("compared"):
        return "not reported by the server"
    over = check.get("overhead_tokens") or 0
    return (f"{check['ratio']:.3f}x server/intended, {check['exact_share']:.0%} exact of {check['compared']}"
            + (f" (less {over} overhead tokens, from {check['overhead_from']})" if over else ""))


def length_warning(check: dict[str, Any] | None, where: str = "") -> str | None:
    """The loud warning for prompts off by more than :data:`LENGTH_TOLERANCE`, naming the fix; None if fine."""
    if not check or not check.get("off"):
        return None
    why = ("" if check.get("overhead_from") != "none" or check["ratio"] < 1.0 else
           " (no constant overhead could be measured: if the server adds a chat template, give prompts of "
           "several lengths or use a server with /tokenize, so that it can be)")
    return (f"PROMPT LENGTHS OFF{where}: the server counted {check['ratio']:.3f}x the intended prompt tokens "
            f"({check['exact_share']:.0%} of {check['compared']} requests exact): this run is NOT the workload "
            f"it names{why}. The server tokenizes differently from --tokenizer: {TOKENIZER_FIX}.")


# --------------------------------------------------------------------------------------------------- hit

def hit_check(measured: float | None, offered: float | None) -> dict[str, Any] | None:
    """``summary.prefix_hit_check``: the server-reported hit against the offered one, in points; None when
    either is unknown."""
    if measured is None or offered is None:
        return None
    gap = measured - offered
    return {"offered": offered, "measured": measured, "gap_points": 100.0 * gap, "off": abs(gap) > HIT_TOLERANCE}


def hit_text(check: dict[str, Any] | None) -> str:
    if not check:
        return "-"
    return f"{check['offered']:.1%} (server {check['gap_points']:+.1f} points)"


def hit_warning(check: dict[str, Any] | None, where: str = "") -> str | None:
    if not check or not check.get("off"):
        return None
    why = ("the server's cache held these prompts before the run (a previous run's prompts?)"
           if check["gap_points"] > 0 else "the server's cache missed what the traffic repeated (too small, "
           "evicted, prefix caching off, or block boundaries that differ)")
    return (f"prefix hit{where}: the server reported {check['measured']:.1%} cached, the traffic offered "
            f"{check['offered']:.1%} ({check['gap_points']:+.1f} points): {why}")


def traffic_hit(requests: Sequence[TraceRequest], in_window: Sequence[bool], block_size: int) -> float | None:
    """Traffic-side prefix hit of the measured requests, as ``trace inspect`` computes it: an infinite
    cache filled by every request sent before (warm-up included, in send order); token-weighted over
    the requests of the window. ``None`` when the window holds no input token."""
    hits, _ = prefix_hits(Trace(list(requests), block_size=block_size))
    tokens = np.array([r.input_length for r in requests], dtype=np.int64)
    mask = np.asarray(in_window, dtype=bool)
    total = int(tokens[mask].sum())
    return float(hits[mask].sum()) / total if total else None


def sent_traffic_hit(trace: Trace, records: Iterable[Any], window: tuple[float, float]) -> float | None:
    """The offered hit of what a run actually sent (:func:`traffic_hit`): an infinite cache filled only by the
    run's own requests (warm-up included, in send order), token-weighted over the window's. Next to the
    server-reported hit it separates "the traffic could not hit more" from "the server's cache missed".
    ``records`` is read once (a records file's stream will do): only each one's send time and index are kept."""
    sent = sorted((r.intended_send_s, n, r.index) for n, r in enumerate(records)   # n: ties keep file order
                  if r.actual_send_s is not None and 0 <= r.index < len(trace))
    return traffic_hit([trace.requests[i] for _, _, i in sent],
                       [window[0] <= t < window[1] for t, _, _ in sent], trace.block_size)


HOST_BOUND_WARN = 0.10     # host-bound share of the wall E2E above which a twin run's wall clock is the host's


def host_bound_warning(share: float | None, where: str = "") -> str | None:
    """The sim twin's steps ran past their modeled length (its worker's host time did) for more than
    :data:`HOST_BOUND_WARN` of the wall E2E: the wall-clock figures measure this host's CPU, not the modeled device."""
    if share is None or share <= HOST_BOUND_WARN:
        return None
    return (f"host-bound twin{where}: {share:.0%} of the wall E2E was the sim's steps running past their modeled "
            "length because the worker's own host time did (a loaded CPU); the wall-clock figures are this "
            "host's, the modeled ones are the twin's (docs/metrics.md, \"Host-bound time\")")


def arrival_warning(seen: dict[str, Any] | None, expected: str | None, where: str = "") -> str | None:
    """The run should have stamped its chunk arrivals with the kernel's receive time (``meta.arrival_clock``)
    and some streams were stamped by the event loop instead (a transport that is not asyncio's own, a socket
    that gave no stamp): their TTFT and ITL include the time the bytes waited for the client."""
    if not seen or not seen.get("requests_loop_stamped") or expected != KERNEL_CLOCK:
        return None
    return (f"arrival clock{where}: {seen['requests_loop_stamped']} of {seen['requests']} streams had reads "
            f"({seen['loop_stamped_reads']} in all) stamped when the event loop took them, not by the kernel's "
            "receive timestamp: their TTFT and ITL include any time the bytes waited for a busy client "
            "(docs/metrics.md, \"chunk arrival\")")


@dataclass(frozen=True, slots=True)
class Finding:
    """One verification warning of one summary: ``kind`` (``lengths``, ``hit``, ``host_bound``, ``arrival``),
    ``short`` (a few words, for a table cell beside its step) and ``text`` (the whole sentence)."""

    kind: str
    short: str
    text: str


def findings(summary: dict[str, Any], where: str = "") -> list[Finding]:
    """Every verification warning of one summary (run or sweep step), with its kind and a short form."""
    out = []
    lengths = summary.get("prompt_lengths") or {}
    text = length_warning(lengths, where)
    if text:
        out.append(Finding("lengths", f"prompt lengths {lengths['ratio']:.3f}x", text))
    hit = summary.get("prefix_hit_check") or {}
    text = hit_warning(hit, where)
    if text:
        out.append(Finding("hit", f"hit {hit['gap_points']:+.1f} pts vs offered", text))
    text = host_bound_warning(summary.get("host_bound_share"), where)
    if text:
        out.append(Finding("host_bound", f"host-bound {summary['host_bound_share']:.0%}", text))
    seen = summary.get("arrival_clock") or {}
    text = arrival_warning(seen, (summary.get("meta") or {}).get("arrival_clock"), where)
    if text:
        out.append(Finding("arrival", f"{seen['requests_loop_stamped']} streams loop-stamped", text))
    return out


def warnings(summary: dict[str, Any], where: str = "") -> list[str]:
    """Every verification warning of one summary (run or sweep step), for console and report alike."""
    return [f.text for f in findings(summary, where)]
