"""The worker's concrete actors: the hosts of claimed actors, the lease keeper, the dispatcher.

They use only ``toren``'s public API (``toren`` and ``toren.kernel``); a test enforces it.
"""
