"""A policy that breaks its contract (returns no valid ``Choice``) is a ``PolicyError`` naming it,
in the library and in ``pdlb sim``; the simulator tells a stall from such an error by SimPy's own
message. Expected messages are written out by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest


_TRACE = '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'


def _bad_policy_router(result):
    from dataclasses import dataclass

    from balancer import Choice, Policy, ReplicaId, Router

    @dataclass(frozen=True)
    class Bad(Policy):  # not registered: passed to Router as an object
        name = "bad"

        def select(self, request, cands, ctx):
            return result(cands) if callable(result) else result

    r = Router(Bad(), Bad(), block_size=16)
    r.add_replica(ReplicaId("p", 0), "prefill")
    r.add_replica(ReplicaId("d", 0), "decode")
    return r, Choice, ReplicaId


@pytest.mark.parametrize("kind", ["unknown replica", "None", "a string", "a bare ReplicaId"])
def test_a_policy_that_returns_no_valid_choice_is_a_policy_error_and_counts_nothing(kind: str) -> None:
    # was a KeyError from the router's position map (unknown replica) or an AttributeError
    # ('NoneType' object has no attribute 'reason'), a traceback deep inside simpy in pdlb sim
    from balancer import PolicyError, ReplicaId, Request
    from balancer.types import Choice

    result = {"unknown replica": Choice(ReplicaId("nope", 0), reason="x"), "None": None, "a string": "d",
              "a bare ReplicaId": ReplicaId("d", 0)}[kind]
    r, _, _ = _bad_policy_router(result)
    with pytest.raises(PolicyError) as ei:
        r.route(Request("q1", 0.0, 32, (1, 2)), now_s=0.0)
    msg = str(ei.value)
    assert msg.startswith("policy 'bad' (decode pool) ") and "request 'q1'" in msg
    if kind == "unknown replica":
        assert "chose ReplicaId(engine='nope', dp_rank=0)" in msg and "not one of its 1 candidates" in msg
    else:
        assert msg.endswith("not a balancer.Choice")
    m = r.metrics()
    assert m["in_flight"] == 0 and m["decisions"] == {"prefill": {}, "decode": {}} and m["index_blocks"] == 0


def test_pdlb_sim_names_a_user_policy_that_breaks_its_contract(tmp_path: Path, monkeypatch, capsys) -> None:
    import sys

    from pdlb_cli.main import main

    pkg = tmp_path / "r9pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "pol.py").write_text(
        "from dataclasses import dataclass\n"
        "from balancer.policies.base import Policy, register\n"
        "from balancer.types import Choice, ReplicaId\n"
        "@register\n@dataclass(frozen=True)\nclass R9Bad(Policy):\n    name = 'r9_bad'\n"
        "    def select(self, request, cands, ctx):\n        return Choice(ReplicaId('nope', 0), reason='x')\n")
    (tmp_path / "t.jsonl").write_text(_TRACE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    from balancer.policies.base import _REGISTRY

    try:
        rc = main(["sim", "run", "--policy-module", "r9pkg.pol", "--policy", "r9_bad", "--trace", "t.jsonl",
                   "--scenario", "llama8b-agg-h100", "--quiet", "--no-plots", "--out", "o"])
    finally:  # the registry is global: leave no test policy for the tests that list every policy
        _REGISTRY.pop("r9_bad", None)
        sys.modules.pop("r9pkg.pol", None)
        sys.modules.pop("r9pkg", None)
    err = capsys.readouterr().err
    assert rc == 2 and err == ("error: policy 'r9_bad' (decode pool) chose ReplicaId(engine='nope', dp_rank=0) for "
                               "request 'r0', which is not one of its 8 candidates\n")


def test_simpys_stall_is_the_error_the_cluster_recognises() -> None:
    # sim.run.cluster tells a stall from any other RuntimeError by what simpy raised it while
    # handling (its EmptySchedule: the event queue ran dry before the "until" event), not by text;
    # every other error (a PolicyError at the last arrival) was once reported as "simulation stalled"
    import simpy

    env = simpy.Environment()
    with pytest.raises(RuntimeError) as ei:
        env.run(until=env.event())
    assert isinstance(ei.value.__context__, simpy.core.EmptySchedule)

    def fails(env: simpy.Environment):  # noqa: ANN202
        yield env.timeout(1)
        raise RuntimeError("a modelling bug")

    env = simpy.Environment()
    env.process(fails(env))
    with pytest.raises(RuntimeError) as ei:
        env.run(until=env.event())
    assert str(ei.value) == "a modelling bug" and not isinstance(ei.value.__context__, simpy.core.EmptySchedule)
