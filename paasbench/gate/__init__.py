"""The regression gate: is CURRENT worse than BASELINE, metric by metric, beyond noise?

- :mod:`.compare` — the judgement behind ``paasbench gate``: two sets of results, per metric, and its
  Markdown/HTML verdict;
- :mod:`.stats` — change of the median with a bootstrap interval, and the paired (round-by-round) variant;
- :mod:`.ab` — the rounds behind ``paasbench ab``: two installs measured interleaved on one machine.
"""
