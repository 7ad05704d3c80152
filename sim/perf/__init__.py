"""Step-latency models: the ``PerfModel`` protocol, the roofline, and the measured-table model."""

from sim.perf.base import PerfModel, causal_attn_pairs
from sim.perf.roofline import RooflinePerf
from sim.perf.table import TablePerf

__all__ = ["PerfModel", "RooflinePerf", "TablePerf", "causal_attn_pairs"]
