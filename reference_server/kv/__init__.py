"""KV cache manager (block prefix cache) and KV transfer (wire format, FP8, shm and TCP transports).

Engine-independent: blocks are ids into the engine's pool, KV moves as arrays or
:class:`~reference_server.engine.base.VirtualKV` through ``Engine.read_blocks`` / ``write_blocks``.
Format and guarantees: ``docs/kv.md``.
"""
