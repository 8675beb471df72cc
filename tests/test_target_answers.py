"""What a target said about itself (``GET /v1/models``: the model name requests carry, the KV block size synthetic
load is sized in) is one command's view of one server, not the process's view of a URL.

A process outlives the servers it measures: a test suite, a notebook, a script that starts a server per
configuration. Ports are reused. A second server on a port a first one served from must be asked afresh, or
every request names the first server's model.
"""

from __future__ import annotations

import json
import urllib.request
from urllib.parse import urlsplit

from click.testing import CliRunner
from sse_server import SSEServer

from paasbench.cli import main
from paasbench.client import ClientConfig
from paasbench.client.models import asked_once, first_model
from paasbench.sweep import embedded
from reference_server.launcher import EmbeddedServer

SIM = ["--engine", "sim", "--sim-time-scale", "0", "--device-profile", "cpu-local", "--block-size", "64"]


def _run(url: str, out) -> tuple[int, str, dict]:
    res = CliRunner().invoke(main, ["run", "--target", url, "--isl", "256", "--osl", "2", "--rate", "20",
                                    "--max-requests", "4", "--out", str(out), "--no-live"])
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    return res.exit_code, res.output, summary


def test_a_second_server_on_a_port_the_first_served_from_is_asked_afresh(tmp_path):
    # before: the answer was kept per URL for the life of the process. A CI run of tests/test_server_join.py had
    # all 16 requests refused (http_status 16) after an earlier test's server had served on the same port.
    with EmbeddedServer([*SIM, "--model-profile", "tiny"]) as first:
        port = urlsplit(first.url).port
        code, output, summary = _run(first.url, tmp_path / "first")
        assert code == 0, output
        assert summary["meta"]["model"] == "sim-tiny"
    with EmbeddedServer([*SIM, "--model-profile", "glm-5.2-fp8", "--port", str(port)]) as second:
        assert urlsplit(second.url).port == port
        code, output, summary = _run(second.url, tmp_path / "second")
    assert code == 0, output
    assert summary["meta"]["model"] == "sim-glm-5.2-fp8" and summary["requests"]["ok"] == 4


def test_each_embedded_server_a_sweep_starts_is_asked_afresh(monkeypatch):
    # a sweep over a server flag (--server-param block-size) restarts the embedded server per value, within one
    # command; a restarted server on its predecessor's port would otherwise be sized in the old block size
    with SSEServer(models_block_size=256) as srv:
        class Same:                     # each "restart" answers on the same URL
            url = srv.url

            def __init__(self, args):
                pass

            def start(self):
                pass

            def stop(self):
                pass

        monkeypatch.setattr("reference_server.launcher.EmbeddedServer", Same)
        client = ClientConfig(target=srv.url)
        with asked_once():
            for _ in range(2):
                with embedded.embedded_server({"block_size": 64}):
                    assert first_model(client)["block_size"] == 256
                    assert first_model(client)["block_size"] == 256     # kept within the server's block
        with urllib.request.urlopen(srv.url + "/debug/gets", timeout=5) as r:
            assert json.loads(r.read()).get("/v1/models") == 2
