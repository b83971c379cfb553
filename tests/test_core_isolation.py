"""The core imports numpy only: it works with bytewax, kafka and prometheus blocked.

scipy is blocked too: the ERM solver imports it only when it solves (scipy earns its place
there, see dpstream/core/erm/solver.py), so every core module imports without it. Every module
under dpstream/core is imported, found by walking the package (no list to keep up to date).
"""

import subprocess
import sys
import textwrap
from pathlib import Path

CORE = Path(__file__).parent.parent / "dpstream" / "core"


def test_core_imports_without_edges():
    modules = sorted(".".join(p.relative_to(CORE.parent.parent).with_suffix("").parts)
                     .removesuffix(".__init__") for p in CORE.rglob("*.py"))
    assert len(modules) > 40  # the walk found the core
    code = textwrap.dedent(f"""
        import importlib, sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in {{'bytewax', 'kafka', 'confluent_kafka',
                                          'prometheus_client', 'orjson', 'scipy', 'msgspec'}}:
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
        for module in {modules!r}:
            importlib.import_module(module)
        print('ok')
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
