"""Worker processes for the chaos harness: forked warm from a zygote, faulted for real."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import psutil

ROOT = Path(__file__).resolve().parent.parent


class Worker:
    """A real ``toren worker --app chaos.app`` process (a child of the zygote)."""

    def __init__(self, pid: int, log_path: Path, role: str) -> None:
        self.pid = pid
        self.log_path = log_path
        self.role = role
        try:
            self._proc: psutil.Process | None = psutil.Process(pid)
        except psutil.NoSuchProcess:
            self._proc = None

    def signal(self, sig: int) -> None:
        if not self.exited:
            os.kill(self.pid, sig)

    def kill(self) -> bool:
        """SIGKILL; True once the process is gone."""
        self.signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not self.exited:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def _status(self) -> str | None:
        if self._proc is None:
            return None
        try:
            return str(self._proc.status())
        except psutil.NoSuchProcess:
            return None

    @property
    def exited(self) -> bool:
        return self._status() in (None, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)

    @property
    def stopped(self) -> bool:
        """Stopped by SIGSTOP (as the kernel reports it)."""
        return self._status() == psutil.STATUS_STOPPED

    @property
    def running(self) -> bool:
        return not self.exited and not self.stopped

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def close(self) -> None:
        if not self.exited:
            os.kill(self.pid, signal.SIGCONT)  # a stopped process cannot die until continued
            self.kill()


class Launchers:
    """Starts workers by forking them from a zygote that has imported a worker once."""

    def __init__(self) -> None:
        self._zygote = subprocess.Popen(
            [sys.executable, "-m", "chaos.zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )

    def start(self, env: dict[str, str], log_path: Path, role: str) -> Worker:
        """Fork a worker with ``env``; its output goes to ``log_path``.

        Raises:
            RuntimeError: the zygote is gone.
        """
        stdin, stdout = self._zygote.stdin, self._zygote.stdout
        if stdin is None or stdout is None:  # pragma: no cover  (always pipes)
            raise RuntimeError("zygote without pipes")
        order = {
            "env": env,
            "argv": ["--log-level", "DEBUG", "worker", "--app", "chaos.app"],
            "log": str(log_path),
        }
        stdin.write(orjson.dumps(order) + b"\n")
        stdin.flush()
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"the worker zygote exited ({self._zygote.poll()})")
        return Worker(int(line), log_path, role)

    def close(self) -> None:
        if self._zygote.stdin is not None:
            self._zygote.stdin.close()
        try:
            self._zygote.wait(10)
        except subprocess.TimeoutExpired:
            self._zygote.kill()
            self._zygote.wait(10)
        if self._zygote.stdout is not None:
            self._zygote.stdout.close()
