"""PMWG: private multiplicative weights for growing databases; queries, universe, schedulers."""
