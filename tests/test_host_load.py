"""paasbench/gate/host_load.py: the other work the machine did while a run measured, read from /proc."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from paasbench.gate.host_load import _TICK, HostLoad, between, sample

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_the_machines_other_work_is_measured_and_read_back():
    """A child's CPU (the embedded server is the sweep's child) is the run's own, a detached process's is not."""
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass"
    a = sample()
    subprocess.run([sys.executable, "-c", spin], check=True)
    b = sample()
    assert (b.own_ticks - a.own_ticks) / _TICK >= 0.5           # reaped: counted through cutime
    a = sample()
    subprocess.run(["sh", "-c", f"{sys.executable} -c '{spin}' & echo $! > /dev/null"], check=True)   # orphaned
    time.sleep(1.5)
    b = sample()
    assert (b.own_ticks - a.own_ticks) / _TICK < 0.3 and (b.busy_ticks - a.busy_ticks) / _TICK >= 0.5
    load = between(a, b)
    assert load is not None and load.others_cpus >= 0.3 and load.cpus >= 1
    assert HostLoad.from_json(load.to_json()) == load and HostLoad.from_json({"cpus": 2}) is None
