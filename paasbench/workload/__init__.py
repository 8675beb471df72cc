"""Agent workloads: YAML specs (``spec.py``), distributions (``dist.py``) and the trace generator."""

from paasbench.workload.dist import Dist
from paasbench.workload.generator import generate_trace
from paasbench.workload.spec import Arrivals, WorkloadSpec, list_workloads, load_workload, parse_spec

__all__ = ["Arrivals", "Dist", "WorkloadSpec", "generate_trace", "list_workloads", "load_workload",
           "parse_spec"]
