"""Expert-load imbalance of a synchronous wide-EP step after EPLB (max over EP ranks / mean).

Every MoE layer of a wide-EP step is a barrier: dispatch, routed experts and combine finish when the
busiest GPU does, so the layer costs ``gamma = max_r load_r / mean_r load_r`` times the balanced
routed-expert compute and dispatch/combine traffic (load = routed token copies an EP rank receives).
After EPLB (DeepSeek's redundant-experts placement, deepseek-ai/EPLB) two things keep ``gamma`` above 1:

* the placement's residual error: EPLB packs expert replicas onto GPUs from *estimated* loads, in
  whole slots; the error of one GPU's load is ``sigma_sys = residual_std / sqrt(slots per GPU)``
  (independent slot errors average over the slots a GPU holds), with ``residual_std`` the relative
  std of one slot's share;
* routing noise of the step's own tokens: ``T`` tokens each choose ``k`` distinct experts of ``E``;
  one token's copies on a rank holding ``E/G`` of them are hypergeometric, mean ``k/G``, variance
  ``k (1/G)(1 - 1/G)(E - k)/(E - 1)``, so the rank's relative variance is
  ``v = (G/k) (1 - 1/G) (E - k)/(E - 1) / T`` (uniform routing; larger batches are more balanced).

With Gaussian rank loads, the expected maximum of ``G`` ranks is ``z(G)`` standard deviations above
the mean (Blom's approximation ``z(G) = Phi^-1((G - 0.375)/(G + 0.25))``)::

    gamma(G, T) = 1 + z(G) * sqrt(sigma_sys^2 + v(T))

Source of ``residual_std`` (the only measured number): NVIDIA TensorRT-LLM tech blog 4, "Scaling
Expert Parallelism in TensorRT-LLM (Part 1)", Table 1 (DeepSeek-R1, 32 GB200, machine-translation
dataset, average over layers and iterations of the per-layer metrics), offline EPLB with 9 slots per
rank at EP32 (288 slots = 256 experts + 32 redundant): routed tokens per rank mean 1,024, std 52.0,
imbalance ratio (max - mean)/mean 0.109. At EP32, 1,024 copies per rank are ``T = 4,096`` tokens, whose
routing noise is 3.03% of the mean; the rest of the published 5.08% is the placement's:
``sigma_sys = sqrt(0.0508^2 - 0.0303^2) = 4.07%`` at 9 slots, ``residual_std = 0.0407 * 3 = 0.122``.

Checks against the same table (not used to derive anything): the formula gives max/mean 1.105 at
EP32 (published 1.109) and, for its EP36 / 8-slots row, std 54.1 and 1.112 (published 53.9 and 1.115).

Not modelled: correlation between the tokens of one request (it makes a step's noise larger than
the uniform-routing ``v``), drift of the traffic away from the statistics the placement was
computed from, placements without EPLB (TensorRT-LLM's table: max/mean 2.56 at EP32; use
``ep_imbalance_prefill`` / ``ep_imbalance_decode`` for a fixed factor instead).
"""

from __future__ import annotations

from statistics import NormalDist

import numpy as np
from numpy.typing import ArrayLike

#: TensorRT-LLM tech blog 4, Table 1, "EPLB (9 per-rank slots and EP 32)": DeepSeek-R1 routed tokens
#: per rank, average of the per-layer per-iteration metrics
TRTLLM_EPLB_EP = 32
TRTLLM_EPLB_SLOTS = 288
TRTLLM_EPLB_MEAN_COPIES = 1024.0
TRTLLM_EPLB_STD_COPIES = 52.0
TRTLLM_EPLB_IMBALANCE_RATIO = 0.109  # (max - mean) / mean
#: DeepSeek-V3/R1 routing: 256 routed experts, top-8 (config.json)
_V3_EXPERTS, _V3_TOPK = 256, 8


def expected_max_std_normal(n: int) -> float:
    """Expected maximum of ``n`` independent standard normal draws (Blom's approximation
    ``Phi^-1((n - 0.375) / (n + 0.25))``; 0 for ``n = 1``). E.g. 2.07 for 32, 2.11 for 36.

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n!r}")
    if n == 1:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def routing_noise_rel_var(ep_size: int, tokens: ArrayLike, num_experts: int, experts_per_token: int) -> np.ndarray:
    """Relative variance (variance / mean^2) of one EP rank's routed copies when ``tokens`` tokens
    each pick ``experts_per_token`` distinct experts uniformly of ``num_experts`` spread evenly over
    ``ep_size`` ranks (hypergeometric per token; see the module docstring). ``tokens`` broadcasts;
    0 tokens give 0 (no step, no noise).

    Raises:
        ValueError: sizes < 1 or ``experts_per_token > num_experts``.
    """
    if min(ep_size, num_experts, experts_per_token) < 1 or experts_per_token > num_experts:
        raise ValueError("ep_size, num_experts, experts_per_token must be >= 1 and experts_per_token <= num_experts")
    g, e, k = float(ep_size), float(num_experts), float(experts_per_token)
    per_token = (g / k) * (1.0 - 1.0 / g) * ((e - k) / (e - 1.0) if e > 1 else 0.0)
    t = np.asarray(tokens, dtype=np.float64)
    return np.where(t > 0, per_token / np.where(t > 0, t, 1.0), 0.0)


def eplb_residual_std(ep_size: int, slots: int, mean_copies: float, std_copies: float,
                      num_experts: int = _V3_EXPERTS, experts_per_token: int = _V3_TOPK) -> float:
    """``residual_std`` (relative std of one slot's share of a GPU's load after EPLB) from a measured
    per-rank std of routed copies: the measured relative variance minus the routing noise of
    the step's ``T = ep_size * mean_copies / experts_per_token`` tokens, times the slots per GPU.

    Raises:
        ValueError: the measured std is below the routing noise alone.
    """
    tokens = ep_size * mean_copies / experts_per_token
    noise = float(routing_noise_rel_var(ep_size, tokens, num_experts, experts_per_token))
    sys_var = (std_copies / mean_copies) ** 2 - noise
    if sys_var < 0:
        raise ValueError(f"measured std {std_copies} is below the routing noise alone ({mean_copies * noise ** 0.5:.1f})")
    return float(np.sqrt(sys_var * slots / ep_size))


#: residual_std derived from TensorRT-LLM's EP32 / 288-slot measurement (0.1222)
EPLB_RESIDUAL_STD = eplb_residual_std(TRTLLM_EPLB_EP, TRTLLM_EPLB_SLOTS, TRTLLM_EPLB_MEAN_COPIES,
                                      TRTLLM_EPLB_STD_COPIES)


def eplb_imbalance(ep_size: int, tokens: ArrayLike, *, num_experts: int, experts_per_token: int,
                   physical_experts: int, residual_std: float = EPLB_RESIDUAL_STD) -> np.ndarray:
    """Expected max/mean routed load over the ``ep_size`` ranks of one synchronous dispatch of
    ``tokens`` tokens (broadcasts) after EPLB with ``physical_experts`` slots (routed experts +
    redundant ones): ``1 + z(G) sqrt(residual_std^2 G / physical_experts + v(T))``. 1 for one rank.

    Raises:
        ValueError: ``physical_experts < num_experts``, ``residual_std < 0`` or bad sizes.
    """
    if physical_experts < num_experts:
        raise ValueError(f"physical_experts ({physical_experts}) must be >= num_experts ({num_experts})")
    if residual_std < 0:
        raise ValueError("residual_std must be >= 0")
    sys_var = residual_std ** 2 * ep_size / physical_experts
    var = sys_var + routing_noise_rel_var(ep_size, tokens, num_experts, experts_per_token)
    return 1.0 + expected_max_std_normal(ep_size) * np.sqrt(var)
