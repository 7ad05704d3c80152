"""Step-latency models: the ``PerfModel`` protocol, the roofline, the measured-table model and
Dynamo's mocker polynomials (for comparisons with Dynamo's replay)."""

from sim.perf.base import PerfModel, causal_attn_pairs
from sim.perf.polynomial import MockerPolynomialPerf
from sim.perf.roofline import RooflinePerf
from sim.perf.table import TablePerf

__all__ = ["MockerPolynomialPerf", "PerfModel", "RooflinePerf", "TablePerf", "causal_attn_pairs"]
