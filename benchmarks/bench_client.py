"""Client cost: streamed output tokens per client CPU-second, paasbench vs a naive aiohttp client.

Both clients stream the same closed-loop load from the same fast SSE server (tests/sse_server.py, TTFT 0,
ITL 0, one token per SSE event like vLLM) running in its own process, so the CPU measured
(``time.process_time`` of this process) is the client's alone. The baseline is the usual benchmark-client
loop (vLLM ``bench serve`` style): shared aiohttp session, iterate the body line by line, ``json.loads`` each
``data:`` event, timestamp every token chunk. paasbench runs its full pipeline: pacing, SSE scan, watchdog,
usage reconciliation, one flushed JSONL record per request.

    python benchmarks/bench_client.py [--requests 600] [--concurrency 64] [--output-tokens 128] [--accuracy]
    python benchmarks/bench_client.py --parser     # scanner CPU per SSE event: compact vs spaced JSON
    python benchmarks/bench_client.py --pacing     # send-time precision: sleep_until vs a timer-only sleep
    python benchmarks/bench_client.py --long 64 --long-only --long-baseline ../main   # 128K-token prompts

``--long N`` runs N requests with 128K-token prompts at concurrency 8 against a fake server that reports its own
first-token write (the wire truth): input tokens/s, client TTFT minus the wire's, client CPU per request; with
``--long-baseline DIR`` another checkout (e.g. ``git worktree add ../main main``) runs alternated with this one in
the same run, against the same server, and the ratio is printed; with ``--long-aiperf`` AIPerf runs too.

``--accuracy`` first prints the client's TTFT error against the wire (the server's first-token write on the
shared monotonic clock) at concurrency 1, 8 and 32, as the anchors table reports it for GuideLLM and AIPerf.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from sse_server import SSEServer, wire_ttft_ms  # noqa: E402

from paasbench.client import ClientConfig  # noqa: E402
from paasbench.load.runner import LoadConfig, run_load  # noqa: E402
from paasbench.metrics.records import read_records  # noqa: E402
from paasbench.trace.model import Trace, TraceRequest  # noqa: E402

PROMPT = " ".join(["word"] * 128)


async def naive(url: str, n: int, concurrency: int, out_tokens: int) -> int:
    """The baseline: what most benchmark clients do per SSE event."""
    body = {"model": "sse-test", "prompt": PROMPT, "max_tokens": out_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    tokens = 0
    it = iter(range(n))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def slot() -> None:
            nonlocal tokens
            for _ in it:
                times = []
                async with session.post(url + "/v1/completions", json=body) as resp:
                    async for raw in resp.content:
                        line = raw.strip()
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            break
                        obj = json.loads(data)
                        if obj.get("choices") and obj["choices"][0].get("text"):
                            times.append(time.perf_counter())
                        usage = obj.get("usage")
                        if usage:
                            tokens += usage["completion_tokens"]
                assert times
        await asyncio.gather(*(slot() for _ in range(concurrency)))
    return tokens


async def ours(url: str, n: int, concurrency: int, out_tokens: int, out_dir: Path) -> int:
    trace = Trace([TraceRequest(0.0, 128, out_tokens, [i], prompt=PROMPT) for i in range(n)])
    res = await run_load(trace, LoadConfig(mode="concurrency", concurrency=concurrency, max_requests=n),
                         ClientConfig(target=url, model="sse-test"), out_dir)
    assert res.summary["requests"]["ok"] == n, res.summary["errors"]
    return sum(r.completion_tokens or 0 for r in read_records(res.records_path))


def measure(label: str, coro_fn) -> dict:
    c0, w0 = time.process_time(), time.perf_counter()
    tokens = asyncio.run(coro_fn())
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    row = {"client": label, "tokens": tokens, "cpu_s": cpu, "wall_s": wall,
           "tokens_per_cpu_s": tokens / cpu, "us_cpu_per_token": cpu / tokens * 1e6, "tokens_per_s": tokens / wall}
    print(f"{label:10s} {tokens:8d} tokens  cpu {cpu:6.2f} s  wall {wall:6.2f} s  "
          f"{row['tokens_per_cpu_s']:10,.0f} tok/cpu-s  {row['us_cpu_per_token']:6.2f} us/token  "
          f"{row['tokens_per_s']:9,.0f} tok/s", flush=True)
    return row


def accuracy(concurrency: int, n: int) -> dict:
    """Client TTFT minus wire TTFT (the server's first token write), TTFT 200 ms / ITL 10 ms server."""
    import numpy as np

    from paasbench.metrics.summary import token_itls_ms

    trace = Trace([TraceRequest(0.0, 3, 16 + (i * 7) % 17, [i], prompt="[[sse timings=1]] x") for i in range(n)])
    with SSEServer(ttft_ms=200, itl_ms=10) as srv, tempfile.TemporaryDirectory() as tmp:
        res = asyncio.run(run_load(trace, LoadConfig(mode="concurrency", concurrency=concurrency, max_requests=n),
                                   ClientConfig(target=srv.url), tmp))
        recs = list(read_records(res.records_path))
    t0 = res.summary["meta"]["t0_monotonic"]
    err = np.array([(r.first_token_s - r.intended_send_s) * 1e3 - wire_ttft_ms(r, t0) for r in recs])
    itl = np.concatenate([token_itls_ms(r.chunk_times_s, r.chunk_tokens) for r in recs])
    row = {"concurrency": concurrency, "requests": n, "ttft_minus_wire_ms_mean": float(err.mean()),
           "ttft_minus_wire_ms_p50": float(np.median(err)), "ttft_minus_wire_ms_p99": float(np.percentile(err, 99)),
           "itl_ms_mean": float(itl.mean()), "itl_ms_p50": float(np.median(itl))}
    print(f"conc {concurrency:3d}: client TTFT - wire TTFT  mean {row['ttft_minus_wire_ms_mean']:.3f}  p50 "
          f"{row['ttft_minus_wire_ms_p50']:.3f}  p99 {row['ttft_minus_wire_ms_p99']:.3f} ms;  per-token ITL mean "
          f"{row['itl_ms_mean']:.3f}  p50 {row['itl_ms_p50']:.3f} ms (configured 10)", flush=True)
    return row


LONG_TOKENS, LONG_CONCURRENCY, LONG_OUTPUT = 131072, 8, 16


def long_worker(url: str, n: int, concurrency: int = LONG_CONCURRENCY, tokens: int = LONG_TOKENS) -> dict:
    """One client's 128K-token run against ``url`` (a ``tests/sse_server.py`` with ``timings=1``), in this process:
    ``n`` requests of ``tokens``-token prompts (materialized from hash ids, exact length) at ``concurrency``,
    16 output tokens each. Runs in a fresh process per side (``--long-worker``), so the baseline side can be
    another checkout's code (its ``paasbench`` first on ``PYTHONPATH``)."""
    import numpy as np

    assert n > concurrency, "--long N: more requests than the 8 streams"
    block = 512
    trace = Trace([TraceRequest(0.0, tokens, LONG_OUTPUT, list(range(i * 1000, i * 1000 + tokens // block)),
                                extra={}) for i in range(n)], block_size=block)
    from paasbench.client import build_body
    from paasbench.load.prompts import PromptBuilder
    from paasbench.metrics.records import RecordWriter

    # the prompt and body of one request, as this side's send path makes them (json_text where it exists)
    pb = PromptBuilder(block, salt=1)
    make = getattr(pb, "json_text", pb.text)
    cfg, best = ClientConfig(target=url), float("inf")
    for _ in range(3):
        c0 = time.process_time()
        for req in trace.requests[:16]:
            build_body(cfg, "sse-test", make(req), LONG_OUTPUT)
        best = min(best, (time.process_time() - c0) / 16 * 1e3)

    # client CPU in the steady state: from the first round of records written (one per slot) to the last, so
    # the tokenizer and tape load before t0 and the summary after the load count for neither side
    marks: list[float] = []
    write = RecordWriter.write
    RecordWriter.write = lambda self, rec: (marks.append(time.process_time()), write(self, rec))[1]  # type: ignore
    with tempfile.TemporaryDirectory() as tmp:
        res = asyncio.run(run_load(trace, LoadConfig(mode="concurrency", concurrency=concurrency, max_requests=n),
                                   ClientConfig(target=url), tmp))
        recs = list(read_records(res.records_path))
    cpu = (marks[-1] - marks[concurrency - 1]) / (n - concurrency) * n
    t0 = res.summary["meta"]["t0_monotonic"]
    assert all(r.ok and r.prompt_tokens == tokens for r in recs), res.summary["errors"]
    err = np.array([(r.first_token_s - r.intended_send_s) * 1e3 - wire_ttft_ms(r, t0) for r in recs])
    # the write clocks: the upload of each 0.5 MB body, and TTFT from its last byte less the server's own TTFT
    # from its read of the last byte = how long the written request waited in the socket before the (single-
    # threaded) server read it: time the target imposes, which TTFT from the last byte keeps and upload excludes
    upload = np.array([(r.request_write_end_s - r.request_write_start_s) * 1e3 for r in recs])
    from_end = np.array([(r.first_token_s - r.request_write_end_s) * 1e3
                         - (r.server_timings["first_write_clock"] - r.server_timings["recv_clock"]) * 1e3
                         for r in recs])
    # from the intended send to the request's first byte on the socket: what the client does before sending
    # (prompt, body, aiohttp), inside every latency of a closed loop
    to_wire = np.array([(r.request_write_start_s - r.intended_send_s) * 1e3 for r in recs])
    # a read is stamped with its last packet's arrival (docs/metrics.md): where the first token's read also took
    # the next token's packet, its time is that later packet's, which no TCP reader can split; the offset of
    # the requests whose first token was read alone is the client's own error
    alone = np.array([len(r.chunk_times_s) < 2 or r.chunk_times_s[1] != r.chunk_times_s[0] for r in recs])
    return {"requests": n, "input_tokens_per_s": res.summary["input_tokens_per_s"], "prompt_and_body_ms": best,
            "first_token_read_alone_share": float(alone.mean()),
            "ttft_minus_wire_ms_mean_read_alone": float(err[alone].mean()) if alone.any() else None,
            "ttft_minus_wire_ms_mean_read_with_later": float(err[~alone].mean()) if (~alone).any() else None,
            "client_cpu_ms_per_request": cpu / n * 1e3, "ttft_minus_wire_ms_mean": float(err.mean()),
            "ttft_minus_wire_ms_p50": float(np.median(err)), "upload_ms_mean": float(upload.mean()),
            "intended_to_first_byte_ms_p50": float(np.median(to_wire)),
            "written_to_server_read_ms_mean": float(from_end.mean())}


def aiperf_side(exe: str, url: str, n: int, out_dir: Path) -> dict:
    """AIPerf (``aiperf profile``) on the same 128K-token load: ``n`` synthetic prompts of exactly LONG_TOKENS tokens
    in cl100k (``--tokenizer cl100k_base``: tiktoken's vocabulary must be in its cache, ``TIKTOKEN_CACHE_DIR``, on a
    machine without the internet), 8 streams, 16 output tokens. Its input tokens/s is its request throughput times
    the prompt length; its TTFT is its own (mean), not compared with the wire (its records do not carry the
    server's timings)."""
    import subprocess

    art = out_dir / f"aiperf-{time.monotonic_ns()}"
    cmd = [exe, "profile", "--model", "sse-test", "--url", url, "--endpoint-type", "completions", "--streaming",
           "--concurrency", str(LONG_CONCURRENCY), "--request-count", str(n), "--synthetic-input-tokens-mean",
           str(LONG_TOKENS), "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(LONG_OUTPUT),
           "--extra-inputs", "ignore_eos:true", "--tokenizer", "cl100k_base", "--artifact-dir", str(art)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"aiperf failed (exit {out.returncode}):\n{(out.stdout + out.stderr)[-3000:]}")
    got = json.loads((art / "profile_export_aiperf.json").read_text())
    # its own measured prompt length (it is asked for LONG_TOKENS with no spread), not the length asked for
    return {"requests": n, "input_tokens_per_s": got["request_throughput"]["avg"] * got["input_sequence_length"]["avg"],
            "input_sequence_length_mean": got["input_sequence_length"]["avg"],
            "aiperf_ttft_ms_mean": got["time_to_first_token"]["avg"]}


def long_prompts(n: int, rounds: int = 3, baseline_src: str | None = None, aiperf: str | None = None) -> dict:
    """128K-token prompts at concurrency 8, this checkout against a baseline measured in the same run: another
    checkout's code (``baseline_src``, e.g. a worktree of main) when given. Each side runs in its own process
    against the same fake SSE server (its own process, ``timings=1``: the wire truth), alternated ``rounds``
    times; each side's best round by input tokens/s is kept, and its TTFT offset is the median of its rounds'."""
    import statistics
    import subprocess

    here = Path(__file__).resolve().parent.parent
    sides = {"paasbench": here}
    if baseline_src:
        sides["baseline"] = Path(baseline_src).resolve()
    rows: dict[str, list[dict]] = {name: [] for name in sides}
    if aiperf:
        rows["AIPerf"] = []
    with SSEServer(timings=True) as srv, tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order: list[tuple[str, Path | None]] = list(sides.items())
            if aiperf:
                order.insert(0, ("AIPerf", None))
            if r % 2:   # alternate who goes first
                order.reverse()
            for name, src in order:
                if src is None:
                    row = aiperf_side(aiperf, srv.url, n, Path(tmp))
                    rows[name].append(row)
                    print(f"  round {r + 1} AIPerf    {row['input_tokens_per_s'] / 1e6:5.2f}M input tok/s  (its own "
                          f"TTFT mean {row['aiperf_ttft_ms_mean']:.1f} ms; input length "
                          f"{row['input_sequence_length_mean']:.0f})", flush=True)
                    continue
                env = {**os.environ, "PYTHONPATH": str(src)}
                out = subprocess.run([sys.executable, __file__, "--long-worker", srv.url, "--long", str(n)],
                                     env=env, cwd=src, capture_output=True, text=True, timeout=900)
                if out.returncode != 0:
                    raise SystemExit(f"{name} ({src}) failed:\n{out.stderr[-3000:]}")
                row = json.loads(out.stdout.strip().splitlines()[-1])
                rows[name].append(row)
                print(f"  round {r + 1} {name:9s} {row['input_tokens_per_s'] / 1e6:5.2f}M input tok/s  client CPU "
                      f"{row['client_cpu_ms_per_request']:5.1f} ms/request (prompt + body "
                      f"{row['prompt_and_body_ms']:4.2f} ms)  TTFT - wire mean "
                      f"{row['ttft_minus_wire_ms_mean']:6.2f} p50 {row['ttft_minus_wire_ms_p50']:6.2f} ms  intended "
                      f"send -> first byte written p50 {row['intended_to_first_byte_ms_p50']:5.2f} ms", flush=True)
                if row.get("first_token_read_alone_share") is not None:
                    later = row["ttft_minus_wire_ms_mean_read_with_later"]
                    alone = row["ttft_minus_wire_ms_mean_read_alone"]
                    print(f"    first token read alone in {row['first_token_read_alone_share']:.0%} of requests: "
                          f"TTFT - wire mean {'-' if alone is None else f'{alone:.2f}'} ms; read with the next "
                          f"token's packet: {'-' if later is None else f'{later:.2f}'} ms", flush=True)
    # the checkouts as the user's working directory sees them (no machine path in the output)
    shown = {name: os.path.relpath(src) for name, src in sides.items()}
    result: dict = {"requests": n, "rounds": rounds, "sides": shown, "rows": rows}
    for name, rs in rows.items():
        best = max(rs, key=lambda x: x["input_tokens_per_s"])
        if name == "AIPerf":
            result[name] = {"input_tokens_per_s_best": best["input_tokens_per_s"]}
            continue
        result[name] = {"input_tokens_per_s_best": best["input_tokens_per_s"],
                        "ttft_minus_wire_ms_mean_median": statistics.median(x["ttft_minus_wire_ms_mean"] for x in rs),
                        "client_cpu_ms_per_request_median": statistics.median(
                            x["client_cpu_ms_per_request"] for x in rs),
                        "prompt_and_body_ms_median": statistics.median(x["prompt_and_body_ms"] for x in rs)}
    me = result["paasbench"]
    line = (f"128K-token prompts, conc {LONG_CONCURRENCY}, {n} requests, best of {rounds}: paasbench "
            f"{me['input_tokens_per_s_best'] / 1e6:.2f}M input tok/s, client TTFT - wire "
            f"{me['ttft_minus_wire_ms_mean_median']:.2f} ms (mean; median of rounds), client CPU "
            f"{me['client_cpu_ms_per_request_median']:.1f} ms/request")
    if "baseline" in result:
        base = result["baseline"]
        result["ratio_input_tokens_per_s"] = me["input_tokens_per_s_best"] / base["input_tokens_per_s_best"]
        result["ratio_client_cpu"] = me["client_cpu_ms_per_request_median"] / base["client_cpu_ms_per_request_median"]
        result["ratio_prompt_and_body"] = me["prompt_and_body_ms_median"] / base["prompt_and_body_ms_median"]
        line += (f"; baseline ({shown['baseline']}) {base['input_tokens_per_s_best'] / 1e6:.2f}M, "
                 f"{base['ttft_minus_wire_ms_mean_median']:.2f} ms, {base['client_cpu_ms_per_request_median']:.1f} "
                 f"ms/request  ->  ratio {result['ratio_input_tokens_per_s']:.2f}x input tok/s, "
                 f"{result['ratio_client_cpu']:.2f}x client CPU per request, prompt + body "
                 f"{me['prompt_and_body_ms_median']:.2f} vs {base['prompt_and_body_ms_median']:.2f} ms "
                 f"({result['ratio_prompt_and_body']:.2f}x)")
    if "AIPerf" in result:
        result["ratio_vs_aiperf_input_tokens_per_s"] = (me["input_tokens_per_s_best"]
                                                         / result["AIPerf"]["input_tokens_per_s_best"])
        line += (f"; AIPerf {result['AIPerf']['input_tokens_per_s_best'] / 1e6:.2f}M  ->  paasbench / AIPerf "
                 f"{result['ratio_vs_aiperf_input_tokens_per_s']:.2f}x input tok/s")
    print(line, flush=True)
    return result


def parser_cost(events: int = 20000, rounds: int = 5) -> dict:
    """CPU per SSE content event in the client's scanner, for compact JSON (``"text":" tok"``) and for JSON with
    a space after each colon (Python's ``json.dumps`` default, some servers), beside ``json.loads`` per event
    (the naive client's cost) as the baseline: both layouts must take the fast path."""
    from paasbench.client.sse import StreamParser

    def stream(separators: tuple[str, str]) -> list[bytes]:
        ev = json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                         "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": None}]},
                        separators=separators).encode()
        raw = (b"data: " + ev + b"\n\n") * events
        return [raw[i:i + 4096] for i in range(0, len(raw), 4096)]  # 4 KiB reads, events cut across them

    def scan(reads: list[bytes]) -> float:
        best = float("inf")
        for _ in range(rounds):
            p = StreamParser(keep_raw=False)
            c0 = time.process_time()
            for chunk in reads:
                p.feed(chunk, 0.0)
            best = min(best, time.process_time() - c0)
            assert len(p.counts) == events
        return best / events * 1e6

    def loads(reads: list[bytes]) -> float:
        lines = [ln[6:] for ln in b"".join(reads).split(b"\n") if ln.startswith(b"data: ")]
        best = float("inf")
        for _ in range(rounds):
            c0 = time.process_time()
            for ln in lines:
                json.loads(ln)
            best = min(best, time.process_time() - c0)
        return best / events * 1e6

    compact, spaced = stream((",", ":")), stream((", ", ": "))
    row = {"compact_us_per_event": scan(compact), "spaced_us_per_event": scan(spaced),
           "json_loads_us_per_event": loads(spaced)}
    row["spaced_vs_compact"] = row["spaced_us_per_event"] / row["compact_us_per_event"]
    print(f"SSE scanner per content event: compact JSON {row['compact_us_per_event']:.3f} us, space after colon "
          f"{row['spaced_us_per_event']:.3f} us ({row['spaced_vs_compact']:.2f}x compact); json.loads per event "
          f"{row['json_loads_us_per_event']:.3f} us (baseline)", flush=True)
    return row


def pacing(sends: int = 500, gap_s: float = 0.002) -> dict:
    """Wake-up lateness (ms) of ``sleep_until`` against a timer-only ``asyncio.sleep`` to the same absolute
    deadlines, alternated send by send so both see the same machine. Target on an idle box: median < 0.5 ms
    (the timer alone is up to 1 ms late: epoll rounds timeouts up to whole ms)."""
    import numpy as np

    from paasbench.load.schedule import sleep_until

    async def timer_only(deadline: float) -> None:
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))

    async def go() -> dict[str, list[float]]:
        lags: dict[str, list[float]] = {"sleep_until": [], "timer_only": []}
        start = time.monotonic() + 0.01
        for i in range(sends):
            name, fn = ("sleep_until", sleep_until) if i % 2 == 0 else ("timer_only", timer_only)
            target = start + i * gap_s
            await fn(target)
            lags[name].append((time.monotonic() - target) * 1e3)
        return lags

    lags = asyncio.run(go())
    row = {name: {"p50_ms": float(np.median(v)), "p99_ms": float(np.percentile(v, 99)), "min_ms": float(min(v))}
           for name, v in lags.items()}
    row["ratio_p50"] = row["timer_only"]["p50_ms"] / max(row["sleep_until"]["p50_ms"], 1e-6)
    print(f"wake-up lateness p50: sleep_until {row['sleep_until']['p50_ms']:.3f} ms, timer-only "
          f"{row['timer_only']['p50_ms']:.3f} ms  ->  {row['ratio_p50']:.1f}x closer (target: sleep_until p50 "
          f"< 0.5 ms on an idle box)", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="alternate the clients this many times; best kept")
    ap.add_argument("--accuracy", action="store_true", help="also: client TTFT vs wire at concurrency 1 / 8 / 32")
    ap.add_argument("--long", type=int, default=0, metavar="N",
                    help="also: N requests with 128K-token prompts at concurrency 8 (input tok/s, TTFT vs wire)")
    ap.add_argument("--long-baseline", metavar="DIR", help="with --long: also run the checkout at DIR (e.g. a "
                    "worktree of main) in the same run, alternated with this one, and print the ratio")
    ap.add_argument("--long-rounds", type=int, default=3, help="with --long: rounds per side (default 3)")
    ap.add_argument("--long-aiperf", metavar="EXE", nargs="?", const="aiperf",
                    help="with --long: also run AIPerf (this executable; default: aiperf on PATH) each round against "
                    "the same server and print paasbench's ratio to it (needs cl100k_base in tiktoken's cache)")
    ap.add_argument("--long-only", action="store_true", help="with --long: nothing else")
    ap.add_argument("--long-worker", metavar="URL", help=argparse.SUPPRESS)  # one side's run, in its own process
    ap.add_argument("--parser", action="store_true",
                    help="only: SSE scanner CPU per event, compact vs spaced JSON, json.loads as the baseline")
    ap.add_argument("--pacing", action="store_true",
                    help="only: send-time lateness of sleep_until vs a timer-only sleep (median, p99)")
    args = ap.parse_args()
    if args.pacing:
        print(json.dumps(pacing()))
        return
    if args.parser:
        print(json.dumps(parser_cost()))
        return
    if args.long_worker:
        print(json.dumps(long_worker(args.long_worker, args.long)))
        return
    if args.long:
        print(json.dumps(long_prompts(args.long, args.long_rounds, args.long_baseline, args.long_aiperf)))
        if args.long_only:
            return
    if args.accuracy:
        for conc, n in ((1, 20), (8, 64), (32, 160)):
            accuracy(conc, n)
    n, c, k = args.requests, args.concurrency, args.output_tokens
    rows: dict[str, list[dict]] = {"naive": [], "paasbench": []}
    with SSEServer() as srv, tempfile.TemporaryDirectory() as tmp:
        asyncio.run(naive(srv.url, 8, 4, 8))  # warm both paths (imports, connections)
        for r in range(args.rounds):
            rows["naive"].append(measure("naive", lambda: naive(srv.url, n, c, k)))
            rows["paasbench"].append(measure("paasbench", lambda: ours(srv.url, n, c, k, Path(tmp) / f"r{r}")))
    best = {name: max(v, key=lambda x: x["tokens_per_cpu_s"]) for name, v in rows.items()}
    ratio = best["paasbench"]["tokens_per_cpu_s"] / best["naive"]["tokens_per_cpu_s"]
    print(f"client max RSS (whole process, both clients): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
    print(f"\nstreamed tokens per client CPU-second: paasbench {best['paasbench']['tokens_per_cpu_s']:,.0f}, "
          f"naive aiohttp+json.loads {best['naive']['tokens_per_cpu_s']:,.0f}  ->  ratio {ratio:.2f}x "
          f"(concurrency {c}, {k} tokens/request, {n} requests; best of {args.rounds})")
    print(json.dumps({"best": best, "ratio": ratio}))


if __name__ == "__main__":
    main()
