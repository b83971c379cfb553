"""Flow modules for ``python -m bytewax.run`` (importable from any directory)."""
