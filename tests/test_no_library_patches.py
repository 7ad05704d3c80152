"""No patches of aiohttp's server in balancer/ and sim/: pdlb extends aiohttp only through what
aiohttp documents (its server, runner and connection classes subclassed, their public methods
overridden: ``balancer/service/app_server.py``), never by assigning to an aiohttp object's
attributes or class (issue 27: ``runner.server.__class__ = ...``, ``server.request_handler = ...``,
``server.connection_made = ...`` were such patches).

The check reads every module's AST. The names it guards are taken from the installed aiohttp at
test time (an independent source: the attributes, methods and slots of ``web.Server``,
``web.RequestHandler``, the runners, ``web.Application`` and ``web.BaseSite``). Flagged:

* any assignment to ``<anything>.__class__``;
* an assignment to ``<obj>.<name>`` or ``setattr(<obj>, "<name>", ...)`` where ``<name>`` is one
  of those names and ``<obj>`` is not ``self`` (what pdlb sets on an object of its own is set in
  that object's own methods);
* ``self.<name> = ...`` with such a name inside a class whose bases come from aiohttp (a subclass
  keeps its own state under its own names and leaves aiohttp's alone).
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("balancer", "sim")
CLASSES = (web.Server, web.RequestHandler, web.BaseRunner, web.AppRunner, web.ServerRunner, web.Application,
           web.BaseSite)

#: (module path, attribute) -> why the assignment is not a patch of aiohttp (none today)
ALLOWED: dict[tuple[str, str], str] = {}


def _aiohttp_names() -> frozenset[str]:
    """Every attribute name aiohttp's server classes define: class attributes and methods
    (``dir``), slots, and the instance attributes a ``web.Server`` sets in its ``__init__``."""
    names: set[str] = set()
    for cls in CLASSES:
        names |= {n for n in dir(cls) if not (n.startswith("__") and n.endswith("__"))}
        for k in cls.__mro__:
            slots = k.__dict__.get("__slots__", ())
            names |= {slots} if isinstance(slots, str) else set(slots)

    async def server_attrs() -> set[str]:
        async def handler(request: web.BaseRequest) -> web.StreamResponse:
            return web.Response()

        return set(vars(web.Server(handler)))

    names |= asyncio.run(server_attrs())
    return frozenset(names)


NAMES = _aiohttp_names()


def _aiohttp_bound_names(tree: ast.Module) -> set[str]:
    """Names a module binds to aiohttp: ``import aiohttp [as x]``, ``from aiohttp[.y] import z``."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "aiohttp"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "aiohttp":
            out |= {a.asname or a.name for a in node.names}
    return out


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def patches_in(source: str, names: frozenset[str] = NAMES) -> list[tuple[str, int]]:
    """``(attribute, line)`` of every assignment in ``source`` that patches an aiohttp object (the
    three kinds of the module docstring)."""
    tree = ast.parse(source)
    from_aiohttp = _aiohttp_bound_names(tree)
    out: list[tuple[str, int]] = []

    def targets(node: ast.AST) -> list[ast.expr]:
        if isinstance(node, ast.Assign):
            flat: list[ast.expr] = []
            for t in node.targets:
                flat += t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]
            return flat
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            return [node.target]
        return []

    def visit(node: ast.AST, in_aiohttp_subclass: bool) -> None:
        if isinstance(node, ast.ClassDef):
            in_aiohttp_subclass = any(_root_name(b) in from_aiohttp for b in node.bases)  # its methods inherit it
        for t in targets(node):
            if not isinstance(t, ast.Attribute):
                continue
            is_self = isinstance(t.value, ast.Name) and t.value.id == "self"
            if t.attr == "__class__" or (t.attr in names and (not is_self or in_aiohttp_subclass)):
                out.append((t.attr, t.lineno))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)):
            attr = node.args[1].value
            is_self = isinstance(node.args[0], ast.Name) and node.args[0].id == "self"
            if attr == "__class__" or (attr in names and (not is_self or in_aiohttp_subclass)):
                out.append((attr, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, in_aiohttp_subclass)

    visit(tree, False)
    return sorted(out, key=lambda p: p[1])


def test_the_names_come_from_aiohttp() -> None:
    # the attributes the three patches of issue 27 assigned, and what a subclass would overwrite
    assert {"request_handler", "connection_made", "request_factory", "_loop", "_kwargs", "log_exception",
            "handle_error", "_server"} <= NAMES
    assert "limit_connections" not in NAMES and "_max_connections" not in NAMES  # pdlb's own


def test_the_finder_finds_the_old_patches_and_not_subclassing() -> None:
    """A hand-made module: the three patches issue 27 removed, a class-level method patch, a
    ``setattr`` and a subclass overwriting aiohttp's state are found; a subclass keeping its own
    state, overriding methods, reading aiohttp's attributes, and pdlb's own classes setting
    ``self._loop`` are not."""
    src = '''
from aiohttp import web, web_protocol
import aiohttp as ah

def patch(runner, server, accept):
    runner.server.__class__ = Json
    server.request_handler = fast(server.request_handler)
    server.connection_made = accept
    web_protocol.RequestHandler.log_exception = print
    setattr(server, "request_factory", None)

class Sub(web.Server):
    def __init__(self, h):
        super().__init__(h)
        self._mine = 1
        self._kwargs = {}
    def connection_made(self, handler, transport):
        n = len(self.connections)
        super().connection_made(handler, transport)

class Runner(ah.web.ServerRunner):
    def setup(self):
        self._server = None

class Own:
    def __init__(self, loop):
        self._loop = loop
        self.debug = False
'''
    assert patches_in(src) == [("__class__", 6), ("request_handler", 7), ("connection_made", 8),
                               ("log_exception", 9), ("request_factory", 10), ("_kwargs", 16),
                               ("_server", 23)]


def test_no_aiohttp_patches_in_balancer_and_sim() -> None:
    found: dict[tuple[str, str], list[int]] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for attr, line in patches_in(path.read_text()):
                found.setdefault((rel, attr), []).append(line)
    new = {k: v for k, v in found.items() if k not in ALLOWED}
    assert not new, ("assignments to aiohttp objects' attributes or class: subclass and override public "
                     f"methods instead (balancer/service/app_server.py), or list a real exception in ALLOWED: {new}")
