"""``paasbench plan``: from a traffic and an SLO to a purchase -- prefill and decode instances and machines, priced,
beside the colocated and chunked deployments that meet the same SLO, verified on the twin.

``traffic`` (the request mix, with its prefix reuse) · ``probes`` and ``measure`` (pool curves, measured) · ``rapid``
(curves from the model alone) · ``curves`` (the curves file) · ``queueing`` (the headroom a percentile needs) ·
``sizing`` (the disaggregated pools) · ``alternatives`` (colocated, chunked) · ``price`` (machines per type) ·
``assemble`` (plan.json) · ``verify`` (on the twin; commands for a real target) · ``twin`` (the twin's flags) ·
``report`` (plan.html / plan.md). Method and formulas: docs/plan.md.
"""
