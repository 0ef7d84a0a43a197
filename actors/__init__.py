"""Each actor kind's behaviour, a package per kind: ``run`` (an agent's run), ``sandbox`` (its
container), ``channel`` (a chat transport's bot and conversations), ``schedule`` (runs started on
a clock).

They use only ``toren``'s public API (``toren`` and ``toren.kernel``); a test enforces it. The
worker's own services (hosts, dispatcher, lease keeper, death watch) are not kinds: they live
beside the worker in :mod:`toren.supervisors.worker`.
"""
