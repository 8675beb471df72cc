"""Making a curves file: which pools, at which contexts, from what -- a target, the twin, or the model alone.

* ``--target URL``: the probes against a running endpoint. The user says which pools it stands for (a
  prefill-capable endpoint for ``prefill``, a decode-capable one for ``decode``, one colocated endpoint for both, or
  for ``mixed``) and what one instance is (``--machine-type``, ``--cards-per-instance``, ``--cards-per-machine``):
  nothing in the OpenAI API says how many cards serve it.
* ``--twin``: the probes against the embedded reference server's sim twin of one card (``--model-profile``,
  ``--device-profile``): the prefill and decode pools on a one-prefill-worker, one-decode-worker server that routes
  every prefill to its prefill worker, the mixed pool on a one-worker colocated server. Any card the profiles
  describe, so a heterogeneous purchase is planned without its hardware.
* ``--rapid``: the same card's curves from the roofline alone (:mod:`paasbench.plan.rapid`), no runs.

The contexts: the prefill buckets (``--context-buckets``, else three spanning the traffic's prompt lengths) at the
traffic's hit, and the decode contexts the traffic decodes at (prompt + half the output, three spanning them).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from paasbench.plan.curves import Curves, Instance, PoolCurve
from paasbench.plan.probes import ProbeSettings
from paasbench.plan.sizing import PlanSLO
from paasbench.plan.twin import Card, disaggregated_section, mixed_section

if TYPE_CHECKING:
    from paasbench.plan.probes import Prober


@dataclass
class MeasureSpec:
    mode: str                               # target | twin | rapid
    pools: list[str]
    contexts: list[int]                     # prefill buckets
    hit: float
    decode_contexts: list[int]
    slo: PlanSLO
    out: Path                               # probe steps go under out/
    card: Card | None = None                # twin, rapid
    client: Any = None                      # target: a ClientConfig
    instance: Instance | None = None        # target: what one instance is
    settings: ProbeSettings = field(default_factory=ProbeSettings)
    block_size: int = 512


def loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return None


def measure(spec: MeasureSpec, log: Callable[[str], None] = print) -> Curves:
    """The curves ``spec`` asks for, with what made them."""
    started = time.monotonic()
    load = [loadavg()]
    made_by: dict[str, Any] = {
        "command": "paasbench " + " ".join(sys.argv[1:]) if sys.argv and "paasbench" in os.path.basename(sys.argv[0])
        else None,
        "mode": spec.mode, "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "contexts": spec.contexts, "hit": spec.hit, "decode_contexts": spec.decode_contexts,
        "settings": dataclasses.asdict(spec.settings), "loadavg": load,
        **({"twin": spec.card.to_dict()} if spec.card else {}),
        **({"target": spec.client.target} if spec.client is not None and spec.mode == "target" else {})}
    pools: dict[str, PoolCurve] = {}
    if spec.mode == "rapid":
        from paasbench.plan.rapid import rapid_pool

        assert spec.card is not None
        for name in spec.pools:
            pools[name] = rapid_pool(spec.card, name, spec.contexts, spec.hit, spec.decode_contexts,
                                     spec.settings.decode_output, spec.slo.tpot_s)
    elif spec.mode == "twin":
        assert spec.card is not None
        card = spec.card
        inst = card.instance()
        settings = dataclasses.replace(spec.settings, sim_time_scale=card.sim_time_scale, kv_tokens=inst.kv_tokens,
                                       max_concurrency=min(spec.settings.max_concurrency, card.max_num_seqs))
        wanted = [p for p in ("prefill", "decode") if p in spec.pools]
        if wanted:
            section = disaggregated_section(card, card, 1, 1)
            pools.update(_on_server(section, wanted, spec, settings, inst, log, load))
        if "mixed" in spec.pools:
            pools.update(_on_server(mixed_section(card, "colocated", 1), ["mixed"], spec, settings, inst, log, load))
    else:
        from paasbench.plan.probes import Prober

        assert spec.client is not None and spec.instance is not None
        prober = Prober(spec.client, spec.settings, spec.slo, spec.out, spec.block_size, log)
        for name in spec.pools:
            pools[name] = _probe_pool(prober, name, spec, spec.instance, log, load)
    load.append(loadavg())
    made_by["seconds"] = round(time.monotonic() - started, 1)
    return Curves(made_by=made_by, slo=list(spec.slo.gates), pools=pools)


def _on_server(section: dict[str, Any], pools: list[str], spec: MeasureSpec, settings: ProbeSettings,
               inst: Instance, log: Callable[[str], None], load: list[Any]) -> dict[str, PoolCurve]:
    from paasbench.client import ClientConfig
    from paasbench.plan.probes import Prober
    from paasbench.sweep.embedded import embedded_server

    shown = " ".join(f"{k}={v}" for k, v in section.items())
    log(f"starting the twin: {shown}")
    with embedded_server(section) as server:
        client = ClientConfig(target=server.url, prompt_format="token-ids")
        prober = Prober(client, settings, spec.slo, spec.out, spec.block_size, log)
        return {name: _probe_pool(prober, name, spec, inst, log, load) for name in pools}


def _probe_pool(prober: Prober, name: str, spec: MeasureSpec, inst: Instance, log: Callable[[str], None],
                load: list[Any]) -> PoolCurve:
    log(f"{name} pool:")
    prober.out = spec.out / name
    curve = PoolCurve(inst)
    if name in ("prefill", "mixed"):
        for c in spec.contexts:
            curve.prefill.append(prober.prefill_point(c, spec.hit))
            load.append(loadavg())
    if name == "decode" or (name == "mixed" and spec.mode == "target"):
        for c in spec.decode_contexts:
            curve.decode.append(prober.decode_point(c, _first_streams(spec, c)))
            load.append(loadavg())
    return curve


def _first_streams(spec: MeasureSpec, context: int) -> int:
    """Where the decode probe starts: on the twin, half the streams the roofline says fit the TPOT SLO (rapid
    mode's point), so the doubling brackets the measured edge in a few steps; on a target, one stream."""
    if spec.mode != "twin" or spec.card is None:
        return 1
    from paasbench.plan.rapid import decode_point

    guess = decode_point(spec.card, context, spec.settings.decode_output, spec.slo.tpot_s).max_active
    return max(1, int(guess // 2))
