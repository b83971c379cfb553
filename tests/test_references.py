"""Every ``dpstream.…`` reference in the prose resolves to something that exists.

Modules and names move; the prose that names them (docstrings, comments, README.md, docs/,
bench/, deploy/, tools/) is checked here so a move cannot leave a dangling pointer behind.
The source is parsed with :mod:`ast`, never imported.

What counts as a reference (the rules, few and precise):

* **a dotted name** ``dpstream.a.b…`` not preceded by a word character, ``.``, ``/`` or ``-``,
  whose first part ``a`` is a top-level module or package of dpstream. Names whose first part
  is not (a logger ``dpstream.kafka``, the tick key ``dpstream.tick``, a schema name
  ``dpstream.release``) are not code references and are left alone; so is any name followed
  by ``/`` (a schema tag such as ``dpstream.release/1``).
* **a path** ``dpstream/…`` to a directory (it ends in ``/``) or to a file with an extension
  the package's own files have (``.py``, ``.json``, ``.html``…; a ``dpstream/x.yml`` in a
  container's configuration is not in the package).
* **a short role** in a dpstream module's docstring or comment: the target of a Python role
  (``:mod:``, ``:class:``, ``:func:``, ``:data:``, ``:meth:``, ``:attr:``, ``:exc:``) that
  does not start with ``dpstream.``: ``:meth:`update```, ``:meth:`Class.method```,
  ``:class:`~.module.Class```. It resolves against the class the text is in (and the classes
  around it), the module (its own and imported names), or its package, or one above. A target
  whose first part is a builtin (``int``) or a module outside dpstream (``datetime.datetime``,
  ``msgspec.Struct``: found with :func:`importlib.util.find_spec`, never imported) is not
  checked.

In a ``.py`` file only its comments and its bare string statements (module, class, function
and attribute docstrings) are read; Markdown and the other text files are read whole.

A dotted name resolves when its longest module prefix is a module (``x.py``) or package
(``x/__init__.py``) under dpstream/, and what follows names, in turn: something defined or
imported at the module's top level (imports from dpstream modules are followed); then, inside
a class, a method, a class-level assignment or annotation, a nested class, or a ``self.x``
set in one of its methods, or any of that in one of its base classes. The name after a
module (not a package) must be defined there, not merely imported: a dotted name points at
the home of what it names (a package's ``__init__`` may re-export). A path resolves when the
file or directory exists.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import io
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dpstream"

DOTTED = re.compile(r"(?<![\w./-])dpstream((?:\.[A-Za-z_]\w*)++)(?!/)")
PATH = re.compile(r"(?<![\w./-])dpstream/((?:[\w.-]+/)*[\w-]+\.\w+|(?:[\w.-]+/)+)")
SHORT = re.compile(r":(?:mod|class|func|data|meth|attr|exc):`~?"
                   r"(\.?[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)`")

# History, not prose to keep current.
EXCLUDED = ("NOTES.md", "bench/results/", "docs/upgrading.md",  # history: names old homes
            "bench/baselines/.venv-")  # a baseline's own environment (third-party code)
TEXT_SUFFIXES = frozenset({".md", ".toml", ".yml", ".yaml", ".sh", ".json", ".txt", ".cfg"})


@dataclass(frozen=True)
class Reference:
    file: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.text}"


# --- where the prose is ----------------------------------------------------------------------

def prose_files() -> list[Path]:
    files = [*PACKAGE.rglob("*.py"), ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    for folder in ("bench", "deploy", "tools"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and (path.suffix in TEXT_SUFFIXES | {".py"}
                                   or path.name == "Dockerfile"):
                files.append(path)
    chosen = []
    for path in files:
        relative = path.relative_to(ROOT).as_posix()
        if not any(relative == e or relative.startswith(e) for e in EXCLUDED):
            chosen.append(path)
    return sorted(set(chosen))


def prose_lines(path: Path) -> Iterator[tuple[int, str]]:
    """The (line number, text) of the prose in ``path``."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    if path.suffix != ".py":
        yield from enumerate(lines, start=1)
        return
    for node in ast.walk(parsed(path)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            end = node.end_lineno or node.lineno
            for number in range(node.lineno, end + 1):
                yield number, lines[number - 1]
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def references(path: Path) -> Iterator[tuple[Reference, str]]:
    """Each reference in ``path`` with its kind, ``dotted``, ``path`` or ``short``."""
    relative = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    in_package = path.suffix == ".py" and path.is_relative_to(PACKAGE)
    for number, text in prose_lines(path):
        for match in DOTTED.finditer(text):
            parts = match.group(1)[1:].split(".")
            if top_level_module(parts[0]):
                yield Reference(relative, number, match.group(0)), "dotted"
        for match in PATH.finditer(text):
            target = match.group(0)
            if target.endswith("/") or Path(target).suffix in package_suffixes():
                yield Reference(relative, number, target), "path"
        if in_package:
            for match in SHORT.finditer(text):
                target = match.group(1)
                if target.startswith("dpstream."):
                    continue  # a dotted name, checked above
                first = target.split(".")[0]
                if not target.startswith(".") and (hasattr(builtins, first) or outside(first)):
                    continue
                yield Reference(relative, number, target), "short"


# --- what exists ------------------------------------------------------------------------------

@cache
def package_suffixes() -> frozenset[str]:
    return frozenset(p.suffix for p in PACKAGE.rglob("*") if p.is_file() and p.suffix)


def module_parts(path: Path) -> tuple[str, ...]:
    """``dpstream/a/b.py`` as ``("a", "b")``, ``dpstream/a/__init__.py`` as ``("a",)``."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[:-1] if parts and parts[-1] == "__init__" else parts


@cache
def outside(name: str) -> bool:
    """Whether ``name`` is a module outside dpstream (found, not imported)."""
    return name != "dpstream" and importlib.util.find_spec(name) is not None


def top_level_module(name: str) -> bool:
    return (PACKAGE / f"{name}.py").is_file() or (PACKAGE / name / "__init__.py").is_file()


def module_file(parts: tuple[str, ...]) -> Path | None:
    """The file of module ``dpstream.<parts>``, if there is one."""
    base = PACKAGE.joinpath(*parts)
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if parts and base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return None


@cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of ``body``, looking inside ``if``/``try``/``with`` blocks."""
    for statement in body:
        if isinstance(statement, ast.If):
            yield from _top_level(statement.body)
            yield from _top_level(statement.orelse)
        elif isinstance(statement, ast.Try):
            for block in (statement.body, statement.orelse, statement.finalbody,
                          *(h.body for h in statement.handlers)):
                yield from _top_level(block)
        elif isinstance(statement, ast.With):
            yield from _top_level(statement.body)
        else:
            yield statement


def _targets(statement: ast.stmt) -> list[str]:
    targets: list[ast.expr] = []
    if isinstance(statement, ast.Assign):
        targets = statement.targets
    elif isinstance(statement, ast.AnnAssign | ast.AugAssign):
        targets = [statement.target]
    names = []
    for target in targets:
        for node in ast.walk(target):
            if isinstance(node, ast.Name):
                names.append(node.id)
    return names


def _module_of(statement: ast.ImportFrom, module: tuple[str, ...], is_package: bool
               ) -> tuple[str, ...] | None:
    """The dpstream module ``statement`` imports from, as parts after ``dpstream``."""
    if statement.level:
        base = module if is_package else module[:-1]
        base = base[: len(base) - (statement.level - 1)]
        tail = tuple(statement.module.split(".")) if statement.module else ()
        return base + tail
    name = statement.module or ""
    if name == "dpstream" or name.startswith("dpstream."):
        return tuple(name.split(".")[1:])
    return None


def resolves_in_body(body: list[ast.stmt], names: list[str], module: tuple[str, ...],
                     is_package: bool) -> bool:
    """Whether ``names`` (first defined in ``body``) resolves."""
    first, rest = names[0], names[1:]
    for statement in _top_level(body):
        if isinstance(statement, ast.ClassDef) and statement.name == first:
            return not rest or resolves_in_class(statement, rest, module, is_package)
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
            if statement.name == first:
                return not rest
        elif first in _targets(statement):
            return not rest
        elif isinstance(statement, ast.Import):
            for alias in statement.names:
                if (alias.asname or alias.name.split(".")[0]) == first:
                    return True  # an imported module: its attributes are not followed
        elif isinstance(statement, ast.ImportFrom):
            for alias in statement.names:
                if (alias.asname or alias.name) != first:
                    continue
                source = _module_of(statement, module, is_package)
                if source is None or not rest:
                    return True
                return resolves(source + (alias.name,) + tuple(rest))
    return False


def resolves_in_class(node: ast.ClassDef, names: list[str], module: tuple[str, ...],
                      is_package: bool) -> bool:
    if resolves_in_body(node.body, names, module, is_package):
        return True
    if len(names) == 1:
        for method in node.body:
            if isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef):
                for child in ast.walk(method):
                    if (isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name)
                            and child.value.id == "self" and child.attr == names[0]
                            and isinstance(child.ctx, ast.Store)):
                        return True
    # inherited: a base class named in this module (defined or imported there)
    for base in node.bases:
        if isinstance(base, ast.Subscript):
            base = base.value
        if isinstance(base, ast.Name) and base.id != node.name and resolves(
                module + (base.id, *names)):
            return True
    return False


@cache
def class_spans(path: Path) -> tuple[tuple[int, int, tuple[str, ...]], ...]:
    """Each class of ``path`` (nested ones too) as (first line, last line, qualified name)."""
    spans = []

    def visit(node: ast.AST, outer: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            name = outer
            if isinstance(child, ast.ClassDef):
                name = outer + (child.name,)
                spans.append((child.lineno, child.end_lineno or child.lineno, name))
            visit(child, name)

    visit(parsed(path), ())
    return tuple(spans)


def enclosing_class(path: Path, line: int) -> tuple[str, ...]:
    """The qualified name of the innermost class of ``path`` whose text holds ``line``."""
    around = [name for first, last, name in class_spans(path) if first <= line <= last]
    return max(around, key=len, default=())


def short_resolves(path: Path, line: int, target: str) -> bool:
    """Whether a short role ``target`` at ``line`` of ``path`` resolves (see the docstring)."""
    module = module_parts(path)
    classes = enclosing_class(path, line)
    names = tuple(target.lstrip(".").split("."))
    candidates = [module + classes[:n] + names for n in range(len(classes), -1, -1)]
    candidates += [module[:n] + names for n in range(len(module) - 1, -1, -1)]
    return any(resolves(candidate) for candidate in candidates)


@cache
def resolves(parts: tuple[str, ...]) -> bool:
    """Whether ``dpstream.<parts>`` names a module, or something defined in one."""
    for split in range(len(parts), -1, -1):
        path = module_file(parts[:split])
        if path is None:
            continue
        if split == len(parts):
            return True
        is_package = path.name == "__init__.py"
        return resolves_in_body(parsed(path).body, list(parts[split:]), parts[:split],
                                is_package)
    return False


def imported_only(parts: tuple[str, ...]) -> bool:
    """Whether ``dpstream.<parts>`` names something a module imports rather than defines."""
    for split in range(len(parts), -1, -1):
        path = module_file(parts[:split])
        if path is None:
            continue
        if split == len(parts) or path.name == "__init__.py":
            return False
        name = parts[split]
        for statement in _top_level(parsed(path).body):
            if isinstance(statement, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                if statement.name == name:
                    return False
            elif name in _targets(statement):
                return False
        return True
    return False


def unresolved() -> list[Reference]:
    missing = []
    for path in prose_files():
        for reference, kind in references(path):
            if kind == "path":
                target = ROOT / reference.text
                ok = target.is_dir() if reference.text.endswith("/") else target.is_file()
            elif kind == "short":
                ok = short_resolves(ROOT / reference.file, reference.line, reference.text)
            else:
                parts = tuple(reference.text.split(".")[1:])
                ok = resolves(parts) and not imported_only(parts)
            if not ok:
                missing.append(reference)
    return missing


# --- the tests --------------------------------------------------------------------------------

def test_every_reference_resolves() -> None:
    missing = unresolved()
    assert not missing, ("references to modules or names that do not exist, or that a module "
                         "only imports (point them at the new home):\n"
                         + "\n".join(map(str, missing)))


def test_the_rules_find_and_resolve_what_they_should() -> None:
    found = {r.text for p in prose_files() for r, _ in references(p)}
    # the scan sees references of every shape in the prose
    assert "dpstream.core.noise.keys.NoiseKey" in found
    assert any(text.startswith("dpstream/") for text in found)
    # a module, a package, a top-level name, a class's method, a name imported into a package
    assert resolves(("core", "noise", "keys"))
    assert resolves(("core", "noise"))
    assert resolves(("core", "noise", "keys", "NoiseKey"))
    assert resolves(("stream", "barrier", "StepBarrier", "end_step"))
    assert resolves(("platform", "KINDS"))
    # names that moved away do not resolve
    assert not resolves(("core", "noise", "samplers", "NoiseKey"))
    assert not resolves(("core", "erm", "perturbation"))
    assert not resolves(("kinds", "flow_kind"))
    assert not resolves(("stream", "barrier", "StepBarrier", "no_such_method"))
    # a name a module imports resolves, but is not its home (a package may re-export)
    assert resolves(("core", "erm", "ermg", "NoiseKey"))
    assert imported_only(("core", "erm", "ermg", "NoiseKey"))
    assert not imported_only(("core", "noise", "keys", "NoiseKey", "lane"))
    assert not imported_only(("platform", "KINDS"))
    # a method inherited from a base class imported from another module
    assert resolves(("core", "pmwg", "bb_scheduler", "BBScheduler", "to_state"))
    # short role targets: found in a module's docstrings, resolved from the module; a module
    # outside dpstream is not a dpstream name
    coordinates = PACKAGE / "core" / "noise" / "coordinates.py"
    assert (".NoiseKey.lane", "short") in {(r.text, k) for r, k in references(coordinates)}
    assert outside("msgspec") and not outside("NoiseKey")
    # a bare method name resolves inside its class, not at the module's top level
    barrier = PACKAGE / "stream" / "barrier.py"
    inside = next(first for first, _, name in class_spans(barrier) if name == ("StepBarrier",))
    assert short_resolves(barrier, inside + 1, "update")
    assert not short_resolves(barrier, 1, "update")
    assert short_resolves(barrier, 1, "StepBarrier.update")
    assert not short_resolves(barrier, 1, "StepBarrier.no_such_method")


def test_schema_tags_and_other_names_are_not_references(tmp_path: Path) -> None:
    prose = tmp_path / "prose.md"
    prose.write_text("`dpstream.release/1` and the logger `dpstream.kafka`, the key "
                     "`dpstream.tick`; mydpstream.core.x, a.dpstream.core.y, dpstream.core.z/2\n"
                     "but dpstream.core.nowhere and dpstream/core/nowhere.py are.\n",
                     encoding="utf-8")
    found = [(r.line, r.text, kind) for r, kind in references(prose)]
    assert found == [(2, "dpstream.core.nowhere", "dotted"),
                     (2, "dpstream/core/nowhere.py", "path")]
