"""The regression gate: is CURRENT worse than BASELINE, metric by metric, beyond noise?

- :mod:`.compare` — the judgement behind ``paasbench gate``: two sets of results, per metric, and its
  Markdown/HTML verdict;
- :mod:`.stats` — the change between two sets of runs with a Student-t interval on log ratios, paired or not,
  and Holm's correction across metrics;
- :mod:`.fingerprint` — what machine a result ran on and how fast it is, so a slower machine is not read as
  slower code;
- :mod:`.ab` — the rounds behind ``paasbench ab``: two installs measured interleaved on one machine.
"""
