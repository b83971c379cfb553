"""Release schedules for private ERM on a stream of blocks (ERM paper 004, Algorithms 2, 4-8).

The schedules of Watson et al., "Continual and Sliding Window Release for Private Empirical Risk
Minimization" (paper 004), over the output-perturbation trainer of
:mod:`dpstream.core.erm.output_noise`. One module per idea:

* :mod:`~dpstream.core.erm.schedules.spec`: the parameters (``ScheduleSpec``), the per-event
  budgets, the zCDP references and the readings of the paper;
* :mod:`~dpstream.core.erm.schedules.releases`: what a schedule trains and releases
  (``Computation``, ``Release``) and the trainer's protocol;
* :mod:`~dpstream.core.erm.schedules.base`: the shared plan machinery (noise levels, rates);
* one plan per schedule: :mod:`~dpstream.core.erm.schedules.multi_resolution` (Algorithms 2
  and 6), :mod:`~dpstream.core.erm.schedules.continual` (Algorithms 4 and 8),
  :mod:`~dpstream.core.erm.schedules.sliding` (Algorithm 5) and
  :mod:`~dpstream.core.erm.schedules.independent` (the baseline);
* :mod:`~dpstream.core.erm.schedules.schedule`: ``ReleaseSchedule``, which runs a plan over the
  blocks: the per-block ledger, training, replay-safe noise and state.
"""
