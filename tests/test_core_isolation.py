"""The core imports numpy only: it works with bytewax, kafka and prometheus blocked.

scipy is blocked too: the ERM solver imports it only when it solves (scipy earns its place
there, see dpstream/core/erm/perturbation.py), so every core module imports without it.
"""

import subprocess
import sys
import textwrap


def test_core_imports_without_edges():
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in {'bytewax', 'kafka', 'confluent_kafka',
                                          'prometheus_client', 'orjson', 'scipy'}:
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
        import dpstream.core.noise.samplers, dpstream.core.accounting.ledger
        import dpstream.core.counting.tree_counter
        import dpstream.core.counting.blt_counter, dpstream.core.counting.threshold_monitor
        import dpstream.core.counting.outputs, dpstream.core.counting.blt_parameters
        import dpstream.core.counting.admission_bounds, dpstream.core.counting.monitor_columns
        import dpstream.core.counting.statistics_spec
        import dpstream.core.counting.tree_columns, dpstream.core.counting.stage_ledgers
        import dpstream.core.pmwg.universe, dpstream.core.pmwg.queries, dpstream.core.pmwg.mechanism
        import dpstream.core.pmwg.schedulers, dpstream.core.pmwg.blackboxes
        import dpstream.core.erm.perturbation, dpstream.core.erm.schedules, dpstream.core.erm.ermg
        print('ok')
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
