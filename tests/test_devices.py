"""The per-worker device map: explicit --prefill-devices/--decode-devices, the one-device-per-worker
default, and clear refusals (exit 2, naming the numbers) when the host has fewer devices. Device
counts are injected, so this runs on any CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from reference_server.config import ServerConfig
from reference_server.devices import DeviceMapError, check_devices, device_map, parse_devices


def cfg(**kw) -> ServerConfig:
    return ServerConfig(backend="torch", device=kw.pop("device", "cuda"), **kw)


def test_default_is_one_device_per_worker_prefill_first():
    m = device_map(cfg(workers=4), count=8)
    assert m == {"prefill": ("cuda:0", "cuda:1"), "decode": ("cuda:2", "cuda:3")}
    assert device_map(cfg(mode="chunked", workers=3), count=3) == {"mixed": ("cuda:0", "cuda:1", "cuda:2")}
    assert device_map(cfg(workers=3, prefill_workers=1), count=3) == {"prefill": ("cuda:0",), "decode": ("cuda:1", "cuda:2")}


def test_explicit_map_and_sharing():
    m = device_map(cfg(workers=4, prefill_devices=(0, 1), decode_devices=(2, 3)), count=4)
    assert m == {"prefill": ("cuda:0", "cuda:1"), "decode": ("cuda:2", "cuda:3")}
    # only decode given: prefill takes the first devices the map leaves free
    m = device_map(cfg(workers=2, decode_devices=(0,)), count=2)
    assert m == {"prefill": ("cuda:1",), "decode": ("cuda:0",)}
    # sharing one device is allowed when asked for explicitly
    m = device_map(cfg(workers=2, prefill_devices=(0,), decode_devices=(0,), device="musa"), count=1)
    assert m == {"prefill": ("musa:0",), "decode": ("musa:0",)}
    assert device_map(cfg(workers=2, device="cuda:1"), count=2) == {"prefill": ("cuda:1",), "decode": ("cuda:1",)}


@pytest.mark.parametrize("kw,count,match", [
    (dict(workers=4, prefill_devices=(0, 1), decode_devices=(2, 3)), 2, r"--decode-devices 2,3: device\(s\) 2,3 do not exist; this host has 2 cuda device\(s\) \(0-1\)"),
    (dict(workers=4), 3, r"2 prefill \+ 2 decode worker\(s\) need 4 cuda device\(s\), one each, but this host has 3"),
    (dict(workers=4, prefill_devices=(0,)), 4, r"--prefill-devices 0 names 1 device\(s\) for 2 prefill worker\(s\)"),
    (dict(workers=2, device="cuda:2"), 2, r"--device cuda:2: this host has 2 cuda device\(s\) \(0-1\)"),
    (dict(workers=2), 0, r"need 2 cuda device\(s\), one each, but this host has 0"),
    (dict(mode="chunked", workers=2, decode_devices=(0, 1)), 2, "applies to --mode disaggregated"),
])
def test_refusals_name_the_numbers(kw, count, match):
    with pytest.raises(DeviceMapError, match=match):
        device_map(cfg(**kw), count=count)


def test_cpu_and_backend_rules():
    assert device_map(ServerConfig(workers=2), count=1) == {"prefill": ("cpu",), "decode": ("cpu",)}
    with pytest.raises(DeviceMapError, match="need an accelerator"):
        device_map(ServerConfig(workers=2, decode_devices=(0,)), count=1)
    with pytest.raises(DeviceMapError, match="needs --backend torch"):
        check_devices(ServerConfig(device="cuda"), lambda kind: 8)
    calls = []
    assert check_devices(cfg(workers=2, device="musa"), lambda kind: calls.append(kind) or 2)["decode"] == ("musa:1",)
    assert calls == ["musa"]


def test_parse_devices():
    assert parse_devices("0, 2,3") == (0, 2, 3) and parse_devices(None) is None
    with pytest.raises(ValueError, match="device indices"):
        parse_devices("0,x")


def test_serve_refuses_missing_devices_with_exit_2():
    """On this machine (no CUDA device, maybe no torch) the CLI exits 2 with one line, before any worker."""
    r = subprocess.run([sys.executable, "-m", "reference_server", "--backend", "torch", "--device", "cuda",
                        "--port", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "field '--device'" in r.stderr and ("is_available() is False" in r.stderr or "needs torch" in r.stderr)
    r = subprocess.run([sys.executable, "-m", "reference_server", "--prefill-devices", "0,a"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "device indices" in r.stderr
    r = subprocess.run([sys.executable, "-m", "reference_server", "--kv-dtype", "fp8_e4m3"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "field '--kv-dtype'" in r.stderr and "needs --backend torch" in r.stderr
