"""docs/architecture.md keeps up with the code: its layer table and its walks of one event."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_import_graph import LAYERS, layer_of, modules

DOC = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"

# A walk's line: a module (without the ``dpstream.`` prefix), its layer, what happens there.
WALK_LINE = re.compile(r"^([a-z_]+(?:\.[a-z_]+)*) +([a-z]+) +\S")


def _blocks(language: str) -> list[str]:
    """The fenced blocks of the page opened with ```` ```language ````, as text."""
    found: list[str] = []
    block: list[str] | None = None
    opened = ""
    for line in DOC.read_text().splitlines():
        if line.startswith("```"):
            if block is None:
                block, opened = [], line[3:].strip()
            else:
                if opened == language:
                    found.append("\n".join(block) + "\n")
                block = None
        elif block is not None:
            block.append(line)
    return found


def test_the_layer_table_is_the_import_graph_tests() -> None:
    quoted = [block for block in _blocks("python") if block.startswith("LAYERS = ")]
    assert len(quoted) == 1, "docs/architecture.md quotes the layer table once"
    table = ast.literal_eval(quoted[0].removeprefix("LAYERS = "))
    assert table == LAYERS


def test_every_module_of_the_walks_exists_in_the_layer_it_names() -> None:
    known = modules()
    layers = [label for label, _prefixes in LAYERS]
    walks = [block for block in _blocks("") if block.startswith("io.kafka ")]
    assert len(walks) == 3, "one walk per flow kind"
    for walk in walks:
        lines = walk.strip().splitlines()
        assert lines[0].startswith("io.kafka ") and lines[-1].startswith("io.kafka ")
        for line in lines:
            found = WALK_LINE.match(line)
            assert found, f"not a walk line: {line!r}"
            module, layer = f"dpstream.{found[1]}", found[2]
            assert module in known, f"{module} is no module of the package"
            assert layers[layer_of(module)] == layer, f"{module} is not in layer {layer}"
