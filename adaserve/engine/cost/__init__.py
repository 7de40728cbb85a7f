"""What a forward costs, and the token budget B that follows.

Holds the start-up profiler (profiler.py, with ``ProfilerConfig``), the knee of the measured roofline
(budget.py, with ``KneeConfig``), the fitted cost model ``T = a N_ctx + g N_batched + d``
(cost_model.py), the online correction from timed forwards (timing.py), the on-disk profile cache
(profile_cache.py), and the iteration's host time around the forwards, learnt while serving (host_cost.py).

May import: the model room (the profiler times real forwards), ``engine.speculation`` (the least B a
tree needs, ``adaptive.speculation_floor``), the engine's leaves, ``adaserve.plots`` and
``adaserve.__version__``; never the scheduler core.
"""
