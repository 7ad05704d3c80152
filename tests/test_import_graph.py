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
package; ``sim/scenario.py`` imports ``balancer.validation``, ``sim.models.presets``, ``sim.perf.config``
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
    """The longest module of ``mods`` that ``name`` starts with (``sim.search.point.SLO`` -> ``sim.search.point``)."""
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
    assert set(edges["sim.scenario"]) == {"balancer.config", "balancer.validation", "sim.models.hardware",
                                          "sim.models.presets", "sim.perf.config", "sim.perf.spec"}
    # balancer.config: its [router] table; sim.models.hardware: the hardware name checked at load
    # a function-level import counts: sim.search.point imports sim.run.cluster inside functions only
    # (_make_router_factory, _result_of, evaluate_point)
    assert "sim.run.cluster" in edges["sim.search.point"]


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
    "sim.perf.config": ("sim.scenario", "sim.run.pool_perf", "sim.run.cluster"),
    "sim.perf.spec": ("sim.scenario", "sim.run.pool_perf", "sim.perf.config", "sim.run.cluster"),
    "sim.run.router_cost": ("sim.run.cluster", "pdlb_cli", "sim.search.point"),
    "sim.validation.agentx": ("sim.validation.published",),
    "balancer.service.processes.kv_ring": ("balancer.service",),
    "balancer.service.kv_subscriber": ("balancer.service.processes.kv_fanout",),
    # argument types and option groups: nothing above the scenario and its perf model
    "pdlb_cli.args": ("sim.run.cluster", "sim.search.point", "sim.search.executor", "sim.run.report",
                      "sim.run.metrics", "sim.run.router_cost", "sim.search.capacity", "sim.search.sweep",
                      "pdlb_cli.command", "pdlb_cli.main", "pdlb_cli.sim",
                      "pdlb_cli.serve", "pdlb_cli.engine", "pdlb_cli.policies"),
    # pdlb-serve runs with the serve extra only: nothing of the simulator (test_install_extras runs it so)
    "pdlb_cli.serve": ("sim", "pdlb_cli.args", "pdlb_cli.main"),
    # the admission option group, shared by pdlb serve and pdlb sim: nothing of the simulator either
    "pdlb_cli.admission_args": ("sim", "pdlb_cli.args", "pdlb_cli.main", "pdlb_cli.sim", "pdlb_cli.serve"),
    "pdlb_cli.command": ("sim", "balancer", "pdlb_cli.args", "pdlb_cli.main", "pdlb_cli.sim"),
}


@pytest.mark.parametrize("module", sorted(FLOORS))
def test_lower_module_imports_nothing_above_it(graph, module: str) -> None:
    edges, _ = graph
    bad = {b: line for b, line in edges[module].items()
           if any(b == f or b.startswith(f + ".") for f in FLOORS[module])}
    assert not bad, f"{module} imports {bad} (module: first line)"


#: the simulator's floors, lowest first: a module imports only modules of its own floor or lower
#: ones (docs/ARCHITECTURE.md draws them). workload and models are both ground floors (neither
#: imports the other); the tools at the top (validation, experiments, the engine emulator,
#: pricing) may use everything below them.
SIM_FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("workload", ("sim.workload",)),
    ("models", ("sim.models",)),
    ("perf", ("sim.perf",)),
    ("scenario", ("sim.scenario", "sim.overrides")),
    ("run", ("sim.run",)),
    ("search", ("sim.search",)),
    ("tools", ("sim.validation", "sim.experiments", "sim.emulator", "sim.pricing")),
)
#: upward edges not removed yet (importer, imported): the test fails on one not listed here and on
#: a listed one that is gone. None left (the perf floor's build module, which reads a Scenario, became the run
#: floor's sim.run.pool_perf).
SIM_FLOOR_EXCEPTIONS: set[tuple[str, str]] = set()


def sim_floor(module: str) -> int | None:
    """The floor number of a ``sim`` module (its index in SIM_FLOORS), None for ``sim`` itself;
    a ``sim`` module on no floor is an error (every new module must be given one)."""
    if module == "sim":
        return None
    for i, (_, prefixes) in enumerate(SIM_FLOORS):
        if any(_in(module, p) for p in prefixes):
            return i
    raise AssertionError(f"{module} is on no floor of SIM_FLOORS (put it in a floor's package)")


def upward_edges(edges: dict[str, dict[str, int]]) -> dict[tuple[str, str], int]:
    """Every edge ``a -> b`` between ``sim`` modules with ``b`` on a higher floor than ``a``."""
    out: dict[tuple[str, str], int] = {}
    for a, targets in edges.items():
        if not _in(a, "sim") or sim_floor(a) is None:
            continue
        for b, line in targets.items():
            if _in(b, "sim") and sim_floor(b) is not None and sim_floor(b) > sim_floor(a):
                out[(a, b)] = line
    return out


def test_sim_floors_never_import_upwards(graph) -> None:
    edges, _ = graph
    up = upward_edges(edges)
    new = {e: line for e, line in up.items() if e not in SIM_FLOOR_EXCEPTIONS}
    assert not new, "lower floors importing higher ones (module: first line):\n" + "\n".join(
        f"  {a}:{line} imports {b} ({SIM_FLOORS[sim_floor(a)][0]} -> {SIM_FLOORS[sim_floor(b)][0]})"
        for (a, b), line in sorted(new.items()))
    gone = SIM_FLOOR_EXCEPTIONS - set(up)
    assert not gone, f"no longer upward, delete them from SIM_FLOOR_EXCEPTIONS: {sorted(gone)}"


def test_sim_top_level_is_the_floors_only() -> None:
    # every sim module lives on a floor: the top of sim/ holds only the floors' packages and the
    # scenario floor's two modules (sim/ had 25 top-level modules before issue 27 step 4)
    top = sorted(p.name for p in (ROOT / "sim").iterdir()
                 if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file())
    assert top == ["emulator", "experiments", "models", "overrides.py", "perf", "pricing", "run", "scenario.py",
                   "search", "validation", "workload"]
    for module in _modules():
        if _in(module, "sim"):
            sim_floor(module)  # raises for a module on no floor


def test_floor_check_finds_an_upward_edge() -> None:
    # hand-made graphs: perf importing the run is upward (floor 2 -> 4); the run importing perf
    # and a module importing its own floor are not
    assert upward_edges({"sim.perf.roofline": {"sim.run.cluster": 7}}) == {("sim.perf.roofline", "sim.run.cluster"): 7}
    assert upward_edges({"sim.run.cluster": {"sim.perf.roofline": 3, "sim.run.records": 4},
                         "sim.workload.loader": {"sim.workload.azure": 1}}) == {}
    with pytest.raises(AssertionError, match="on no floor"):
        sim_floor("sim.somewhere_new")


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
    # available_policies); sim/cli.py and sim/search/capacity_report.py read _REGISTRY before
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


#: subcommand modules import the argument types and option groups (pdlb_cli.args, and
#: pdlb_cli.admission_args, which pdlb serve shares) and the protocol, never each other; the registries (main, sim.main) import the subcommands they list
CLI_REGISTRIES = {"pdlb_cli.main", "pdlb_cli.sim.main", "pdlb_cli.dev.main"}
#: the one sharing between subcommands: compare runs its policies with run's machinery
CLI_SHARED = {("pdlb_cli.sim.compare", "pdlb_cli.sim.run")}


def test_subcommand_modules_do_not_import_each_other(graph) -> None:
    edges, _ = graph
    floor = {"pdlb_cli", "pdlb_cli.args", "pdlb_cli.admission_args", "pdlb_cli.command", "pdlb_cli.sim"}
    bad = [(a, b) for a, out in edges.items() if _in(a, "pdlb_cli") and a not in CLI_REGISTRIES | floor
           for b in out if _in(b, "pdlb_cli") and b not in floor and (a, b) not in CLI_SHARED]
    assert not bad, bad


#: the command-line parser modules: argparse is the command line's (pdlb_cli), never a library's
def _argparse_importers() -> list[str]:
    return sorted(m for m, ns in import_graph()[1].items() if not _in(m, "pdlb_cli")
                  for n, _ in ns if _in(n, "argparse"))


def test_no_library_module_builds_a_parser() -> None:
    # the developer scripts' parsers (python -m sim.experiments.*, sim/validation/gpu_runs.py,
    # sim/emulator/hostile.py) moved to pdlb dev's modules (pdlb_cli/dev/)
    assert _argparse_importers() == []
