"""No capability probes in balancer/ and sim/: what an object can do is declared on its protocol
or class (``Policy.uses_load``, ``PerfModel.wants_prefill_cached_tokens``, ...), never guessed with
``getattr(obj, "name", default)``. The check reads every module's AST; the exceptions are listed
by module and attribute with the reason (objects of other libraries, Python's own introspection),
so a new probe fails the suite."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("balancer", "sim")

#: (module path, attribute) -> why probing is right there
ALLOWED: dict[tuple[str, str], str] = {
    ("balancer/validation.py", "__args__"): "typing's annotations (Python introspection)",
    ("sim/search/sweep.py", "__args__"): "typing's annotations (Python introspection)",
    ("sim/emulator/engine.py", "__slots__"): "a class's slots (Python introspection)",
    ("balancer/validation.py", "problem_mark"): "PyYAML's MarkedYAMLError fields (another library's error)",
    ("balancer/validation.py", "problem"): "PyYAML's MarkedYAMLError fields",
    ("balancer/validation.py", "context"): "PyYAML's MarkedYAMLError fields",
    ("balancer/validation.py", "context_mark"): "PyYAML's MarkedYAMLError fields",
    ("balancer/service/app.py", "message"): "aiohttp's HTTP exceptions (another library's error)",
    ("balancer/service/metrics.py", "_multiprocess"): "prometheus_client's value class (another library)",
    ("balancer/service/body_offload.py", "_processes"): "the standard library's ProcessPoolExecutor",
    ("sim/search/executor.py", "_processes"): "the standard library's ProcessPoolExecutor",
}

#: Probes on pdlb's own objects not yet declared on a protocol, by count (none left: the KV event
#: subscriber's kinds declare ``ring_writer``, ``writer_stats``, ``error``, ``alive``; the service
#: knows which feed it built).
OPEN: dict[tuple[str, str], int] = {}


def probes_in(source: str) -> list[tuple[str, int]]:
    """``(attribute, line)`` of every ``getattr(obj, "<literal>", default)`` call in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and len(node.args) == 3 and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)):
            out.append((node.args[1].value, node.lineno))
    return out


def _all_probes() -> dict[tuple[str, str], list[int]]:
    found: dict[tuple[str, str], list[int]] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for attr, line in probes_in(path.read_text()):
                found.setdefault((rel, attr), []).append(line)
    return found


def test_the_finder_finds_probes_and_only_probes() -> None:
    """A hand-made module: the two probes with a literal and a default are found (one nested in a
    method); a two-argument getattr, a computed name and a method named getattr are not."""
    src = '''
x = getattr(obj, "uses_load", True)
y = getattr(obj, "uses_load")
z = getattr(obj, name, None)
w = self.getattr(obj, "a", 1)
class C:
    def f(self):
        return getattr(self.perf, "wants", False)
'''
    assert probes_in(src) == [("uses_load", 2), ("wants", 8)]


def test_no_capability_probes_in_balancer_and_sim() -> None:
    found = _all_probes()
    new = {k: v for k, v in found.items() if k not in ALLOWED and k not in OPEN}
    assert not new, ("getattr(obj, 'name', default) probes: declare the capability on the protocol or class "
                     f"instead (or list a real exception in ALLOWED with its reason): {new}")
    grown = {k: (len(found[k]), n) for k, n in OPEN.items() if len(found.get(k, ())) > n}
    assert not grown, f"more probes than listed as open: {grown}"


def test_the_router_and_the_simulator_probe_nothing() -> None:
    """The policy core and the simulator's perf models declare what they offer: no probe at all
    (allowed or open) in balancer/router.py, balancer/parts.py, sim/run/cluster.py, sim/run/router_cost.py,
    sim/perf/."""
    found = _all_probes()
    core = [k for k in found if k[0] in ("balancer/router.py", "balancer/parts.py", "sim/run/cluster.py",
                                         "sim/run/router_cost.py") or k[0].startswith("sim/perf/")]
    assert core == []
