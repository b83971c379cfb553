"""The package's import graph: one direction through the layers, and no cycle, lazy or not.

Every module of ``dpstream`` is parsed (never imported) and every ``import`` statement in it
counts: at module level, inside functions and methods, and under ``if TYPE_CHECKING:`` (no
exemption is needed: none of those points upward, so they are held to the same rule). An
import of a module also depends on the packages above it (``import dpstream.a.b`` runs
``dpstream/a/__init__.py``), except the root package: ``dpstream/__init__.py`` is the public
facade, at the top (it imports the platform only inside :func:`dpstream.load_config`).

The layers, lowest first (a module may import its own layer and the ones below):

``base``: errors and message shapes; ``core``: the mechanisms (numpy only); ``glue``: what
every kind shares: the Bytewax operators (``stream``), Kafka (``io``), metrics, the client,
and the modules they need; ``config``: the shared tables and the flow instance;
``interface``: the :class:`~dpstream.kind.FlowKind` protocol; ``kinds``: the flow kinds,
each in its own room (``dpstream.kinds.<name>``, importing no other kind);
``platform``: the registry and the dataflow any kind runs on; ``apps``: the runner, the
command line, the demo, the live page and the package facade.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import dpstream

PACKAGE = Path(dpstream.__file__).parent

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("dpstream.errors", "dpstream.messages", "dpstream.schemas")),
    ("core", ("dpstream.core",)),
    ("glue", ("dpstream.stream", "dpstream.io", "dpstream.metrics", "dpstream.topology",
              "dpstream.store_lock", "dpstream.estimator", "dpstream.client",
              "dpstream.query_client")),
    ("config", ("dpstream.config", "dpstream.instance")),
    ("interface", ("dpstream.kind",)),
    ("kinds", ("dpstream.kinds",)),
    ("platform", ("dpstream.platform", "dpstream.backlog", "dpstream.bounds")),
    ("apps", ("dpstream.runner", "dpstream.cli", "dpstream.demo", "dpstream.web",
              "dpstream.flows", "dpstream")),
]

# Upward imports allowed for now (none: the restructuring removed the last ones). An entry
# that no longer occurs fails the test, so that this list can only shrink.
PENDING: frozenset[tuple[str, str]] = frozenset()


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its ``__init__``)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ["dpstream", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """The package modules ``name`` imports (each with its line), at any depth of its code."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from package import module`` imports the module; ``from module import name``
            # the module
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        for target in targets:
            while target not in known and "." in target:  # ``import a.b.c`` of a name
                target = target.rsplit(".", 1)[0]
            if target not in known or target == name:
                continue
            yield target, node.lineno
            parent = target.rsplit(".", 1)[0]
            while parent != "dpstream" and "." in parent:  # the packages it runs first
                if parent != name and not name.startswith(parent + "."):
                    yield parent, node.lineno
                parent = parent.rsplit(".", 1)[0]


def graph() -> dict[str, dict[str, int]]:
    """``{module: {imported module: line of its first import}}``."""
    known = modules()
    edges: dict[str, dict[str, int]] = {}
    for name, path in known.items():
        edges[name] = {}
        for target, line in imported(name, path, known):
            edges[name].setdefault(target, line)
    return edges


def layer_of(module: str) -> int:
    """The index of the layer of ``module`` (the longest matching prefix decides)."""
    best, level = -1, -1
    for i, (_label, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or (prefix != "dpstream"
                                           and module.startswith(prefix + "."))
            if matches and len(prefix) > best:
                best, level = len(prefix), i
    if level < 0:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")
    return level


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def upward(edges: dict[str, dict[str, int]]) -> list[tuple[str, str, int]]:
    """Every import of a module from a higher layer: (importer, imported, line)."""
    return sorted((source, target, line) for source, targets in edges.items()
                  for target, line in targets.items()
                  if layer_of(target) > layer_of(source))


def test_every_module_is_in_a_layer() -> None:
    for module in modules():
        layer_of(module)


def test_no_import_cycle() -> None:
    edges = graph()
    found = cycles(edges)
    lines = []
    for component in found:
        members = set(component)
        lines.append("cycle: " + ", ".join(component) + "\n" + "\n".join(
            f"    {a} -> {b} (line {edges[a][b]})" for a in component for b in edges[a]
            if b in members))
    assert not found, "import cycles (lazy imports included):\n" + "\n".join(lines)


def test_imports_point_down_the_layers() -> None:
    found = upward(graph())
    wrong = [(a, b, line) for a, b, line in found
             if not any(a == pa and (b == pb or pb.startswith(b + ".")) for pa, pb in PENDING)]
    assert not wrong, "imports from a lower layer to a higher one:\n" + "\n".join(
        f"  {a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]}), line {line}"
        for a, b, line in wrong)
    stale = PENDING - {(a, b) for a, b, _line in found}
    assert not stale, f"no longer imported, remove from PENDING: {sorted(stale)}"


def test_each_kind_keeps_to_its_own_room() -> None:
    """A kind imports no other kind: what two kinds share lives in a lower layer."""
    def room(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if len(parts) > 2 and parts[1] == "kinds" else None

    wrong = [f"{a} imports {b}, line {line}" for a, targets in graph().items()
             for b, line in targets.items() if room(a) and room(b) and room(a) != room(b)]
    assert not wrong, "a kind imports another kind:\n" + "\n".join(wrong)


def test_no_dynamic_import() -> None:
    """No ``importlib.import_module`` or ``__import__``: an import the graph cannot see.

    (The registry of flow kinds once named its modules as strings, hiding a six-module loop
    ``config -> kinds -> kinds.* -> platform``.)
    """
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                called = (func.attr if isinstance(func, ast.Attribute)
                          else func.id if isinstance(func, ast.Name) else "")
                if called in ("import_module", "__import__"):
                    found.append(f"{name}, line {node.lineno}")
    assert not found, "dynamic imports: " + "; ".join(found)


def test_the_graph_sees_lazy_relative_and_type_checking_imports(tmp_path: Path) -> None:
    """The parser finds every kind of import statement (on a small package of its own)."""
    package = tmp_path / "dpstream"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "high.py").write_text("")
    (package / "sub" / "mid.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import high\n"
        "if TYPE_CHECKING:\n    from dpstream.low import x\n"
        "def f():\n    import dpstream.sub.high as h\n    from ..low import y\n")
    known = {"dpstream": package / "__init__.py", "dpstream.low": package / "low.py",
             "dpstream.sub": package / "sub" / "__init__.py",
             "dpstream.sub.high": package / "sub" / "high.py",
             "dpstream.sub.mid": package / "sub" / "mid.py"}
    found = {target for target, _line in imported("dpstream.sub.mid", known["dpstream.sub.mid"],
                                                  known)}
    assert found == {"dpstream.sub.high", "dpstream.low"}
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [
        ["a", "b", "c"]]
