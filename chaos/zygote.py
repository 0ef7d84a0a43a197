"""A zygote for worker processes: imports a worker once, then forks one per order.

Importing a worker with the Anthropic SDK costs seconds of CPU; the matrix starts two or three
workers per cell. So the harness runs one of these: it imports what a worker needs, then reads
orders from stdin, one JSON line each (``{"env": {...}, "argv": [...], "log": path}``), forks a
child per order and writes the child's pid to stdout. The child sets that environment, sends its
output to ``log`` and runs ``toren <argv>`` (normally ``worker --app chaos.app``): from then on
it is an ordinary worker process, the same entry point, kill points armed at boot.

Children are reaped automatically; the zygote exits when its stdin closes.
"""

from __future__ import annotations

import os
import signal
import sys

import orjson

import toren.actors.runs
import toren.cli
import toren.providers.anthropic
import toren.supervisors.worker


def _child(order: dict[str, object]) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    log = os.open(str(order["log"]), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.environ.update(order["env"])  # type: ignore[arg-type]
    sys.argv = ["toren", *order["argv"]]  # type: ignore[misc]
    code = 0
    try:
        toren.cli.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    for line in sys.stdin:
        order = orjson.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(order)
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
