"""A published capacity claim read side by side with what a sweep measured: the white-paper reproduction.

A workload may carry the figures it reproduces (``claim:`` in its YAML: context, input TPM, prefix hit,
P50 TTFT, cards, blended price). At the end of a sweep the claim is set against the measured row at that
context and against the twin's stated assumptions (card memory, FLOPS, MFU/MBU, the model's size: the
embedded server's ``meta.hardware``), and checked for feasibility: do the model's weights, plus the KV floor
the twin keeps, fit the claimed cards at the stated card memory? If not, the comparison says so and what it
would take (the card memory, or the bytes per parameter, at which they fit). The result goes to
``sweep.json`` (``claim``) and the report prints it; nothing here measures anything.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from paas_common.errors import InputError
from paasbench.cost.table import CostInputs, cost_row
from paasbench.report.tables import pct


@dataclass(frozen=True, slots=True)
class Claim:
    source: str                    # who claims it (a document), shown as the column heading
    context_tokens: int
    input_tpm: float               # input (prompt) tokens per minute at that context
    hit_ratio: float
    ttft_p50_ms: float             # the latency bound the capacity was quoted under
    cards: int
    machines: int = 1
    blended_price_per_m: float | None = None
    model: str = ""
    device: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_claim(raw: Any, file: str | None = None) -> Claim | None:
    """``None`` for no claim; an :class:`InputError` naming the field for a bad one."""
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise InputError("must be a mapping (source, context_tokens, input_tpm, ...)", file=file, field="claim")
    known = {f.name: f for f in fields(Claim)}
    for key in raw:
        if key not in known:
            raise InputError(f"unknown key (allowed: {', '.join(known)})", file=file, field=f"claim.{key}")
    for key in ("source", "context_tokens", "input_tpm", "hit_ratio", "ttft_p50_ms", "cards"):
        if key not in raw:
            raise InputError("missing", file=file, field=f"claim.{key}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        kind = known[key].type
        if kind == "str":
            out[key] = str(value)
            continue
        try:
            num = float(value)
        except (TypeError, ValueError):
            raise InputError(f"expected a number, got {value!r}", file=file, field=f"claim.{key}") from None
        if not math.isfinite(num) or num < 0 or (key == "hit_ratio" and num > 1):
            raise InputError(f"out of range: {value!r}", file=file, field=f"claim.{key}")
        out[key] = int(num) if kind == "int" else num
    return Claim(**out)


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:,.0f} ms"


def _tpm(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v / 1e6:.2f}M" if v >= 1e6 else f"{v / 1e3:.1f}K" if v >= 1e3 else f"{v:.0f}"


def feasibility(claim: Claim, hardware: dict[str, Any]) -> dict[str, Any] | None:
    """Do the model's weights plus the twin's KV floor fit the claimed cards at the stated card memory?"""
    from reference_server.sim.roofline import needed_gb_per_card

    dev, mod = hardware.get("device") or {}, hardware.get("model") or {}
    if not dev.get("hbm_gb") or not mod.get("weight_bytes"):
        return None
    floor = float(hardware.get("kv_floor") or 0.0)
    need = needed_gb_per_card(mod["weight_bytes"], claim.cards, floor)
    have = claim.cards * dev["hbm_gb"]
    max_bpp = (1 - floor) * have * 1e9 / mod["weight_params"] if mod.get("weight_params") else None
    fits = need <= dev["hbm_gb"]
    text = (f"{mod.get('name')} at {mod.get('weight_dtype')}: {mod['weight_bytes'] / 1e9:,.0f} GB of weights + a KV floor "
            f"of {floor:.0%} of memory need {need * claim.cards:,.0f} GB; {claim.cards} cards x {dev['hbm_gb']:g} GB "
            f"({dev.get('name')}) = {have:,.0f} GB")
    if fits:
        text += ": the claimed cards hold the model."
    else:
        text += (f": the {claim.cards}-card claim is impossible under these assumptions. It needs >= {need:,.0f} GB "
                 f"per card" + (f", or weights at <= {max_bpp:.2f} bytes per parameter "
                                f"({'4-bit' if max_bpp >= 0.5 else 'below 4-bit'} quantization)" if max_bpp else "")
                 + f"; the twin runs {hardware.get('cards_per_worker')} cards per worker instead.")
    return {"fits": fits, "claim_cards": claim.cards, "hbm_gb": dev["hbm_gb"], "memory_gb": have,
            "weights_gb": mod["weight_bytes"] / 1e9, "kv_floor": floor, "needed_gb_per_card": need,
            "max_weight_bytes_per_param": max_bpp, "text": text}


def assumptions(hardware: dict[str, Any]) -> list[dict[str, str]]:
    """Each figure the twin's capacity rests on, with where to change it."""
    dev, mod = hardware.get("device") or {}, hardware.get("model") or {}
    if not dev:
        return []
    tf = dev.get("tflops") or {}
    workers = hardware.get("workers") or {}
    rows = [
        ("card", f"{dev.get('name')}, {dev.get('cards')} per machine", "--server-arg device_profile=NAME|FILE.yaml"),
        ("card memory", f"{dev.get('hbm_gb'):g} GB", "--server-arg device_set=hbm_gb=141 (YAML: hbm_gb)"),
        ("dense TFLOPS per card (FP8 / BF16)", f"{tf.get('fp8', 0):g} / {tf.get('bf16', 0):g}",
         "device_set=tflops.fp8=900 (YAML: tflops)"),
        ("HBM bandwidth per card", f"{dev.get('hbm_tbps'):g} TB/s", "device_set=hbm_tbps=... (YAML: hbm_tbps)"),
        ("MFU linear / attention, MBU", f"{dev.get('mfu'):g} / {dev.get('attn_mfu') or dev.get('mfu'):g}, {dev.get('mbu'):g}",
         "device_set=mfu=0.5,attn_mfu=0.4,mbu=0.8"),
        ("card-to-card link", f"{dev.get('interconnect_gbps'):g} GB/s per direction",
         "device_set=interconnect_gbps=..."),
        ("model", f"{mod.get('name')}: {mod.get('total_params', 0) / 1e9:,.0f}B total / "
                  f"{mod.get('active_params', 0) / 1e9:,.0f}B active, {mod.get('weight_dtype')} weights "
                  f"({mod.get('weight_bytes', 0) / 1e9:,.0f} GB), KV {mod.get('kv_bytes_per_token', 0):,} B/token",
         "--server-arg model_profile=NAME|FILE.yaml; model_set=total_params=..."),
        ("cards per worker (one model instance)", f"{hardware.get('cards_per_worker')}",
         "--server-arg cards_per_worker=N (default: fewest that hold the weights + KV floor)"),
        ("workers", ", ".join(f"{n} {r}" for r, n in workers.items()), "--server-arg prefill_workers=N / workers=N"),
        ("KV floor kept when sizing an instance", pct(hardware.get("kv_floor")), "reference_server.sim.roofline.KV_FLOOR"),
        ("prefill-worker chunk", f"{hardware.get('prefill_worker_chunk_tokens'):,} tokens (compute-bound)"
         if hardware.get("prefill_worker_chunk_tokens") else "—", "--server-arg prefill_worker_chunk_tokens=N"),
    ]
    return [{"assumption": a, "value": v, "change": c} for a, v, c in rows]


def measured_by(target: str | None, server: dict[str, Any] | None) -> str:
    """What the sweep measured, as the claim table heads its column: the embedded sim server is the twin;
    the embedded cpu server and a ``--target`` are not."""
    if target and target != "embedded":
        return "the target"
    return "this twin" if (server or {}).get("engine") == "sim" else "the embedded cpu server"


def compare(claim: Claim, measured: dict[str, Any] | None, hardware: dict[str, Any] | None,
            inputs: CostInputs, subject: str = "this twin") -> dict[str, Any]:
    """The side-by-side record. ``measured``: the sweep's row at the claim's context (``max_input_tpm``,
    ``hit_ratio``, ``ttft_p50_ms``, ``cards``, ``machines``, ``context_tokens``), or None if none passed.
    ``hardware``: the embedded server's ``meta.hardware`` (None for a ``--target``, whose cards and pools
    paasbench does not know); ``subject``: :func:`measured_by`."""
    known = hardware is not None
    hardware = hardware or {}
    m = measured or {}
    tpm, cards, machines = m.get("max_input_tpm"), m.get("cards"), m.get("machines")
    per = claim.cards
    per_claim = tpm * per / cards if tpm is not None and cards else None
    prefill_cards = (hardware.get("workers") or {}).get("prefill", 0) * (hardware.get("cards_per_worker") or 0)
    per_prefill = tpm * per / prefill_cards if tpm is not None and prefill_cards else None
    hit = m.get("hit_ratio")
    blended = inputs.blended_input_price(hit) if hit is not None else None
    paper_blended = claim.blended_price_per_m if claim.blended_price_per_m is not None \
        else inputs.blended_input_price(claim.hit_ratio)
    twin_row = cost_row(tpm, hit, 0.0, inputs, cards=cards, machines=machines) \
        if tpm is not None and hit is not None else None
    paper_row = cost_row(claim.input_tpm, claim.hit_ratio, 0.0, inputs, cards=claim.cards, machines=claim.machines)
    c = inputs.currency
    rows = [
        ("context", f"{claim.context_tokens // 1024}K", f"{m['context_tokens'] // 1024}K bucket"
         if m.get("context_tokens") else "—", "the bucket: contexts 75-100% of it"),
        ("max input TPM under the SLO", _tpm(claim.input_tpm), _tpm(tpm), f"on {cards} cards" if cards else ""),
        *_interval_row(m, tpm),
        (f"input TPM per {per} cards", _tpm(claim.input_tpm * per / claim.cards), _tpm(per_claim),
         f"scaled: TPM x {per} / {cards}" if cards else ""),
        ("input TPM per card", _tpm(claim.input_tpm / claim.cards), _tpm(tpm / cards if tpm is not None and cards else None), ""),
        (f"input TPM per {per} prefill-pool cards", _tpm(claim.input_tpm * per / claim.cards), _tpm(per_prefill),
         f"PaaS view: decode cards not counted; {pct(m.get('remote_prefill_share'))} of prefills ran remote"
         if per_prefill is not None else "no prefill pool (not disaggregated)" if known
         else "not known: the target does not report its prefill pool's cards"),
        ("prefix hit", pct(claim.hit_ratio), pct(hit), "server-reported cached / prompt tokens"),
        ("P50 TTFT", f"<= {_ms(claim.ttft_p50_ms)}", _ms(m.get("ttft_p50_ms")), "at the best step"),
        ("cards (machines)", f"{claim.cards} ({claim.machines})", f"{cards} ({machines})" if cards else "—",
         "all workers' instances, packed onto machines"),
        (f"blended price {c}/M", f"{paper_blended:.2f}", "—" if blended is None else f"{blended:.2f}",
         "hit x cached price + (1 - hit) x input price"),
        (f"cost {c}/M input tokens", f"{paper_row.cost_per_m_tokens:.3f}" if paper_row.cost_per_m_tokens else "—",
         f"{twin_row.cost_per_m_tokens:.3f}" if twin_row and twin_row.cost_per_m_tokens else "—",
         "machines used x the cost inputs' machine"),
    ]
    return {"claim": claim.to_dict(), "measured": measured, "measured_by": subject,
            "twin_tpm_per_claim_cards": per_claim,
            "twin_tpm_per_claim_prefill_cards": per_prefill,
            "rows": [{"figure": a, "claim": b, "twin": t, "note": n} for a, b, t, n in rows],
            "assumptions": assumptions(hardware), "feasibility": feasibility(claim, hardware)}


def _interval_row(measured: dict[str, Any], tpm: float | None) -> list[tuple[str, str, str, str]]:
    """A certified sweep's row beside the max: its capacity interval (``buckets[].certified``) in input TPM, so the
    claim is read against the interval, not the pass alone (the 64K pass of the default white-paper sweep read
    7.86M where its interval's lower end was 11% lower). Input TPM at the interval's ends is the pass's TPM per unit
    of load times the end: the same mix of requests at another rate. No row for a point sweep."""
    from paasbench.report.best import capacity_interval, interval_text

    cert = measured.get("certified") or {}
    passed = (cert.get("pass") or {}).get("load")
    if tpm is None or not passed:
        return []
    lo, hi = capacity_interval(cert)
    unit = (measured.get("load") or {}).get("unit", "")
    finite = math.isfinite(hi)
    span = f"[{_tpm(tpm * lo / passed)}, {_tpm(tpm * hi / passed)})" if finite else f">= {_tpm(tpm * lo / passed)}"
    note = f"at {cert.get('confidence', 0):g}: {interval_text(cert, unit)}, the max at {passed:g} {unit}; " \
        "TPM scaled by the load"
    return [("certified capacity interval", "—", span, note)]
