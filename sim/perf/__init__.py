"""Step-latency models: the ``PerfModel`` protocol and its roofline implementation."""

from sim.perf.base import PerfModel, causal_attn_pairs
from sim.perf.roofline import RooflinePerf

__all__ = ["PerfModel", "RooflinePerf", "causal_attn_pairs"]
