"""Metrics and SLOs: what a run measured, and whether it met its objectives.

- :mod:`.records` — one ``RequestRecord`` per request, written as the request finishes (``records.jsonl``);
- :mod:`.summary` — records → ``summary.json``: every figure defined once (docs/metrics.md);
- :mod:`.slo` — gate expressions, verdicts, and the per-request goodput limits gates imply (docs/slo.md).

Importing this package imports none of them (pandas waits in :mod:`.summary`, which load workers never import).
"""
