"""PMWG: private multiplicative weights for growing databases, and the black-box schedulers.

Cummings, Krehbiel, Lai, Tantipongpipat 2018, "Differential Privacy for Growing Databases".
One idea per module:

* the data: :mod:`~dpstream.core.pmwg.attributes` (an attribute's domain),
  :mod:`~dpstream.core.pmwg.universe` (their product; records to cells);
* the queries: :mod:`~dpstream.core.pmwg.queries` (compiled linear queries),
  :mod:`~dpstream.core.pmwg.query_parser` (the JSON language),
  :mod:`~dpstream.core.pmwg.query_compiler` (the cache);
* PMWG (Algorithm 1): :mod:`~dpstream.core.pmwg.spec` (parameters and
  noise function), :mod:`~dpstream.core.pmwg.worst_case` (the worst-case privacy sum (B.1)),
  :mod:`~dpstream.core.pmwg.sparse_vector` (NSG over NATG, Algorithms 2-3),
  :mod:`~dpstream.core.pmwg.hard_query_sums` (the ``b_tau`` sums),
  :mod:`~dpstream.core.pmwg.guarantee` (the accuracy report),
  :mod:`~dpstream.core.pmwg.mechanism` (the mechanism);
* the black-box schedulers: :mod:`~dpstream.core.pmwg.blackboxes` (the interface and the noisy
  histogram), :mod:`~dpstream.core.pmwg.runner` (what they share),
  :mod:`~dpstream.core.pmwg.bb_scheduler` (Algorithm 4), :mod:`~dpstream.core.pmwg.bb_improver`
  (Algorithm 5).
"""
