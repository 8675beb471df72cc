"""paasbench: check Prefill-as-a-Service throughput, latency and cost claims on your own stack."""

__version__ = "0.1.0"
