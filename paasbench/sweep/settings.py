"""A sweep's configuration, from the command's options: where the requests come from, the SLO it is judged by,
the search and step settings, the embedded server, the client, and what identifies the sweep for ``--resume``.

Settings come from, in order of precedence: the command line, the workload's ``sweep:`` section, the
defaults below. Algorithm and outputs: docs/sweep.md.
"""

from __future__ import annotations

import platform
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paas_common.errors import InputError, input_errors
from paasbench import __version__

SYNTHETIC_REQUESTS = 256  # the smallest synthetic trace a step gets (steps that need more regenerate it bigger)
DEFAULTS: dict[str, Any] = {
    "axis": "rate", "start": 0.5, "factor": 2.0, "max_steps": 6, "step_duration_s": 20.0, "warmup_s": 5.0,
    "bisect_steps": 3, "descend_steps": 2, "time_budget_s": 1800.0, "window_requests": 0,
    # certified step verdicts (sweep/sequential.py), opt-in for now: 0 is point verdicts on fixed-length steps,
    # no verification (docs/sweep.md says why the default has not moved yet)
    "confidence": 0.0, "verify_for": 5.0,
    # the throughput probe's closed loops (sweep/probe.py); None: PROBE_STREAMS for a certified sweep, else none
    "probe_streams": None,
}
DEFAULT_ERROR_GATE = "error_rate <= 1%"   # added to every sweep SLO that has no error_rate gate of its own
# workload ``sweep:`` keys -> DEFAULTS keys (the spec may use the CLI spelling too)
SPEC_KEYS = {"axis": "axis", "start": "start", "factor": "factor", "max_steps": "max_steps",
             "step_duration_s": "step_duration_s", "step_duration": "step_duration_s", "duration_s": "step_duration_s",
             "warmup_s": "warmup_s",
             "warmup": "warmup_s", "bisect_steps": "bisect_steps", "descend_steps": "descend_steps",
             "time_budget_s": "time_budget_s", "time_budget": "time_budget_s", "window_requests": "window_requests",
             "confidence": "confidence", "verify_for": "verify_for", "probe_streams": "probe_streams"}


@dataclass(slots=True)
class SweepSetup:
    source: Any                  # paasbench.sweep.source.Source
    gates: list[Any]             # slo.Gate, with the default error gate added
    settings: dict[str, Any]     # resolve_settings()
    config: Any                  # paasbench.sweep.driver.SweepConfig
    identity: dict[str, Any]     # what --resume must find unchanged in sweep.json
    meta: dict[str, Any]         # sweep.json meta
    slo: list[str]               # the gates as written: re-parseable by the report and by --resume


def sweep_setup(opts: dict[str, Any], synth: Any) -> SweepSetup:
    """The sweep the options describe (``synth``: the synthetic-load spec of --isl/--osl, or None). Raises
    ``InputError`` naming the option or the workload field at fault."""
    # Imports here: `paasbench sweep --help` must not pay for numpy/aiohttp.
    from paas_common.tokenizer import DEFAULT_TOKENIZER, load_tokenizer
    from paasbench.cost.table import load_cost_inputs
    from paasbench.metrics.slo import parse_gates
    from paasbench.metrics.verify import tokenizer_identity
    from paasbench.sweep.driver import SweepConfig
    from paasbench.sweep.embedded import embedded_block_size, parse_server_args, section_hardware, server_section
    from paasbench.sweep.search import SearchConfig
    from paasbench.sweep.sequential import CertifyConfig
    from paasbench.sweep.source import Source, parse_buckets
    from paasbench.sweep.step import StepPlan

    opts.setdefault("tokenizer", DEFAULT_TOKENIZER)
    load_tokenizer(opts["tokenizer"])  # a bad --tokenizer is an input error before the server starts
    synthetic: dict[str, Any] | None = None
    if synth:
        import dataclasses

        from paasbench.workload.synthetic import synthetic_meta, synthetic_spec

        spec = synthetic_spec(synth, opts["seed"] or 0)
        if not opts["target"] and synth.block_size is None:
            # the embedded server's own blocks, as a --target's are asked for: one block size, the server's
            given = opts.get("context_buckets") or ""
            buckets = [] if given.strip().lower() in ("", "none", "0") else parse_buckets(given)
            synth = dataclasses.replace(synth, block_size=embedded_block_size(
                parse_server_args(opts.get("server_args") or ()), max(buckets or [spec.cap_tokens])),
                block_size_source="the embedded server's block_size")
            spec = synthetic_spec(synth, opts["seed"] or 0)
        source = Source(name=spec.name, spec=spec, seed=spec.seed)
        # run's trace, made the same way, and the first one the steps replay (the source keeps it): the prefix
        # hit its blocks can carry is checked, reshaping recorded
        hit = source.trace_for(None, requests=spec.sessions).meta["hit_ratio_tokens"]
        synthetic = {"synthetic": synthetic_meta(synth, spec, hit, spec.seed)["synthetic"], "hit_ratio_tokens": hit}
    else:
        source = (Source.from_workload(opts["workload"], opts["seed"]) if opts["workload"]
                  else Source.from_trace(opts["trace_path"], opts["seed"], tokenizer=opts["tokenizer"],
                                         block_size=opts.get("block_size")))
    if opts["slo_file"]:
        gates = parse_gates(Path(opts["slo_file"])) + parse_gates(list(opts["slo_exprs"]))
    elif opts["slo_exprs"]:
        gates = parse_gates(list(opts["slo_exprs"]))
    else:
        gates = parse_gates(source.slo)
    if not gates:
        raise InputError("no SLO: give --slo/--slo-file, or use a workload with an 'slo' section", field="--slo")
    if not any(g.key == "error_rate" for g in gates):
        # latency gates see successful requests only: without an error gate, a target answering every
        # second request with 503 passes `p50(ttft) <= 6000ms`
        gates = gates + parse_gates([DEFAULT_ERROR_GATE])

    settings = resolve_settings(opts, source.sweep_defaults, source.name)
    with input_errors("sweep"):
        search = SearchConfig(start=settings["start"], factor=settings["factor"], max_steps=settings["max_steps"],
                              bisect_steps=settings["bisect_steps"], descend_steps=settings["descend_steps"],
                              integer=settings["axis"] == "concurrency",
                              plateau_gain=0.05 if settings["axis"] == "concurrency" else 0.0)
    if settings["step_duration_s"] <= 0 or settings["warmup_s"] < 0 or settings["time_budget_s"] <= 0:
        raise InputError("step duration and time budget must be > 0, warm-up >= 0", field="sweep")
    if settings["window_requests"] < 0:
        raise InputError(f"must be >= 0, got {settings['window_requests']}", field="--window-requests")
    if opts["context_buckets"] is None:
        buckets = source.context_buckets
    elif opts["context_buckets"].strip().lower() in ("none", "0", ""):
        buckets = []
    else:
        buckets = parse_buckets(opts["context_buckets"])
    values = [v.strip() for v in (opts["param_values"] or "").split(",") if v.strip()]
    section = server_section({**source.server, **parse_server_args(opts["server_args"])},
                             max(buckets or [source.max_context_tokens()]))
    cfg = SweepConfig(
        out=Path(opts["out"]), target=opts["target"], search=search,
        plan=StepPlan(axis=settings["axis"], warmup_s=settings["warmup_s"], duration_s=settings["step_duration_s"],
                      seed=source.seed, window_requests=settings["window_requests"]),
        client=step_client(opts, settings, section),
        time_budget_s=settings["time_budget_s"], server_section=section, server_param=opts["server_param"],
        param_values=values, buckets=buckets, cost_inputs=load_cost_inputs(opts["cost_file"]),
        allow_length_mismatch=bool(opts.get("allow_length_mismatch")),
        start_given=opts.get("start") is not None,
        certify=CertifyConfig(confidence=settings["confidence"]) if settings["confidence"] else None,
        verify_for=settings["verify_for"],
        probe_streams=settings["probe_streams"],
    )
    if source.trace is None or any(r.prompt is None for r in source.trace.requests):
        from paasbench.load.prompts import check_prompts

        # a tokenizer no prompt can be built in, ids the model cannot embed: exit 2 before the first step
        check_prompts(cfg.client.tokenizer, cfg.client.prompt_format)
    from paasbench.gate.fingerprint import describe as describe_machine  # the sweep's machine, for the gate
    slo = [g.source for g in gates]
    identity = {"source": source.name, "seed": source.seed, "axis": settings["axis"], "start": settings["start"],
                "factor": settings["factor"], "warmup_s": settings["warmup_s"],
                "step_duration_s": settings["step_duration_s"], "window_requests": settings["window_requests"],
                "confidence": settings["confidence"], "verify_for": settings["verify_for"],
                "probe_streams": settings["probe_streams"], "slo": slo, "buckets": buckets,
                "server_param": opts["server_param"], "values": values, "target": opts["target"],
                "server": section if not opts["target"] else None,
                # what the requests ask for beyond the load (sampling, chat template): a resume keeps it
                "extra_body": cfg.client.extra_body}
    meta = {"target": opts["target"] or "embedded", "workload": source.name, "seed": source.seed,
            "server": section if not opts["target"] else None,
            "hardware": section_hardware(section) if not opts["target"] else None,
            **({"model": opts["model"]} if opts["model"] else {}),   # else each step's run says the target's
            "axis": settings["axis"],
            "load_kind": settings["axis"], "settings": settings, "prompt_format": cfg.client.prompt_format,
            "prompt_salt": f"{cfg.client.prompt_salt:016x}",
            "tokenizer": tokenizer_identity(cfg.client.tokenizer),
            "versions": {"paasbench": __version__, "python": platform.python_version()},
            "machine": describe_machine().to_json(), **(synthetic or {})}
    return SweepSetup(source, gates, settings, cfg, identity, meta, slo)


def step_client(opts: dict[str, Any], settings: dict[str, Any], section: dict[str, Any]) -> Any:
    """Client settings for every step. Timeouts are bounded by the step length, so one stalled request
    cannot stretch a step (or the time budget) by the client's 10-30 minute defaults: a request that
    gets no first token within max(30 s, warm-up + duration) has failed at this load anyway."""
    from paas_common.tokenizer import DEFAULT_TOKENIZER
    from paasbench.client import ClientConfig
    from paasbench.client.config import extra_body_from, headers_from
    from paasbench.sweep.step import step_timeouts

    fmt = opts["prompt_format"]
    if fmt == "auto":
        twin = not opts["target"] and section.get("engine") == "sim"
        fmt = "token-ids" if twin and opts["api"] in (None, "completions") else "text"
    salt = opts.get("prompt_salt")
    client = ClientConfig(target=opts["target"] or "http://unset", api=opts["api"], model=opts["model"],
                          api_key=opts["api_key"], headers=headers_from(opts.get("header") or ()),
                          extra_body=extra_body_from(opts.get("extra_body")), prompt_format=fmt,
                          tokenizer=opts.get("tokenizer") or DEFAULT_TOKENIZER,
                          prompt_salt=secrets.randbits(64) if salt is None else salt,  # one per sweep
                          **step_timeouts(settings["warmup_s"] + settings["step_duration_s"]))
    client.validate()
    return client


def resolve_settings(opts: dict[str, Any], spec_sweep: dict[str, Any], source: str) -> dict[str, Any]:
    settings = dict(DEFAULTS)
    for key, value in spec_sweep.items():
        if key not in SPEC_KEYS:
            raise InputError(f"unknown sweep setting (known: {', '.join(sorted(SPEC_KEYS))})",
                             file=source, field=f"sweep.{key}")
        settings[SPEC_KEYS[key]] = value
    cli = {"axis": "axis", "start": "start", "factor": "factor", "max_steps": "max_steps",
           "step_duration": "step_duration_s", "warmup": "warmup_s", "bisect_steps": "bisect_steps",
           "time_budget": "time_budget_s", "window_requests": "window_requests", "confidence": "confidence",
           "verify_for": "verify_for", "probe_streams": "probe_streams"}
    for opt, key in cli.items():
        if opts.get(opt) is not None:
            settings[key] = opts[opt]
    if settings["axis"] not in ("rate", "concurrency", "session-rate"):
        raise InputError(f"axis must be rate, concurrency or session-rate, got {settings['axis']!r}",
                         file=source, field="sweep.axis")
    for key in ("start", "factor", "step_duration_s", "warmup_s", "time_budget_s", "confidence", "verify_for"):
        if not isinstance(settings[key], (int, float)) or isinstance(settings[key], bool):
            raise InputError(f"must be a number, got {settings[key]!r}", file=source, field=f"sweep.{key}")
        settings[key] = float(settings[key])
    for key in ("max_steps", "bisect_steps", "descend_steps", "window_requests"):
        if not isinstance(settings[key], int) or isinstance(settings[key], bool):
            raise InputError(f"must be an integer, got {settings[key]!r}", file=source, field=f"sweep.{key}")
    if not (settings["confidence"] == 0 or 0.5 <= settings["confidence"] < 1):
        raise InputError(f"must be 0 (point verdicts) or in [0.5, 1), got {settings['confidence']:g}",
                         file=source, field="sweep.confidence")
    if settings["probe_streams"] is None:
        from paasbench.sweep.probe import PROBE_STREAMS

        settings["probe_streams"] = PROBE_STREAMS if settings["confidence"] else 0
    if not isinstance(settings["probe_streams"], int) or isinstance(settings["probe_streams"], bool) \
            or settings["probe_streams"] < 0:
        raise InputError(f"must be a whole number >= 0, got {settings['probe_streams']!r}", file=source,
                         field="sweep.probe_streams")
    if settings["verify_for"] < 0:
        raise InputError(f"must be >= 0, got {settings['verify_for']:g}", file=source, field="sweep.verify_for")
    return settings
