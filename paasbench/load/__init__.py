"""Load generation: a trace's requests sent on schedule through the streaming client, their records gathered.

Imports run one way, from the driver down:

- :mod:`.runner` — the driver: ``run_load`` (one run, its workers, the summary);
- :mod:`.fleet` — the driver's side of the workers: ``Fleet`` (records into one file, live view, abort, lost
  workers), the ``Pool`` protocol and the inline one-worker pool;
- :mod:`.workers`, :mod:`.ray_workers` — pools of worker processes here, or of Ray actors on a cluster;
- :mod:`.shard` — what the driver and every worker share: the worker spec, the message encoding, the worker that
  sends one shard of the schedule;
- :mod:`.schedule` (arrival times, sessions, shards), :mod:`.prompts` (hash ids → prompt text), :mod:`.abort`
  (SLO abort rule), :mod:`.live` (progress and the live view) — the pieces below them.

Nothing here imports ``paasbench.load`` back from a lower module (tests/test_import_graph.py).
"""
