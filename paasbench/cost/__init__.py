"""The cost side: what a measured capacity costs and earns, and how it reads against a published claim.

- :mod:`.table` — the revenue / cost table: max input TPM under the SLO → money, every formula printed (docs/cost.md);
- :mod:`.claim` — a published claim (the white paper's) side by side with a sweep's figures and assumptions.
"""
