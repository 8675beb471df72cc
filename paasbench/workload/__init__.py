"""Agent workloads: YAML specs (``spec.py``), distributions (``dist.py``) and the trace generator.

The names below load on first use (PEP 562), so importing ``paasbench.workload.options`` for a command's
options does not pay for numpy and yaml: ``paasbench --help`` stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"Dist": "dist", "generate_trace": "generator", "Arrivals": "spec", "WorkloadSpec": "spec",
          "list_workloads": "spec", "load_workload": "spec", "parse_spec": "spec"}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'paasbench.workload' has no attribute {name!r}")
    return getattr(importlib.import_module(f"paasbench.workload.{_WHERE[name]}"), name)
