"""The synthetic-load options, shared by ``run``, ``sweep`` and ``trace gen`` (one spelling, one parser)."""

from __future__ import annotations

from typing import Any, Callable

import click

from paas_common.errors import InputError

F = Callable[..., Any]


def synthetic_options(f: F) -> F:
    """``--isl``, ``--osl``, ``--prefix-tokens``, ``--prefix-hit`` (docs/traces.md, "Synthetic load")."""
    for opt in reversed([
        click.option("--isl", help="Synthetic load, no trace: input tokens per request, e.g. 2048, "
                                   "normal:2048:256, uniform:1024:4096, lognormal:2048:0.5."),
        click.option("--osl", help="Synthetic load: output tokens per request (same forms as --isl)."),
        click.option("--prefix-tokens", type=int, help="Synthetic load: tokens every prompt shares at its start."),
        click.option("--prefix-hit", type=float,
                     help="Synthetic load: size the shared prefix so the trace's prefix hit is this (0-1)."),
    ]):
        f = opt(f)
    return f


def synthetic_from(o: dict[str, Any], *, requests: int, rate: float | None = None,
                   block_size: int | None = None) -> Any:
    """A :class:`~paasbench.workload.synthetic.Synthetic` when ``--isl`` was given, else None (and then no
    other synthetic option may be)."""
    from paasbench.workload.synthetic import Synthetic

    if o.get("isl") is None:
        for key in ("osl", "prefix_tokens", "prefix_hit"):
            if o.get(key) is not None:
                raise InputError("only applies to synthetic load: give --isl too", field="--" + key.replace("_", "-"))
        return None
    if o.get("osl") is None:
        raise InputError("synthetic load needs --osl as well as --isl", field="--osl")
    return Synthetic(isl=o["isl"], osl=o["osl"], requests=requests, prefix_tokens=o.get("prefix_tokens"),
                     prefix_hit=o.get("prefix_hit"), block_size=block_size, rate=rate or 1.0)


def workload_trace(workload: str | None, synth: Any, seed: int | None) -> Any:
    """The trace of a workload (a shipped name or a YAML spec) or of synthetic load (``synth``, from
    :func:`synthetic_from`): what ``run --workload/--isl`` replays and ``trace gen`` writes."""
    if synth:
        from paasbench.workload.synthetic import synthetic_trace

        return synthetic_trace(synth, seed or 0)
    from paasbench.workload import generate_trace, load_workload

    trace = generate_trace(load_workload(workload), seed)  # type: ignore[arg-type]
    trace.meta.setdefault("workload", workload)
    return trace
