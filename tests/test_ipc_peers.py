"""Worker-to-worker control connections (:class:`reference_server.ipc.Peers`): a prefill worker's ``kv`` notes
to a decode worker, the built-in engines' and ``--engine vllm``'s alike. When the decode side closes the
connection (its reader ended on a bad frame, the worker restarted on the same port), the next note goes on a
new connection: it must not vanish into a socket nobody reads, leaving the decode request waiting for its KV."""

from __future__ import annotations

import threading
import time
from typing import Any

from reference_server.ipc import Conn, Peers, serve_blocking

TOKEN = "per-launch-t0ken-4f2a"


def test_a_note_after_the_peer_closed_goes_on_a_new_connection() -> None:
    got: list[str] = []
    arrived = threading.Event()

    def on_message(conn: Conn, msg: dict[str, Any], blob: bytes) -> None:
        got.append(msg["rid"])
        arrived.set()
        if msg["rid"] == "a":
            raise ConnectionError("this reader ends")      # serve_blocking closes the connection

    srv, port = serve_blocking("127.0.0.1", TOKEN, on_message)
    try:
        peers = Peers(TOKEN)
        first = peers.get("127.0.0.1", port)
        first.send({"op": "kv", "rid": "a"})
        assert arrived.wait(5)
        arrived.clear()
        deadline = time.monotonic() + 5       # the drain thread sees the close (bounded wait, not a sleep)
        while not first.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        peers.get("127.0.0.1", port).send({"op": "kv", "rid": "b"})
        assert arrived.wait(5), f"the note after the close was lost (got {got})"
        assert got == ["a", "b"]
    finally:
        srv.close()
