"""Keys and tenants (reference_server/auth.py): the tenant comes from the key, so no caller can read
another tenant's prefix cache through cached_tokens; keys come from files or the environment, not argv;
malformed key files exit 2 naming file and line without echoing a key; a non-loopback bind without a
key is warned about."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reference_server.auth import Auth, exposure_warning, load_auth
from reference_server.launcher import EmbeddedServer
from server_client import get, stream

ALICE, BOB, SOLO = "alice-k3y-0001", "bob-k3y-0002", "solo-k3y-0003"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    (d / "keys").write_text(f"# key tenant\n{ALICE} alice\n\n{BOB} bob   # the second tenant\n")
    (d / "key").write_text(SOLO + "\n")
    args = ["--mode", "chunked", "--workers", "1", "--block-size", "64",
            "--api-keys-file", str(d / "keys"), "--api-key-file", str(d / "key")]
    with EmbeddedServer(args, startup_timeout_s=90) as s:
        yield s


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_cross_tenant_probe_sees_no_cached_tokens(server):
    prompt = list(range(7000, 7901))                                # 901 tokens: 14 full blocks reusable
    body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    first = stream(server.url, body, headers=bearer(ALICE))
    again = stream(server.url, body, headers=bearer(ALICE))
    probe = stream(server.url, body, headers={**bearer(BOB), "x-tenant": "alice"})   # claims to be alice
    solo = stream(server.url, body, headers={**bearer(SOLO), "x-tenant": "alice"})
    assert first.usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert again.usage["prompt_tokens_details"]["cached_tokens"] == 896          # alice's own cache
    assert probe.status == 200 and probe.usage["prompt_tokens_details"]["cached_tokens"] == 0   # before: 896
    assert solo.usage["prompt_tokens_details"]["cached_tokens"] == 0
    bob_again = stream(server.url, body, headers=bearer(BOB))
    assert bob_again.usage["prompt_tokens_details"]["cached_tokens"] == 896      # bob's blocks are bob's


def test_every_key_source_authenticates_and_none_is_on_the_command_line(server):
    for key in (ALICE, BOB, SOLO):
        assert get(server.url, "/v1/models", bearer(key))[0] == 200
    assert get(server.url, "/v1/models")[0] == 401
    assert get(server.url, "/v1/models", bearer("alice"))[0] == 401          # a tenant name is not a key
    cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes().decode(errors="replace")
    assert "--api-keys-file" in cmdline and not any(k in cmdline for k in (ALICE, BOB, SOLO))
    status, body = get(server.url, "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}           # before: worker ports and pids
    assert "workers" in json.loads(get(server.url, "/health", bearer(BOB))[1])


@pytest.mark.parametrize("text,line,why", [
    ("k1 alice\nk2\n", 2, "expected 'KEY TENANT', got 1 field(s)"),
    ("k1 alice\nk1 bob\n", 2, "listed again"),
    ("# nothing\n", None, "no keys"),
])
def test_malformed_keys_file_exits_2_naming_the_line_and_not_the_key(tmp_path, text, line, why):
    f = tmp_path / "keys"
    f.write_text(text)
    res = subprocess.run([sys.executable, "-m", "reference_server", "--api-keys-file", str(f), "--port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    where = f"{f}:{line}" if line else str(f)
    assert where in res.stderr and why in res.stderr and "--api-keys-file" in res.stderr
    assert "k1" not in res.stderr and "k2" not in res.stderr


def test_tenant_rules():
    keyed = load_auth(api_key="k")
    assert keyed.tenant("k", "alice").startswith("key:")                 # the header does not count
    assert keyed.check("nope") is None and keyed.required
    trusted = Auth({"k": "t"}, trust_tenant_header=True)                  # behind a gateway
    assert trusted.tenant("k", "alice") == "alice" and trusted.tenant("k", None) == "t"
    assert Auth().tenant(None, "alice") == "default" and not Auth().required
    assert "k" not in repr(keyed)


def test_non_loopback_bind_without_a_key_is_warned_about():
    assert exposure_warning("127.0.0.1", Auth()) is None and exposure_warning("::1", Auth()) is None
    assert exposure_warning("localhost", Auth()) is None
    assert "no API key" in exposure_warning("0.0.0.0", Auth())
    assert "no API key" in exposure_warning("10.1.2.3", Auth())
    assert exposure_warning("0.0.0.0", load_auth(api_key="k")) is None
