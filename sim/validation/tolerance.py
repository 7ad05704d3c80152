"""The pass band of ``pdlb sim validate``'s tables: a simulated figure passes when its relative
error against the published (or measured) one is within ``TOLERANCE`` (+-15%).

One constant for :mod:`sim.validation.published`, :mod:`sim.validation.agentx` and :mod:`sim.validation.gpu_runs`, in a
module of its own so that none of them imports another for it.
"""

from __future__ import annotations

#: relative error within which a figure passes (0.15 = +-15%)
TOLERANCE = 0.15
