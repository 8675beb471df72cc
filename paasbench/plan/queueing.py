"""The queueing headroom a latency percentile needs: how far below 100% busy a pool must run for its SLO to hold.

Two pools, two models, each chosen for what its instances do with a request.

**Prefill: M/G/c, Erlang C with the Allen-Cunneen correction.** A prefill instance works on one prompt at a time in
arrival order (the reference server's prefill worker fills each step with the oldest prompts' chunks; vLLM and
SGLang schedule prefills first-come too), and the router sends a prompt to the instance that will start it soonest
(the reference server's cost rule routes by the work each instance has queued; least work left is the same system
as one shared FIFO queue in front of ``c`` servers). Arrivals are Poisson: many independent sessions, each sending
rarely. That is M/G/c. Its waiting time has no closed form; the standard approximation (Allen-Cunneen, the form
Whitt 1993 gives for M/G/c) keeps M/M/c's probability of waiting, Erlang C ``C(c, a)`` at offered load
``a = lambda E[S]``, and scales the mean wait of those who wait by ``(1 + C_s^2) / 2``, the squared coefficient of
variation of the service time, exact for c = 1 (Pollaczek-Khinchine) and for exponential service:

    P(W > 0) = C(c, a),      W | W > 0  ~  Exp(mean = (1 + C_s^2) / 2 * E[S] / (c (1 - rho))),   rho = a / c.

The exponential tail of the waiting time is exact for M/M/c and the heavy-traffic limit of M/G/c; at low load it
over-states the tail of short waits a little, which errs on the side of more instances. A request's TTFT is its wait
plus its own time with no queue (``base``: its prefill plus the fixed part -- KV transfer, the first decode step,
HTTP), so the TTFT distribution of a mix of requests is ``F(t) = mean_i P(W <= t - base_i)`` and its percentile is
found by bisection (:func:`ttft_quantile`). A router that splits prompts at random or round-robin is instead ``c``
separate M/G/1 queues at ``lambda / c`` (``shared=False``), which needs more headroom.

**Decode: M/G/infinity occupancy, sized at a quantile.** A decoding stream holds its place in a batch from its first
token to its last; a decode instance keeps up to ``B*`` streams at a time within the TPOT SLO (the decode curve).
With Poisson arrivals the streams in flight form an M/G/infinity system: their number is Poisson with mean
``L = lambda E[duration]`` (Little's law), whatever the duration distribution. A stream at context ``x`` takes
``1 / B*(x)`` of an instance, so the instances busy are a compound Poisson sum with mean ``lambda E[d / B*]`` and
variance ``lambda E[(d / B*)^2]``; the pool is sized at its ``q`` quantile, by the normal approximation
``mean + z_q sd`` (:func:`occupancy_quantile`): at that quantile of time every stream has its batch place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

_NORMAL = NormalDist()   # not scipy.stats: its import alone took 8 s of rapid mode's 17 on this box (load 11)


def erlang_c(c: int, a: float) -> float:
    """Probability that an arrival waits in M/M/c with offered load ``a = lambda E[S]`` (``a < c``); through Erlang
    B's recursion, stable for any ``c``: ``B_0 = 1, B_k = a B_{k-1} / (k + a B_{k-1})``, ``C = B / (1 - rho (1 - B))``."""
    if c < 1:
        raise ValueError(f"c must be >= 1, got {c}")
    if a <= 0:
        return 0.0
    if a >= c:
        return 1.0
    b = 1.0
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    rho = a / c
    return b / (1.0 - rho * (1.0 - b))


@dataclass(frozen=True, slots=True)
class Wait:
    """The waiting time before service: 0 with probability ``1 - p_wait``, else exponential of mean ``mean_s``."""

    p_wait: float
    mean_s: float       # mean wait of the requests that wait
    rho: float          # utilization of each server

    def cdf(self, t: np.ndarray) -> np.ndarray:
        t = np.asarray(t, dtype=float)
        waited = 1.0 - self.p_wait * np.exp(-np.maximum(t, 0.0) / self.mean_s) if self.mean_s > 0 else 1.0
        return np.where(t < 0, 0.0, waited)


def mgc_wait(c: int, rate: float, mean_s: float, scv: float, *, shared: bool = True) -> Wait | None:
    """The Allen-Cunneen waiting time of M/G/c (module docstring) at ``rate`` arrivals/s of mean service ``mean_s`` s
    and squared coefficient of variation ``scv``; None when ``rho >= 1`` (the queue grows without bound).
    ``shared=False``: ``c`` separate M/G/1 queues at ``rate / c`` each (random or round-robin dispatch)."""
    if not shared:
        return mgc_wait(1, rate / c, mean_s, scv)
    rho = rate * mean_s / c
    if rho >= 1.0:
        return None
    if rho <= 0.0:
        return Wait(0.0, 0.0, 0.0)
    return Wait(erlang_c(c, rate * mean_s), (1.0 + scv) / 2.0 * mean_s / (c * (1.0 - rho)), rho)


def ttft_quantile(wait: Wait | None, base_s: np.ndarray, q: float) -> float:
    """The ``q`` quantile of ``W + base`` over a mix of requests (``base_s``: each request's TTFT with no queue),
    W independent of which request it is; ``inf`` for an unstable queue."""
    if wait is None:
        return math.inf
    base = np.sort(np.asarray(base_s, dtype=float))
    if wait.p_wait <= 0 or wait.mean_s <= 0:
        return float(np.quantile(base, q))

    def cdf(t: float) -> float:
        return float(np.mean(wait.cdf(t - base)))

    lo, hi = float(base[0]), float(base[-1]) + wait.mean_s * max(1.0, math.log(max(wait.p_wait, 1e-12) / max(1e-12, 1 - q)))
    while cdf(hi) < q:
        hi *= 2
    for _ in range(80):
        mid = (lo + hi) / 2
        if cdf(mid) < q:
            lo = mid
        else:
            hi = mid
    return hi


def occupancy_quantile(mean: float, var: float, q: float) -> float:
    """The ``q`` quantile of a compound Poisson occupancy of ``mean`` and ``var``, by the normal approximation."""
    return mean + _NORMAL.inv_cdf(q) * math.sqrt(max(var, 0.0))


def max_rate_for_occupancy(per_rate_mean: float, per_rate_var: float, q: float, servers: float) -> float:
    """The largest arrival rate whose occupancy quantile fits ``servers``: mean and variance grow linearly with the
    rate, so ``lambda m + z sqrt(lambda v) = servers`` is a quadratic in ``sqrt(lambda)``."""
    if per_rate_mean <= 0:
        return math.inf
    z = _NORMAL.inv_cdf(q)
    b = z * math.sqrt(max(per_rate_var, 0.0))
    root = (-b + math.sqrt(b * b + 4 * per_rate_mean * servers)) / (2 * per_rate_mean)
    return max(0.0, root) ** 2
