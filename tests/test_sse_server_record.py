"""The fake server's body record is what tests count requests by, so taking it must never lose a body.

``take_bodies`` once read the record and then truncated it; a body the server appended between the two was gone.
Under a take loop that polls while requests arrive (as tests/test_run_cmd.py's kill test does) that dropped about
a quarter of 400 bodies, and the kill test once saw 30 of its 31 requests arrive."""
from __future__ import annotations

import json
import threading
import urllib.request

from sse_server import SSEServer


def test_taking_bodies_while_requests_arrive_loses_none(tmp_path):
    sent = 240
    with SSEServer(ttft_ms=0, itl_ms=0, record=tmp_path / "bodies.jsonl") as srv:
        taken: list[dict] = []
        done = threading.Event()

        def take() -> None:
            while not done.is_set():
                taken.extend(srv.take_bodies())

        def send(first: int) -> None:
            for i in range(first, sent, 6):
                body = json.dumps({"prompt": "x", "max_tokens": 1, "stream": True, "i": i}).encode()
                req = urllib.request.Request(srv.url + "/v1/completions", data=body,
                                             headers={"content-type": "application/json"})
                urllib.request.urlopen(req, timeout=30).read()

        taker = threading.Thread(target=take)
        taker.start()
        senders = [threading.Thread(target=send, args=(k,)) for k in range(6)]
        for t in senders:
            t.start()
        for t in senders:
            t.join(timeout=120)
        done.set()
        taker.join(timeout=30)
        taken += srv.take_bodies()       # every request was answered, so its body is on disk
    assert sorted(b["i"] for b in taken) == list(range(sent))
