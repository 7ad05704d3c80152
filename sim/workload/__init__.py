"""Workloads for the simulator: trace readers, synthetic generators and pure transforms.

Readers turn request traces into :class:`~balancer.types.Request` lists:

* :func:`read_mooncake` - Mooncake JSONL (arrival ms, lengths, per-block prefix ids);
* :func:`read_azure` - Azure LLM inference 2023 CSV (no prefix information);
* :func:`read_trace` - either, by format or extension; with no path, the embedded Mooncake
  conversation trace (:func:`default_trace_path`).

Malformed files raise :class:`TraceFormatError` naming ``file:line``.
:func:`poisson_workload` generates synthetic traffic; :func:`shared_prefix_workload` and
:func:`load_ramp_workload` the standard router benchmarks (shared-prefix groups, stepped ramps); :func:`session_workload` multi-turn
chatbot and agent sessions over days (:func:`write_mooncake` saves any workload as JSONL); :func:`scale_rate`, :func:`take_slice`
and :func:`spread_batches` transform request lists without mutating them;
:func:`ideal_hit_rate` is the infinite-cache prefix hit rate of a workload.
"""

from .analysis import ideal_hit_rate
from .benchmarks import load_ramp_workload, shared_prefix_workload
from .azure import parse_azure_timestamp_ns, read_azure
from .errors import TraceFormatError
from .loader import DEFAULT_TRACE_NAME, TRACE_FORMATS, default_trace_path, read_trace
from .mooncake import MOONCAKE_BLOCK_SIZE, read_mooncake
from .sessions import SessionClassConfig, SessionWorkloadConfig, session_workload, workload_summary
from .synthetic import poisson_workload
from .transform import scale_rate, spread_batches, take_slice
from .writer import write_mooncake

__all__ = [
    "DEFAULT_TRACE_NAME",
    "MOONCAKE_BLOCK_SIZE",
    "TRACE_FORMATS",
    "TraceFormatError",
    "default_trace_path",
    "ideal_hit_rate",
    "load_ramp_workload",
    "shared_prefix_workload",
    "parse_azure_timestamp_ns",
    "poisson_workload",
    "read_azure",
    "read_mooncake",
    "read_trace",
    "SessionClassConfig",
    "SessionWorkloadConfig",
    "session_workload",
    "scale_rate",
    "spread_batches",
    "take_slice",
    "workload_summary",
    "write_mooncake",
]
