"""Every Python block of the README runs, in order, in a fresh interpreter; the example policy picks
the ranks worked out by hand.
"""

from __future__ import annotations

from pathlib import Path


def test_every_python_block_of_the_readme_runs_and_the_policy_example_picks_by_hand(tmp_path: Path) -> None:
    # The README's library examples were never executed by a test. Run them all, in order, in a
    # fresh interpreter (the policy example registers a name in the global registry), then call the
    # example policy on hand-built candidates: requests [2, 0, 0] -> least loaded ranks 1 and 2,
    # tie=first picks 1, tie=last picks 2.
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    blocks = re.findall(r"```python\n(.*?)```", (root / "README.md").read_text(), re.S)
    assert len(blocks) >= 3
    check = '''
import numpy as np
from balancer.candidates import Candidates
from balancer.policies import make_policy
from balancer.policies.base import SelectContext
import random
from balancer.types import ReplicaId, Request, Role
reps = tuple(ReplicaId("e", i) for i in range(3))
z = np.zeros(3, dtype=np.int64)
c = Candidates(role=Role.DECODE, replicas=reps, num_requests=np.array([2, 0, 0]), prefill_tokens=z,
               decode_kv_tokens=z, kv_capacity_tokens=z, matched_blocks=z, matched_tokens=z, block_size=16)
ctx = SelectContext(random.Random(0))
req = Request("x", 0.0, 10)
print(make_policy("fewest_requests").select(req, c, ctx).replica.dp_rank,
      make_policy("fewest_requests", tie="last").select(req, c, ctx).replica.dp_rank)
try:  # review R14 (session 16): the example took any tie ("middle" ran as "last")
    make_policy("fewest_requests", tie="middle")
except ValueError as e:
    print("refused:", e)
'''
    script = tmp_path / "readme_blocks.py"
    script.write_text("\n".join(blocks) + check)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-2].split()[-2:] == ["1", "2"]
    assert lines[-1] == "refused: fewest_requests: tie must be 'first' or 'last', got 'middle'"
