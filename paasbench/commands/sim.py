"""``paasbench kv-size`` and ``paasbench calibrate``: the hardware twin's KV estimator
(:func:`reference_server.sim.roofline.kv_footprint`) and its fit to this machine's real engine
(:mod:`reference_server.sim.calibrate`)."""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

import click

from paas_common.errors import input_errors
from reference_server.sim.profiles import (DTYPE_BYTES, device_profile_names, load_device_profile, load_model_profile,
                                           model_profile_names)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:,.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:,.2f} MB" if nbytes >= 1e5 else f"{nbytes:,.0f} B"


@click.command("kv-size")
@click.option("--model-profile", "model_name", required=True,
              help=f"bundled model profile ({', '.join(model_profile_names())}) or a YAML path")
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16", "fp8"]), default=None,
              help="KV cache dtype (default: the profile's)")
@click.option("--context", type=click.IntRange(min=1), default=131072, show_default=True,
              help="tokens per request")
@click.option("--device-profile", "device_name", default=None,
              help=f"also report how many such requests fit in one instance's memory ({', '.join(device_profile_names())})")
@click.option("--cards-per-worker", "cards", type=click.IntRange(min=1), default=None,
              help="cards of one instance (default: the fewest that hold the weights + the KV floor)")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def kv_size(model_name: str, dtype: str | None, context: int, device_name: str | None, cards: int | None,
            as_json: bool) -> None:
    """KV cache bytes per token and per request (article §6.4 estimator; GQA and MLA aware).

    GQA/MHA: 2 (K and V) x layers x kv_heads x head_dim x dtype bytes per token.
    MLA: layers x (kv_lora_rank + rope dim) x dtype bytes (+ the sparse-attention indexer keys).
    """
    from reference_server.sim.roofline import kv_footprint

    m = load_model_profile(model_name)
    dtype = dtype or m.kv_dtype
    out = kv_footprint(m, dtype, context, load_device_profile(device_name) if device_name else None, cards)
    per_token = out["kv_bytes_per_token"]
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    formula = (f"{m.layers} layers x ({m.kv_lora_rank} latent + {m.qk_rope_head_dim} rope) x {DTYPE_BYTES[dtype]} B"
               + (f" + {m.layers} x {m.indexer_head_dim} B indexer keys" if m.indexer_head_dim else "")
               if m.attention == "mla" else
               f"2 x {m.layers} layers x {m.kv_heads} kv heads x {m.head_dim} head_dim x {DTYPE_BYTES[dtype]} B")
    click.echo(f"{m.name} ({out['attention'].upper()}, KV {dtype})")
    click.echo(f"  per token:   {per_token:,} B  = {formula}")
    click.echo(f"  per request: {_gb(per_token * context)}  ({context:,} tokens, {per_token * context:,} B)")
    if device_name:
        click.echo(f"  on {out['device_profile']} ({out['instance_cards']} cards per worker; memory left after the weights): "
                   f"{out['kv_capacity_tokens']:,} tokens = {out['requests_fitting']:,} such requests")


PROFILE_FILE = "device-cpu-local.yaml"


def _bundled_profile() -> Path:
    return Path(str(resources.files("reference_server.sim.profiles") / PROFILE_FILE))


def _default_out() -> Path:
    """Where ``calibrate`` writes without ``--out``: in a source checkout the bundled ``cpu-local`` profile
    (committing it ships the new fit); in an installed package, never its own data file (a site-packages
    file that ``pip`` owns and the next install replaces) but ``device-cpu-local.yaml`` here."""
    bundled = _bundled_profile()
    root = bundled.parents[3]    # profiles -> sim -> reference_server -> the checkout (or site-packages)
    installed = {"site-packages", "dist-packages"} & set(bundled.parts)
    return bundled if (root / "pyproject.toml").is_file() and not installed else Path(PROFILE_FILE)


@click.command("calibrate")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="where to write the fitted profile (default: the bundled cpu-local profile in a source "
                   "checkout; ./device-cpu-local.yaml when paasbench is installed)")
@click.option("--quick", is_flag=True, help="5 rounds of repeats instead of 11 (~10 s instead of ~25 s on 2 cores; "
                                            "the command prints its own time)")
@click.option("--model", default="tiny", show_default=True,
              help="real engine model to measure: tiny, small, or a Hugging Face checkpoint directory")
@click.option("--backend", type=click.Choice(["numpy", "torch"]), default="numpy", show_default=True)
@click.option("--device", default="cpu", show_default=True,
              help="torch device (cpu, cuda[:N], musa[:N]); an accelerator's fit needs --out")
@click.option("--threads", type=click.IntRange(min=0), default=1, show_default=True,
              help="BLAS threads, as the server gives each worker (cores / workers); 0 = leave the BLAS default. "
                   "With 1, steps are timed in thread CPU time, which neighbours on a shared machine cannot inflate")
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON instead of a table")
def calibrate(out: Path | None, quick: bool, model: str, backend: str, device: str, threads: int,
              as_json: bool) -> None:
    """Measure the cpu engine here, fit the `cpu-local` device profile, report the sim's error on held-out shapes."""
    if threads:   # this process's BLAS, set before numpy loads: a command-line concern, not the fit's
        import sys

        blas_vars = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
        if "numpy" in sys.modules and any(os.environ.get(v) != str(threads) for v in blas_vars):
            # BLAS reads its thread count once, when numpy loads
            raise click.ClickException(f"numpy is already loaded: set {', '.join(blas_vars)}={threads} "
                                       "before starting, or pass --threads 0")
        for var in blas_vars:
            os.environ[var] = str(threads)
    from paasbench.report.load import shown_path
    from reference_server.sim.calibrate import run_calibration, write_profile

    if out is None and device != "cpu":
        raise click.UsageError("an accelerator's fit needs --out PATH (the bundled profile is cpu-local's)")
    out = out or _default_out()
    if not os.access(out.parent if not out.exists() else out, os.W_OK):
        raise click.ClickException(f"cannot write {out}; pass --out PATH (load it with --device-profile PATH)")
    load = os.getloadavg()[0]
    with input_errors(lambda exc: "--device" if "device" in str(exc) else "--model"):
        # unknown model, bad checkpoint, missing device: one line, exit 2
        from rich.console import Console

        from paasbench.progress import counting

        with counting("calibrate", Console(stderr=True), unit="engine steps") as counter:
            cal = run_calibration(model=model, quick=quick, backend=backend, device=device, progress=counter)
    write_profile(cal, out)
    shown = shown_path(out)   # the bundled profile by default: never this machine's absolute path
    rows, summary, d = cal.rows(), cal.summary(Path(shown), load), cal.device
    if as_json:
        click.echo(json.dumps({"summary": summary, "rows": rows}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    from paasbench.console import print_whole

    table = Table(title=f"real engine ({model}, {backend} on {device}) vs sim ({d.name}) step time")
    for col in ("set", "shape", "measured ms", "sim ms", "error", "noise"):
        table.add_column(col, justify="left" if col in ("set", "shape") else "right")
    for r in rows:
        table.add_row(r["set"], r["shape"], f"{r['measured_ms']:.2f}", f"{r['sim_ms']:.2f}", f"{r['error_pct']:+.1f}%",
                      f"{r['noise_pct']:.0f}%")
    con = Console()
    print_whole(con, table)
    f = summary["fitted"]
    con.print(f"fitted: linear {f['linear_gflops']:.1f} GFLOP/s, attention {f['attention_gflops']:.1f} GFLOP/s, "
              f"weights {f['weight_gbps']:.1f} GB/s (x{f['gemm_weight_passes']:.1f} for multi-row matmuls), "
              f"KV {f['kv_gbps']:.1f} GB/s, overlap {f['overlap']:.2f}, "
              f"overhead {f['step_overhead_ms']:.2f} ms/step + {f['seq_overhead_ms']:.2f} ms/seq; memcpy {f['memcpy_gbps']:.1f} GB/s")
    mean = summary["held_out_mean_abs_error_pct"]
    con.print(f"held-out error: mean {mean:.1f}% ({'meets' if mean < 10 else 'misses'} the goal of a mean under 10%), "
              f"max {summary['held_out_max_abs_error_pct']:.1f}%; load average before: {load:.1f} on {os.cpu_count()} "
              f"CPUs ('noise' = median over min of the repeats)", soft_wrap=True)
    from reference_server.sim.calibrate import single_threaded

    # soft wrap: a path is never broken mid-word (the terminal wraps the line where it must)
    con.print(f"timed in {'thread CPU' if single_threaded() else 'wall-clock'} time; wrote {shown} in "
              f"{cal.elapsed_s:.1f} s" + ("" if out == _bundled_profile() else
                                          f" (use it: --device-profile {shown})"), soft_wrap=True)
