"""``serve --engine vllm``'s protocol against two small fake vLLM servers (no vLLM needed; runs everywhere).

What the router and its vLLM workers must do with any instance (issue #22), checked on what the fakes
received: a remote prefill sends the prefill instance ``max_tokens=1`` with ``do_remote_decode``, and the
``kv_transfer_params`` of its answer go unchanged into the decode instance's request; a short prompt goes to
the decode instance alone; a prefill instance that fails turns into a local prefill on the decode instance;
the instances' token ids come back as the router's text and usage; ``/metrics`` passes both instances'
series through with a worker label. The real engines are tests/test_vllm_pd.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import threading
import time
import urllib.request
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator

import pytest

from reference_server.kv.block_manager import chain_hashes
from reference_server.launcher import EmbeddedServer
from paas_common.prometheus import parse
from reference_server.vllm_worker import PrefixRecord, figures_of, label_value, merge_expositions
from tests.vllm_fixture import BLOCK, MODEL, write_checkpoint

FAIL = 7          # a prompt starting with this id makes the fake prefill instance answer 500
SLOW = 8          # ... makes the fake stream one token every 0.5 s
# the connector's own time per request, as the fakes' connectors "measure" it: the prefill instance's save
# (the example connector's histogram), the decode instance's transfer (NIXL's)
SAVE_S, XFER_S = 0.0045, 0.0123
XFER_BYTES = 81_920           # ... and the bytes of each transfer (NIXL's vllm:nixl_bytes_transferred)
MAX_MODEL_LEN = 1024          # each fake's /v1/models limit: under its KV pool (64 blocks of 32 tokens)


class FakeVllm:
    """``/health``, ``/v1/models`` (``max_model_len``), ``/metrics`` (vLLM's names) and ``/v1/completions`` (token
    ids in, token ids out: output token ``i`` is ``10 + (len(prompt) + i) % 50``), recording every completions
    body it got."""

    def __init__(self, name: str) -> None:
        self.name, self.bodies = name, []
        self.connector = ("vllm:example_connector_save_time_seconds" if name == "prefill"
                          else "vllm:nixl_xfer_time_seconds")
        self.cut = 0                      # streams whose reader went away before the end (an abort, to vLLM)
        self.connector_s = [0.0, 0]       # the connector histogram's sum and count
        self.metrics_reads: list[float] = []     # time.monotonic() of every /metrics request
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self._ready.wait(10)

    def _run(self) -> None:
        from aiohttp import web

        async def health(_: web.Request) -> web.Response:
            return web.Response(text="")

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": MODEL, "max_model_len": MAX_MODEL_LEN}]})

        async def metrics(_: web.Request) -> web.Response:
            self.metrics_reads.append(time.monotonic())
            moved = "" if self.name == "prefill" else (
                "# TYPE vllm:nixl_bytes_transferred histogram\n"
                f'vllm:nixl_bytes_transferred_sum{{engine="0"}} {XFER_BYTES * self.connector_s[1]}\n'
                f'vllm:nixl_bytes_transferred_count{{engine="0"}} {self.connector_s[1]}\n')
            return web.Response(text=moved + (
                "# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n"
                'vllm:num_requests_running{engine="0"} 0.0\n'
                "# HELP vllm:cache_config_info Cache config.\n# TYPE vllm:cache_config_info gauge\n"
                f'vllm:cache_config_info{{block_size="{BLOCK}",num_gpu_blocks="64"}} 1.0\n'
                "# HELP vllm:prompt_tokens Prompt tokens.\n# TYPE vllm:prompt_tokens counter\n"
                f'vllm:prompt_tokens_total{{engine="0"}} {sum(len(b["prompt"]) for b in self.bodies)}\n'
                f"# TYPE {self.connector} histogram\n"
                f'{self.connector}_sum{{engine="0"}} {self.connector_s[0]}\n'
                f'{self.connector}_count{{engine="0"}} {self.connector_s[1]}\n'))

        async def completions(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.bodies.append(body)
            if body.get("kv_transfer_params"):           # the connector saves (prefill) or loads (decode)
                self.connector_s[0] += SAVE_S if self.name == "prefill" else XFER_S
                self.connector_s[1] += 1
            prompt, n = body["prompt"], body["max_tokens"]
            ids = [10 + (len(prompt) + i) % 50 for i in range(n)]
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n,
                     "prompt_tokens_details": {"cached_tokens": 0}}
            if not body.get("stream"):
                if self.name == "prefill" and prompt[0] == FAIL:
                    return web.json_response({"error": "injected"}, status=500)
                return web.json_response({"choices": [{"text": "", "token_ids": ids, "finish_reason": "length"}],
                                          "usage": usage, "kv_transfer_params": {"remote_engine_id": "fake-P",
                                                                                 "remote_block_ids": [len(prompt)]}})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            try:
                for i, t in enumerate(ids):
                    if prompt[0] == SLOW:
                        await asyncio.sleep(0.5)
                    choice = {"text": "", "token_ids": [t], "finish_reason": "length" if i == n - 1 else None}
                    await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            except (ConnectionError, asyncio.CancelledError):
                self.cut += 1
                raise
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
            return resp

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", completions)
        asyncio.set_event_loop(self._loop)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        self._ready.set()
        self._loop.run_forever()


@pytest.fixture(scope="module")
def fakes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedServer, FakeVllm, FakeVllm, Path]]:
    ckpt = write_checkpoint(tmp_path_factory.mktemp("fake-vllm") / "ckpt")
    p, d = FakeVllm("prefill"), FakeVllm("decode")
    args = ["--engine", "vllm", "--model", str(ckpt), "--model-name", MODEL, "--block-size", str(BLOCK),
            "--routing", "threshold", "--remote-prefill-threshold", "40", "--vllm-prefill-url", p.url,
            "--vllm-decode-url", d.url]
    with EmbeddedServer(args, startup_timeout_s=120) as srv:
        yield srv, p, d, ckpt


def complete(url: str, prompt: list[int], n: int = 4) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    out: dict[str, Any] = {"text": ""}
    with urllib.request.urlopen(req, timeout=60) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                ev = json.loads(line[5:])
                out["text"] += "".join(c.get("text") or "" for c in ev.get("choices") or [])
                out.update({k: ev[k] for k in ("usage", "paasbench_timings") if ev.get(k)})
    return out


def detok(ckpt: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(ckpt / "tokenizer.json")).decode(ids)


def test_remote_prefill_hands_kv_transfer_params_to_decode(fakes: Any) -> None:
    srv, p, d, ckpt = fakes
    prompt = list(range(100, 180))                       # 80 tokens > threshold 40: remote
    np_, nd = len(p.bodies), len(d.bodies)
    out = complete(srv.url, prompt)
    (pb,), (db,) = p.bodies[np_:], d.bodies[nd:]
    assert pb["prompt"] == prompt and pb["max_tokens"] == 1 and pb["kv_transfer_params"]["do_remote_decode"]
    assert db["prompt"] == prompt and db["max_tokens"] == 4 and db["stream"]
    assert db["kv_transfer_params"] == {"remote_engine_id": "fake-P", "remote_block_ids": [80]}
    assert out["paasbench_timings"]["prefill_location"] == "remote"
    assert out["text"] == detok(ckpt, [10 + (80 + i) % 50 for i in range(4)])
    assert out["usage"]["prompt_tokens"] == 80 and out["usage"]["completion_tokens"] == 4


def test_connector_times_are_the_instances_own(fakes: Any) -> None:
    """``kv_write_ms`` / ``kv_transfer_ms`` of a remote request are what each instance's connector histogram
    gained over it (attached instances: the connector is found by the histogram each exposes), and they
    land in the router's stage histograms."""
    srv, p, d, _ = fakes
    for k in range(2):
        t = complete(srv.url, list(range(300 + k, 380 + k)))["paasbench_timings"]
        assert t["prefill_location"] == "remote", t
        assert t["kv_transfer_source"] == "connector" and t["kv_connector_transfers"] == 1, t
        assert t["kv_transfer_ms"] == pytest.approx(1e3 * XFER_S) and t["kv_write_ms"] == pytest.approx(1e3 * SAVE_S)
        assert t["transfer_bytes"] == XFER_BYTES, t          # the decode connector's own count
    short = complete(srv.url, list(range(500, 510)))["paasbench_timings"]
    assert short["prefill_location"] == "local" and "kv_transfer_ms" not in short and "transfer_bytes" not in short
    m = urllib.request.urlopen(srv.url + "/metrics", timeout=30).read().decode()
    assert 'paasbench_stage_seconds_sum{stage="kv_transfer"}' in m


def test_a_stage_figure_is_over_the_requests_that_had_the_stage(fakes: Any) -> None:
    """Only a remote request has a KV transfer: a local one carries no ``kv_transfer_ms`` / ``transfer_bytes``,
    the router's kv_transfer stage counts the remote requests alone, and the summary's mean is the transfers'
    own. (Before, each local request carried 0.0 and was counted: a P/D run's one real 7.52 ms transfer read
    0.25 ms over its 30 requests.)"""
    from paasbench.metrics.summary import summarize
    from paasbench.metrics.records import RequestRecord

    srv = fakes[0]

    def stage(text: str, name: str) -> float:
        return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(name))

    before = urllib.request.urlopen(srv.url + "/metrics", timeout=30).read().decode()
    timings = [complete(srv.url, list(range(700 + k, (780 if k < 2 else 715) + k)))["paasbench_timings"]
               for k in range(6)]                    # 2 remote (80 tokens), 4 local (15)
    after = urllib.request.urlopen(srv.url + "/metrics", timeout=30).read().decode()
    assert [t["prefill_location"] for t in timings] == ["remote"] * 2 + ["local"] * 4
    count, total = (stage(after, f'paasbench_stage_seconds_{k}{{stage="kv_transfer"}}')
                    - stage(before, f'paasbench_stage_seconds_{k}{{stage="kv_transfer"}}') for k in ("count", "sum"))
    assert count == 2 and total / count == pytest.approx(XFER_S)
    routed = stage(after, 'paasbench_requests_routed_total{location="remote"}')
    assert stage(after, 'paasbench_stage_seconds_count{stage="kv_transfer"}') == routed   # every remote one, no other
    recs = [RequestRecord(index=i, request_id=str(i), session_id=None, turn=0, intended_send_s=0.0, actual_send_s=0.0,
                          first_token_s=0.1, end_s=0.2, input_tokens_sent=10, max_tokens=4, prompt_tokens=10,
                          completion_tokens=4, server_timings=t) for i, t in enumerate(timings)]
    means = summarize(recs)["server_timings_ms"]
    assert means["kv_transfer_ms"] == pytest.approx(1e3 * XFER_S) and means["transfer_bytes"] == XFER_BYTES


def test_router_reports_the_instances_limit_and_tokenizes(fakes: Any, tmp_path: Path) -> None:
    """The router's ``/v1/models`` says the instances' ``max_model_len`` (1,024 here, under the decode
    instance's KV pool of 2,048 tokens it said before), its ``/tokenize`` counts a prompt as its completions
    will (the same parse), and so the pre-flight of ``run`` stops a run whose prompts cannot fit, with exit 2
    before any load (before: /tokenize was a 404 and the check was deferred to the requests)."""
    from click.testing import CliRunner
    from paasbench.commands.run import run

    srv, _, d, ckpt = fakes
    models = json.loads(urllib.request.urlopen(srv.url + "/v1/models", timeout=30).read())
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    text = "the router counts this prompt as its completions do"
    req = urllib.request.Request(srv.url + "/tokenize", json.dumps({"model": MODEL, "prompt": text}).encode(),
                                 {"Content-Type": "application/json"})
    tok = json.loads(urllib.request.urlopen(req, timeout=30).read())
    body = {"model": MODEL, "prompt": text, "max_tokens": 2}
    req = urllib.request.Request(srv.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    usage = json.loads(urllib.request.urlopen(req, timeout=30).read())["usage"]
    assert tok["count"] == len(tok["tokens"]) == usage["prompt_tokens"] > 0
    assert tok["tokens"] == d.bodies[-1]["prompt"] and tok["max_model_len"] == MAX_MODEL_LEN
    sent = len(d.bodies)
    res = CliRunner().invoke(run, ["--target", srv.url, "--model", MODEL, "--tokenizer", str(ckpt), "--isl", "1100",
                                   "--osl", "8", "--rate", "5", "--max-requests", "2", "--out", str(tmp_path / "r"), "--no-live"])
    assert res.exit_code == 2, res.output
    assert "max_model_len of 1,024" in res.output and len(d.bodies) == sent    # nothing of the load was sent


def test_one_read_of_metrics_serves_requests_and_routing(fakes: Any) -> None:
    """Each remote request's connector time comes from a read of the instance's ``/metrics`` begun after it
    ended; the periodic read that keeps routing's ``running`` fresh reads only when no read came in the last
    0.5 s. So while requests follow each other, every read within 0.4 s of the previous one is a request's:
    at most one per request. (Before, a scraper thread also read every 0.5 s whatever the requests read: 30
    requests drew 34 reads, 32 of them closer than that; now 30 reads.)"""
    srv, _, d, _ = fakes
    time.sleep(0.6)                       # the poll's next read, if any, is not this test's
    start = len(d.metrics_reads)
    n = 30
    for k in range(n):
        t = complete(srv.url, list(range(600 + k, 680 + k)))["paasbench_timings"]
        assert t["kv_transfer_source"] == "connector" and t["kv_connector_transfers"] == 1, t
    reads = d.metrics_reads[start:]
    close = sum(1 for a, b in zip(reads, reads[1:]) if b - a < 0.4)
    assert len(reads) >= n and close <= n, (len(reads), close, [round(b - a, 3) for a, b in zip(reads, reads[1:])])


def test_short_prompt_stays_on_the_decode_instance(fakes: Any) -> None:
    srv, p, d, _ = fakes
    np_, nd = len(p.bodies), len(d.bodies)
    out = complete(srv.url, list(range(200, 220)))
    assert len(p.bodies) == np_ and "kv_transfer_params" not in d.bodies[nd]
    assert out["paasbench_timings"]["route_reason"] == "below-threshold"


def test_failed_prefill_becomes_a_local_prefill(fakes: Any) -> None:
    srv, p, d, _ = fakes
    nd = len(d.bodies)
    out = complete(srv.url, [FAIL, *range(300, 379)])
    assert "kv_transfer_params" not in d.bodies[nd]
    assert out["paasbench_timings"]["prefill_location"] == "local"
    assert "prefill_failover" in out["paasbench_timings"]


def test_client_that_leaves_is_aborted_on_the_instance(fakes: Any) -> None:
    """The client closes after its first token: the decode worker drops its stream to vLLM (which aborts the
    request there) and /metrics counts the abort under the decode pool."""
    import http.client

    srv, _, d, _ = fakes
    cut = d.cut
    host, port = srv.url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"model": MODEL, "prompt": [SLOW, *range(400, 410)], "max_tokens": 20, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    while b"data:" not in resp.readline():
        pass
    conn.close()
    deadline, line = time.monotonic() + 20, ""
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(srv.url + "/metrics", timeout=30).read().decode()
        line = next((x for x in text.splitlines()
                     if x.startswith('paasbench_pool_requests_aborted_total{pool="decode",stage="decode"}')), "")
        if line and float(line.split()[-1]) == 1 and d.cut == cut + 1:
            break
        time.sleep(0.2)
    assert line and float(line.split()[-1]) == 1, line
    assert d.cut == cut + 1          # the decode instance's stream was dropped: vLLM aborts the request


def test_metrics_pass_the_instances_through(fakes: Any) -> None:
    srv = fakes[0]
    text = urllib.request.urlopen(srv.url + "/metrics", timeout=30).read().decode()
    assert "paasbench_requests_routed_total" in text
    for w in ("prefill-0", "decode-0"):
        assert f'vllm:prompt_tokens_total{{worker="{w}",engine="0"}}' in text
    assert text.count("# TYPE vllm:prompt_tokens counter") == 1


def test_merge_expositions() -> None:
    a = '# HELP vllm:x X.\n# TYPE vllm:x counter\nvllm:x_total{e="0"} 3\n'
    merged = merge_expositions([("p-0", a), ("d-0", a.replace(" 3", " 4"))])
    assert merged.splitlines() == ["# HELP vllm:x X.", "# TYPE vllm:x counter", 'vllm:x_total{worker="p-0",e="0"} 3',
                                   'vllm:x_total{worker="d-0",e="0"} 4']



def test_a_brace_inside_a_label_value_is_part_of_the_value() -> None:
    """One parser (paas_common.prometheus) on both sides: a ``}`` (or an escaped quote) inside a label value
    does not end the label set. The worker's old regex dropped such a line: its series went missing from the
    figures and from the router's pass-through."""
    text = ('# TYPE vllm:cache_config_info gauge\n'
            'vllm:cache_config_info{path="/m/{x}",block_size="16",num_gpu_blocks="512"} 1\n'
            'vllm:num_requests_running{model_name="a}b",engine="0"} 2\n'
            'vllm:num_requests_running{model_name="say \\"}\\"",engine="1"} 3\n')
    assert figures_of(text)["vllm:num_requests_running"] == 5
    assert label_value(text, "vllm:cache_config_info", "num_gpu_blocks") == "512"
    merged = parse(merge_expositions([("d-0", text)]))
    assert [(s.name, s.label("worker"), s.label("model_name"), s.value) for s in merged[1:]] == [
        ("vllm:num_requests_running", "d-0", "a}b", 2), ("vllm:num_requests_running", "d-0", 'say "}"', 3)]
    assert merged[0].label("path") == "/m/{x}"


def _blake_chain(prompt: list[int], bs: int) -> list[bytes]:
    """The chain PrefixRecord hand-rolled before it used the block manager's (the oracle for its answers)."""
    out, h = [], b""
    for i in range(len(prompt) // bs):
        block = prompt[i * bs:(i + 1) * bs]
        h = hashlib.blake2b(h + b"".join(t.to_bytes(4, "little", signed=True) for t in block), digest_size=16).digest()
        out.append(h)
    return out


def test_prefix_record_chain_is_the_block_managers() -> None:
    """PrefixRecord hashes with block_manager.chain_hashes; its predicted hits over a mixed, evicting stream
    of prompts equal those of its old hand-rolled blake2b chain (the chain names the prefix either way)."""
    rng = random.Random(7)
    bases = [[rng.randrange(100) for _ in range(24)] for _ in range(5)]      # shared prefixes, then own tails
    prompts = [bases[rng.randrange(5)][:rng.randrange(25)] + [rng.randrange(100) for _ in range(rng.randrange(8))]
               for _ in range(300)]
    rec = PrefixRecord(block_size=4, capacity_blocks=12)
    assert rec._chain(prompts[5]) == chain_hashes(b"", prompts[5], 4, len(prompts[5]) // 4)
    old: OrderedDict[bytes, None] = OrderedDict()
    for p in prompts:
        expect = 0
        for h in _blake_chain(p, 4):
            if h not in old:
                break
            expect += 4
        assert rec.match(p) == expect
        rec.add(p)
        for h in _blake_chain(p, 4):
            old[h] = None
            old.move_to_end(h)
        while len(old) > 12:
            old.popitem(last=False)


def test_prefix_record() -> None:
    rec = PrefixRecord(block_size=4, capacity_blocks=3)
    rec.add(list(range(10)))                          # 2 whole blocks
    assert rec.match(list(range(9))) == 8 and rec.match([0, 1, 2, 3, 9, 9, 9, 9]) == 4 and rec.match([5]) == 0
    rec.add([50, 51, 52, 53, 54, 55, 56, 57])         # 2 more blocks: capacity 3, the oldest goes
    assert rec.match(list(range(8))) == 0


@pytest.mark.parametrize("flags, named", [
    (["--model", "no-such-dir"], "--model"),
    (["--model", "CKPT", "--vllm-python", "no/such/python"], "--vllm-python"),
    (["--model", "CKPT", "--vllm-prefill-url", "http://127.0.0.1:9"], "--vllm-decode-url"),
])
def test_bad_input_exits_2_naming_the_flag(fakes: Any, flags: list[str], named: str) -> None:
    import subprocess
    import sys

    ckpt = fakes[3]
    args = [a.replace("CKPT", str(ckpt)) for a in flags]
    res = subprocess.run([sys.executable, "-m", "reference_server", "--engine", "vllm", "--port", "0", *args],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert named in res.stderr, res.stderr[-2000:]


def test_connector_auto_is_nixl_where_it_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--kv-connector auto`` asks vLLM's python once whether ``nixl._api`` imports: a python where it does
    gets NIXL (host buffer, progress thread off on a CPU host, the module's connector class), one where it
    does not gets the example connector."""
    import sys

    from reference_server.config import ServerConfig
    from reference_server.server import connector
    from reference_server.vllm_instance import CONNECTORS_MODULE, kv_transfer_config

    cfg = ServerConfig(engine="vllm", vllm_python=sys.executable, kv_connector="auto")
    monkeypatch.setenv("PYTHONPATH", "")
    assert connector(cfg) == "example"                          # this test environment has no NIXL
    (tmp_path / "nixl").mkdir()
    (tmp_path / "nixl" / "__init__.py").write_text("")
    (tmp_path / "nixl" / "_api.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert connector(cfg) == "nixl"
    assert connector(ServerConfig(engine="vllm", vllm_python=sys.executable, kv_connector="example")) == "example"
    p, d = (kv_transfer_config("nixl", role, cpu=True) for role in ("prefill", "decode"))
    assert p is not None and d is not None
    assert (p["kv_role"], d["kv_role"]) == ("kv_producer", "kv_consumer")
    assert p["kv_connector"] == "PaasbenchNixlConnector" and p["kv_connector_module_path"] == CONNECTORS_MODULE
    assert p["kv_buffer_device"] == "cpu" and p["kv_connector_extra_config"] == {"enable_prog_thread": False}
    assert "kv_connector_extra_config" not in (kv_transfer_config("nixl", "decode", cpu=False) or {})
