"""The import graph of ``balancer``, ``sim`` and ``pdlb_cli``, read from the source with :mod:`ast`
(nothing is imported): no import circle, whether the imports are at module level, inside functions
or under ``if TYPE_CHECKING:``; ``balancer`` never imports ``sim``; ``balancer``'s core (everything
outside ``balancer/service/``) imports neither ``balancer.service``, the network libraries nor the
clock; nothing below the command line imports ``pdlb_cli``; the command line imports at module
level only (no import inside a function, so none can hide a circle or a layer broken at run time).

An edge ``a -> b`` is any ``import b``/``import b.c``/``from b import x`` written anywhere in module
``a``, where ``b`` is the longest module of the two packages that the imported name starts with;
``from pkg import sub`` is an edge to ``pkg.sub`` when ``sub`` is a module. A parent package that
Python runs on the way (``sim/__init__.py`` before ``sim.scenario``) is not an edge: every
submodule would otherwise form a circle with its package.

Independent check (by hand, reading the files): ``balancer/types.py`` imports nothing of either
package; ``sim/scenario.py`` imports ``balancer.validation``, ``sim.models``, ``sim.perf.config``
and ``sim.perf.spec`` and nothing else of them (``test_edges_match_hand_reading`` compares).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("balancer", "sim", "pdlb_cli")
#: what balancer's core (outside balancer/service/) must not import: the simulator, the service,
#: network and event-loop libraries, the clock (time is passed in) and the operating system (no I/O)
CORE_FORBIDDEN = ("sim", "balancer.service", "aiohttp", "zmq", "asyncio", "socket", "time", "datetime", "os",
                  "subprocess")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package ``__init__``), for every ``.py`` file of PACKAGES."""
    mods: dict[str, tuple[Path, bool]] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return mods


def _imported_names(path: Path, module: str, is_pkg: bool) -> list[tuple[str, int]]:
    """Every dotted name imported anywhere in the file, with its line (``from a import b`` gives
    ``a.b``; relative imports resolved against ``module``)."""
    package = module if is_pkg else module.rpartition(".")[0]
    out: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            out += [(f"{source}.{a.name}", node.lineno) for a in node.names]
    return out


def _resolve(name: str, mods: dict) -> str | None:
    """The longest module of ``mods`` that ``name`` starts with (``sim.point.SLO`` -> ``sim.point``)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> tuple[dict[str, dict[str, int]], dict[str, list[tuple[str, int]]]]:
    """(edges: module -> {imported module of the packages: first line}, every imported name per module)."""
    mods = _modules()
    edges: dict[str, dict[str, int]] = {}
    names: dict[str, list[tuple[str, int]]] = {}
    for module, (path, is_pkg) in mods.items():
        names[module] = _imported_names(path, module, is_pkg)
        out = edges.setdefault(module, {})
        for name, line in names[module]:
            target = _resolve(name, mods)
            if target is not None and target != module:
                out.setdefault(target, line)
    return edges, names


def circles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(edges.get(w, {}))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def _describe(comp: list[str], edges: dict[str, dict[str, int]]) -> str:
    return "\n".join(f"  {a}:{line} imports {b}" for a in comp for b, line in sorted(edges[a].items()) if b in comp)


@pytest.fixture(scope="module")
def graph():
    return import_graph()


#: circles not broken yet: the test fails when one appears that is not listed here, and when a
#: listed one is gone (then delete it here)
KNOWN_CIRCLES: set[frozenset[str]] = set()


def test_no_import_circle(graph) -> None:
    edges, _ = graph
    found = circles(edges)
    new = [c for c in found if frozenset(c) not in KNOWN_CIRCLES]
    assert not new, "import circles (break each by moving the shared part into a module below both):\n" + \
        "\n".join(f"{len(c)} modules {c}:\n{_describe(c, edges)}" for c in new)
    gone = KNOWN_CIRCLES - {frozenset(c) for c in found}
    assert not gone, f"no longer circles, delete them from KNOWN_CIRCLES: {sorted(map(sorted, gone))}"


def test_circle_finder_finds_known_shapes() -> None:
    # hand-made graphs with their components worked out by hand: a 3-cycle with a tail, a
    # self-free 2-cycle, and a DAG (none)
    assert circles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}}) == [["a", "b", "c"]]
    assert circles({"x": {"y": 1}, "y": {"x": 1}, "z": {"x": 1}}) == [["x", "y"]]
    assert circles({"a": {"b": 1, "c": 1}, "b": {"c": 1}, "c": {}}) == []


def test_edges_match_hand_reading(graph) -> None:
    edges, _ = graph
    # read by hand from the files' import lines (module docstring)
    assert set(edges["balancer.types"]) == set()
    assert set(edges["sim.scenario"]) == {"balancer.validation", "sim.models", "sim.perf.config", "sim.perf.spec"}
    # a function-level import counts: sim.point imports sim.cluster inside functions only
    # (_make_router_factory, _result_of, evaluate_point)
    assert "sim.cluster" in edges["sim.point"]


def test_balancer_never_imports_sim(graph) -> None:
    _, names = graph
    bad = [(m, n, line) for m, ns in names.items() if m.split(".")[0] == "balancer"
           for n, line in ns if n == "sim" or n.startswith("sim.")]
    assert not bad, bad


def test_balancer_core_imports_no_service_network_or_clock(graph) -> None:
    _, names = graph
    bad = [(m, n, line) for m, ns in names.items()
           if m.split(".")[0] == "balancer" and not (m == "balancer.service" or m.startswith("balancer.service."))
           for n, line in ns if any(n == f or n.startswith(f + ".") for f in CORE_FORBIDDEN)]
    assert not bad, bad


#: module -> modules (or package prefixes) it must not import, even inside a function or for
#: types only: the lower side of each circle broken for issue 27
FLOORS: dict[str, tuple[str, ...]] = {
    "sim.perf.config": ("sim.scenario", "sim.perf.build", "sim.cluster"),
    "sim.perf.spec": ("sim.scenario", "sim.perf.build", "sim.perf.config", "sim.cluster"),
    "sim.cost_model": ("sim.cluster", "pdlb_cli", "sim.point"),
    "sim.validate_agentx": ("sim.validate",),
    "balancer.service.kv_ring": ("balancer.service",),
    "balancer.service.kv_subscriber": ("balancer.service.kv_fanout",),
    # argument types and option groups: nothing above the scenario and its perf model
    "pdlb_cli.args": ("sim.cluster", "sim.point", "sim.executor", "sim.report", "sim.metrics", "sim.cost_model",
                      "sim.capacity", "sim.sweep", "pdlb_cli.command", "pdlb_cli.main", "pdlb_cli.sim",
                      "pdlb_cli.serve", "pdlb_cli.engine", "pdlb_cli.policies"),
    # pdlb-serve runs with the serve extra only: nothing of the simulator (test_install_extras runs it so)
    "pdlb_cli.serve": ("sim", "pdlb_cli.args", "pdlb_cli.main"),
    "pdlb_cli.command": ("sim", "balancer", "pdlb_cli.args", "pdlb_cli.main", "pdlb_cli.sim"),
}


@pytest.mark.parametrize("module", sorted(FLOORS))
def test_lower_module_imports_nothing_above_it(graph, module: str) -> None:
    edges, _ = graph
    bad = {b: line for b, line in edges[module].items()
           if any(b == f or b.startswith(f + ".") for f in FLOORS[module])}
    assert not bad, f"{module} imports {bad} (module: first line)"


# ---------------------------------------------------------------------- the router's one builder
def _calls_and_private_imports() -> tuple[list[str], list[str]]:
    """Across PACKAGES: every call ``Router(...)`` (``module:line``) and every ``from X import _name``
    of a private name from another module (``module:line name``)."""
    calls, private = [], []
    for module, (path, _) in _modules().items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Router":
                calls.append(f"{module}:{node.lineno}")
            if isinstance(node, ast.ImportFrom) and node.module is not None and node.module != module:
                private += [f"{module}:{node.lineno} {a.name}" for a in node.names if a.name.startswith("_")]
    return calls, private


def test_every_router_is_built_from_a_router_config() -> None:
    # balancer.router.Router.from_config is the one builder: no module of balancer or sim calls
    # Router(...) itself (the service and the simulator used to, each with its own defaults)
    calls, _ = _calls_and_private_imports()
    assert calls == []  # (from_config's own cls(...) is not a call of the name Router)
    # the finder does see such a call (hand-written source)
    assert [n.lineno for n in ast.walk(ast.parse("x = 1\nr = Router('a', block_size=64)\n"))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "Router"] == [2]


def test_no_module_imports_the_policy_registry() -> None:
    # policies are reached through balancer.policies.base's public functions (policy_class,
    # available_policies); sim/cli.py and sim/capacity_report.py read _REGISTRY before
    _, private = _calls_and_private_imports()
    assert [p for p in private if p.endswith(" _REGISTRY")] == []
    assert any(p.endswith(" _REGISTRY") for p in _private_imports_of("import_graph_registry_probe", "from balancer.policies.base import _REGISTRY\n"))


def _private_imports_of(module: str, source: str) -> list[str]:
    """The check above on one hand-written module (that it can fail)."""
    return [f"{module}:{n.lineno} {a.name}" for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)
            for a in n.names if a.name.startswith("_")]


def _in(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_nothing_below_the_command_line_imports_it(graph) -> None:
    edges, _ = graph
    bad = [(a, b, line) for a, out in edges.items() if not _in(a, "pdlb_cli")
           for b, line in out.items() if _in(b, "pdlb_cli")]
    assert not bad, bad


#: the one import the command line may make inside a function: matplotlib, whose backend must be
#: chosen (``matplotlib.use("Agg")``) before ``matplotlib.pyplot`` is imported
CLI_DEFERRED_IMPORTS = ("matplotlib",)


def _function_level_imports(path: Path) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for fn in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    out += [(a.name, node.lineno) for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    out.append((("." * node.level) + (node.module or ""), node.lineno))
    return sorted(set(out), key=lambda x: x[1])


def test_function_level_imports_are_found() -> None:
    # a hand-made module: two imports inside functions (one nested, one async), one at module level
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "m.py"
        f.write_text("import os\n\ndef a():\n    def b():\n        from sim import point\n    return b\n\n"
                     "async def c():\n    import json\n")
        assert _function_level_imports(f) == [("sim", 5), ("json", 9)]


def test_the_command_line_imports_at_module_level_only() -> None:
    bad = [f"{path.relative_to(ROOT)}:{line} imports {name} inside a function"
           for path in sorted((ROOT / "pdlb_cli").rglob("*.py"))
           for name, line in _function_level_imports(path)
           if not any(_in(name, d) for d in CLI_DEFERRED_IMPORTS)]
    assert not bad, "\n".join(bad)


#: subcommand modules import the argument types and option groups (pdlb_cli.args) and the
#: protocol, never each other; the registries (main, sim.main) import the subcommands they list
CLI_REGISTRIES = {"pdlb_cli.main", "pdlb_cli.sim.main"}
#: the one sharing between subcommands: compare runs its policies with run's machinery
CLI_SHARED = {("pdlb_cli.sim.compare", "pdlb_cli.sim.run")}


def test_subcommand_modules_do_not_import_each_other(graph) -> None:
    edges, _ = graph
    floor = {"pdlb_cli", "pdlb_cli.args", "pdlb_cli.command", "pdlb_cli.sim"}
    bad = [(a, b) for a, out in edges.items() if _in(a, "pdlb_cli") and a not in CLI_REGISTRIES | floor
           for b in out if _in(b, "pdlb_cli") and b not in floor and (a, b) not in CLI_SHARED]
    assert not bad, bad
