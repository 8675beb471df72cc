"""KV transports: shared memory on one host (:mod:`.shm`), TCP across hosts (:mod:`.tcp`).

Both move :func:`reference_server.kv.codec.encode` messages, verify them with
:func:`~reference_server.kv.codec.decode` on arrival, report :class:`TransferStats` per request, and
deliver a :class:`Received` whose ``error`` (a ``KVIntegrityError``) tells the worker to recompute.
"""

from reference_server.kv.transport.common import Link, Received, TransferStats
from reference_server.kv.transport.shm import ShmRef, ShmSender, shm_receive
from reference_server.kv.transport.tcp import KVAuthError, KVReceiver, KVSender, Mailbox

__all__ = ["KVAuthError", "KVReceiver", "KVSender", "Link", "Mailbox", "Received", "ShmRef", "ShmSender",
           "TransferStats", "shm_receive"]
