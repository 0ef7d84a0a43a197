"""``python -m bench.profile``: where the time (and, for parked runs, the memory) of the suite's
missed targets goes. Not part of the suite: a tool for looking, whose output is read by a person.

Each phase runs one benchmark's workload on a fresh embedded Postgres, the same way the suite's
section does, and around it measures:

- CPU seconds of each process that takes part (the worker or ``toren serve``, this process,
  which holds the scripted model server and the client, ``wrk``, and every process of the
  embedded Postgres), read from ``/proc`` before and after;
- with ``py-spy`` (``pip install py-spy``), the worker's (or server's) Python stacks, sampled
  while it is busy (idle threads left out), written as collapsed stacks (``--format raw``) and
  summed per function (self and inclusive) and per area (our floors, each library, the event
  loop);
- for the step statement, ``EXPLAIN (ANALYZE, BUFFERS)`` of one step, in a rolled-back
  transaction, beside the floor's insert;
- for parked runs, a ``tracemalloc`` snapshot, glibc's ``mallinfo2`` and CPython's allocator
  statistics taken inside the worker (a ``sitecustomize`` hook this tool puts on its
  ``PYTHONPATH``, dumping on ``SIGUSR2``) before the first run and after the last one parked.

Writes ``OUT/<phase>.md`` (tables) and the raw files beside it. Phases: floor, kernel, agent,
parked, api. Example: ``python -m bench.profile kernel agent --out /tmp/prof``.
"""
