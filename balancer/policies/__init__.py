"""Routing policies, one module each, registered by name.

>>> from balancer.policies import make_policy, available_policies
>>> available_policies()
['cache_aware', 'consistent_hash', 'dp_consistent_hash', 'ep_aware', 'kv_cost', 'least_load', 'power_of_two', 'random', 'round_robin', 'scored']
"""

from balancer.policies import (  # noqa: F401  (imported for registration)
    cache_aware,
    consistent_hash,
    dp_consistent_hash,
    ep_aware,
    kv_cost,
    least_load,
    power_of_two,
    random_choice,
    round_robin,
    scored,
)
from balancer.policies.base import Policy, SelectContext, available_policies, load_values, make_policy, register

__all__ = ["Policy", "SelectContext", "available_policies", "load_values", "make_policy", "register"]
