"""Print the package layout: a line a module with its lines, then the largest modules and classes.

    python tools/layout_report.py [PACKAGE_DIR] [--top N]

Counts physical lines; a class's size is its source span (decorators excluded).
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path


def modules(root: Path) -> list[tuple[Path, int]]:
    return [(p, len(p.read_text().splitlines())) for p in sorted(root.rglob("*.py"))]


def classes(root: Path) -> list[tuple[str, int]]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                span = (node.end_lineno or node.lineno) - node.lineno + 1
                found.append((f"{path.relative_to(root.parent)}:{node.name}", span))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", default="dpstream", type=Path)
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    mods = modules(args.package)
    print(f"{sum(n for _, n in mods)} lines in {len(mods)} modules")
    for path, lines in mods:
        print(f"{lines:6d}  {path}")
    print("\nlargest modules")
    for path, lines in sorted(mods, key=lambda m: -m[1])[: args.top]:
        print(f"{lines:6d}  {path}")
    print("\nlargest classes")
    for name, span in sorted(classes(args.package), key=lambda c: -c[1])[: args.top]:
        print(f"{span:6d}  {name}")


if __name__ == "__main__":
    main()
