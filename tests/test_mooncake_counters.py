"""The Mooncake store's server-wide counters never go back when its master dies (issue 30, want 6).

With the server's own master, ``put_blocks`` is what the masters stored: the dead ones' totals carried, plus the
live one's. The router reads the master's gauges on its watch thread; a master that has just died (or has just
been restarted and is not up yet) does not answer that read. Before, an unanswered read replaced the last answer
with nothing, so (a) ``/metrics`` fell back to the workers' own count for those scrapes (put_blocks 188 -> 138 in
tests/test_server_mooncake_faults.py, two busy loops beside it), and (b) when the death was noticed a pass later
there was nothing left to carry: the dead master's 188 stores were gone from the total for good.

No Mooncake process is needed: the owner's supervision pass runs over no children, and the master's answers are
given in the order a kill produces them.
"""

from __future__ import annotations

import dataclasses
import threading

from reference_server.kv.mooncake_service import MooncakeOwner, _Child
from reference_server.kv.store import StoreStats

BLOCK = 8                                   # the sim's virtual values


def _gauges(stored: int) -> dict[str, float]:
    return {"master_total_capacity_bytes": 16 * 2 ** 20, "master_key_count": float(stored),
            "master_batch_put_end_items_total": float(stored), "master_batch_put_end_failed_items_total": 0.0,
            "master_evicted_key_count": 0.0}


def _owner(answers: list[dict[str, float]]) -> MooncakeOwner:
    owner = object.__new__(MooncakeOwner)   # no processes: only the counting is under test
    owner.children, owner._stopping = [], threading.Event()
    owner.metrics_port = 1                  # our own master
    owner.capacity_bytes, owner.segment_bytes, owner.virtual = 1024 * 2 ** 30, 16 * 2 ** 20, True
    owner._gauges, owner._evicted_before, owner._stored_before = {}, 0, 0
    owner.master_gauges = lambda: answers.pop(0)     # type: ignore[method-assign]
    return owner


def test_put_blocks_never_go_back_across_a_master_kill():
    workers = [dataclasses.asdict(StoreStats(1_953_125, BLOCK, 0, 400, 30, 69, 69 * BLOCK, 30, 30 * BLOCK, 0, 0, 0))
               for _ in range(2)]           # the workers count 138 puts between them
    owner = _owner([_gauges(188), {}, {}, _gauges(5)])
    seen = []
    owner.check()                           # the master answers: 188 stored
    seen.append(owner.stats(workers).put_blocks)
    owner.check()                           # killed: no answer, not yet seen dead
    seen.append(owner.stats(workers).put_blocks)
    owner._died(_Child("mooncake_master", None, "", None, []))   # type: ignore[arg-type]
    owner.check()                           # restarted, not up yet
    seen.append(owner.stats(workers).put_blocks)
    owner.check()                           # the new master has stored 5
    seen.append(owner.stats(workers).put_blocks)
    assert seen == [188, 188, 188, 193]
