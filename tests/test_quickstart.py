"""A new user's first hour, literally: the README's first command in a copy of the checkout with a
clean HOME, then what the banner and docs/quickstart.md say to run from a second terminal, their
own agent offline, the quickstart's "Kill it and watch it resume" walkthrough, and a first actor.

Commands, files and sample outputs are read from the docs themselves, so the test fails when
they and the code part ways: each sample output in the docs must appear, in order, in what the
command prints (run ids, ports, milliseconds and the user's name aside).

The one deviation from "literally": every ``toren dev`` gets ``--port 0``, because port 8420 may
belong to a developer's own ``toren dev`` (no command here uses the API).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from tests.conftest import ROOT, wait_for

pytestmark = [pytest.mark.anyio, pytest.mark.processes, pytest.mark.timeout(900)]

README = ROOT / "README.md"
QUICKSTART = ROOT / "docs" / "quickstart.md"
OPERATIONS = ROOT / "docs" / "operations.md"
DEMO_RUN = "run/9f5dcea1-0a76-5236-9443-f489422e0b26"  # the id the quickstart shows
# What a clean machine does not have: Toren's settings and any provider's credentials.
_DROPPED = ("TOREN_", "ANTHROPIC_", "OPENAI_", "AWS_", "TELEGRAM_", "PYTHON", "VIRTUAL_ENV")
_KEPT = ("AWS_CA_BUNDLE",)  # this machine's certificate store, not a credential


# --- reading the docs -----------------------------------------------------------------------


def blocks(text: str) -> list[tuple[str, str]]:
    """The fenced code blocks of a Markdown text: (language, body)."""
    return [(m[1], m[2]) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)]


def section(text: str, heading: str) -> str:
    """The text under ``## heading`` up to the next ``## ``."""
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def command(line: str) -> str:
    """A shell line from the docs without its trailing comment."""
    return re.sub(r"\s+#.*$", "", line).strip()


def transcript(body: str) -> list[tuple[str, list[str]]]:
    """A sample terminal session: each ``$ command`` with the lines it printed."""
    shown: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            shown.append((line[2:], []))
        elif shown:
            shown[-1][1].append(line)
    return shown


def normal(text: str, clone: Path) -> list[str]:
    """Lines as the docs may show them: run ids, ports, milliseconds, the deciding user's name
    and idempotency keys vary from run to run; the banner names `toren` in full when it is not
    on the PATH."""
    text = text.replace(f"{clone}/.venv/bin/toren", "toren")
    text = re.sub(r"run/[0-9a-f-]{36}", "run/ID", text)
    text = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", text)
    text = re.sub(r"\b\d+ ms\b", "N ms", text)
    text = re.sub(r"approved by \S+ via", "approved by USER via", text)
    text = re.sub(r"refund [0-9a-f]{8} ", "refund KEY ", text)
    text = re.sub(r"(?<=\S) {2,}", "   ", text)  # columns padded to the longest command
    return [line.rstrip() for line in text.splitlines() if line.strip()]


def assert_shows(expected: list[str], printed: str, clone: Path, what: str) -> None:
    """Every line the docs show appears in what was printed, in the same order."""
    want = normal("\n".join(expected), clone)
    got = normal(printed, clone)
    at = 0
    for line in want:
        try:
            at = got.index(line, at) + 1
        except ValueError:
            raise AssertionError(
                f"{what}: the docs show {line!r}, which was not printed (in this order):\n"
                + "\n".join(got)
            ) from None


# --- the user's machine ---------------------------------------------------------------------


def clean_env(home: Path) -> dict[str, str]:
    """This machine's environment as a new user's shell has it: their own HOME, nothing of
    Toren's or a provider's, and no `toren` on the PATH (the repository's own venv removed)."""
    env = {k: v for k, v in os.environ.items() if k in _KEPT or not k.startswith(_DROPPED)}
    env["HOME"] = str(home)
    path = [
        p for p in env.get("PATH", "").split(os.pathsep) if p and not (Path(p) / "toren").exists()
    ]
    env["PATH"] = os.pathsep.join(path)
    return env


def copy_checkout(dest: Path) -> None:
    """The files git tracks (as they are in the working tree), as a fresh clone has them."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src, dst = ROOT / rel, dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        elif src.is_file():
            shutil.copy2(src, dst)


class Terminal:
    """A long-running command in a terminal of its own (its own process group, as a shell's
    foreground job), its output collected in a file."""

    def __init__(self, line: str, *, cwd: Path, env: dict[str, str], log: Path) -> None:
        self.line, self.log = line, log
        self._out = log.open("wb")
        self.proc = subprocess.Popen(
            ["bash", "-c", line],
            cwd=cwd,
            env=env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def shows(self, pattern: str, timeout: float) -> re.Match[str]:
        async def seen() -> re.Match[str] | None:
            if self.proc.poll() is not None and not re.search(pattern, self.output, re.M):
                raise AssertionError(f"`{self.line}` exited {self.proc.returncode}:\n{self.output}")
            return re.search(pattern, self.output, re.M)

        found: re.Match[str] = await wait_for(
            seen, timeout=timeout, interval=0.2, what=f"{pattern!r} from `{self.line}`"
        )
        return found

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)

    async def exited(self, timeout: float) -> int:
        async def done() -> bool:
            return self.proc.poll() is not None

        await wait_for(done, timeout=timeout, interval=0.2, what=f"`{self.line}` to exit")
        return self.proc.returncode

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._out.close()


@pytest.fixture
def machine() -> Iterator[Path]:
    """A short directory (Postgres's socket path must stay under 108 bytes) holding the
    checkout and HOME; whatever Postgres a killed `toren dev` left in it is stopped after."""
    base = Path(tempfile.mkdtemp(prefix="toren-qs-", dir="/tmp"))
    try:
        yield base
    finally:
        pid_file = base / "home" / ".toren" / "pgdata" / "postmaster.pid"
        if pid_file.exists():  # the quickstart's advice for a Postgres left running
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGINT)
            deadline = time.monotonic() + 20
            while pid_file.exists() and time.monotonic() < deadline:
                time.sleep(0.2)  # a teardown outside the event loop: bounded, not a wait for a test
        shutil.rmtree(base, ignore_errors=True)


# --- the test -------------------------------------------------------------------------------


async def test_readme_and_quickstart_work_literally_in_a_clean_home(machine: Path) -> None:
    began = time.monotonic()
    clone, home = machine / "toren", machine / "home"
    home.mkdir()
    copy_checkout(clone)
    env = clean_env(home)
    quick = QUICKSTART.read_text()
    terminals: list[Terminal] = []

    def terminal(line: str, name: str) -> Terminal:
        t = Terminal(line, cwd=clone, env=env, log=machine / f"{name}.log")
        terminals.append(t)
        return t

    async def second(line: str, *, activate: bool = True, where: str = ".") -> str:
        """A command from the second terminal, in the virtualenv the quickstart activates."""
        full = f"{activate_line} && cd {where} && {line}" if activate else line
        done = await anyio.run_process(["bash", "-c", full], cwd=clone, env=env, check=False)
        printed = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
        assert done.returncode == 0, f"`{line}` exited {done.returncode}:\n{printed}"
        return printed

    def ours(line: str) -> str:
        return line.replace(DEMO_RUN, run_id)

    try:
        # The README's first command, as written (plus --port 0, see the module's docstring).
        first = command(blocks(README.read_text())[0][1].splitlines()[0])
        assert first.endswith("toren dev"), first
        dev = terminal(f"{first} --port 0", "dev")
        banner = await dev.shows(r"In another terminal:\n(?:.*\n){4}", timeout=600)
        up = time.monotonic() - began
        run_id = re.findall(r"Demo run (run/[0-9a-f-]{36})", dev.output)[0]

        # The banner's commands work from a second terminal as printed (no PATH needed).
        printed = dict(re.findall(r"^  (\S.*?\S)\s{3,}(\S.*)$", banner[0], re.M))
        show = next(c for c in printed if " jobs show " in c)
        # The banner may say the run "will park": the worker serves before it has imported the
        # provider's SDK, so the run's first call can still be on its way. Shown until it parks.
        asked, deadline = "approval requested for issue_refund", time.monotonic() + 120
        while asked not in (shown := await second(show, activate=False)):
            assert time.monotonic() < deadline, shown
            await anyio.sleep(0.5)

        # The quickstart's banner, as it prints (the migration count included: on a clean
        # HOME every migration is applied now).
        run_dev = section(quick, "Run `toren dev`")
        shown_banner = next(b for lang, b in blocks(run_dev) if "schema ready" in b)
        assert_shows(shown_banner.splitlines(), dev.output, clone, "the quickstart's banner")

        # Install's second and third lines: the second terminal's virtualenv, and a check.
        install = blocks(section(quick, "Install"))[0][1].splitlines()
        activate_line = command(install[1])
        assert "toren, version" in await second(command(install[2]))

        # "Approve the refund from a second terminal", every sample as shown.
        approve_part = section(quick, "Approve the refund from a second terminal")
        samples = [b for lang, b in blocks(approve_part) if lang == "" and "$ " in b]
        ((show_cmd, show_out),) = transcript(samples[0])
        assert_shows(show_out, await second(ours(show_cmd)), clone, show_cmd)
        tail = terminal(f"{activate_line} && toren jobs tail {run_id}", "tail-demo")
        ((approve_cmd, approve_out),) = transcript(samples[1])
        assert_shows(approve_out, await second(ours(approve_cmd)), clone, approve_cmd)
        assert await tail.exited(timeout=60) == 0
        rest = next(b for lang, b in blocks(approve_part) if "completed:" in b)
        shown = tail.output + await second(f"toren jobs show {run_id}")
        assert_shows(rest.splitlines(), shown, clone, "the run after its approval")

        # "More to try": the list reads the summary; --json has the fields operations.md lists.
        listed = await second("toren jobs list")
        assert run_id in listed
        assert "completed" in listed
        record = json.loads(await second(f"toren jobs show {run_id} --json"))
        event_fields = set(record["events"][0])
        assert record["queued"] is None  # a run that waits for no slot: its wait's fields
        queued_fields = {"limit", "position", "cap"}  # are documented, not printed
        shown = set(record) | set(record["receipt"]) | {"class", "message"} | event_fields
        forked_fields = {"step"}  # forked_from's, documented (null: not a fork)
        assert shown | queued_fields | forked_fields == documented_json_fields()

        # "Your own agent, offline": Ctrl-C the demo, toren init, toren dev on the model script.
        dev.ctrl_c()
        assert await dev.exited(timeout=60) == 0, dev.output
        offline = section(quick, "Your own agent, offline")
        sh = [
            command(line) for lang, b in blocks(offline) if lang == "sh" for line in b.splitlines()
        ]
        init, cd, start, run_cmd, approve_cmd, show_cmd = sh
        await second(init)
        app = cd.removeprefix("cd ")
        dev = terminal(f"{activate_line} && {cd} && {start} --port 0", "dev-own")
        await dev.shows(r"no provider is called and nothing is paid", timeout=120)
        shown_banner = next(b for lang, b in blocks(offline) if "OFFLINE model" in b)
        assert " ".join(normal(shown_banner, clone)) in " ".join(normal(dev.output, clone))
        parked = await second(run_cmd, where=app)
        own_run = re.findall(r"run/[0-9a-f-]{36}", parked)[0]
        assert "parked" in parked
        approved = await second(approve_cmd.replace("RUN", own_run), where=app)
        assert "approved call" in approved

        async def answered() -> str | None:
            shown = await second(show_cmd.replace("RUN", own_run), where=app)
            return shown if "status completed" in shown else None

        assert "completed: Done:" in await wait_for(answered, timeout=30, interval=0.5)
        first_own = time.monotonic() - began

        # "Kill it and watch it resume": Ctrl-C it, write patient.py, start it.
        dev.ctrl_c()
        assert await dev.exited(timeout=60) == 0, dev.output
        walk = section(quick, "Kill it and watch it resume")
        code = [b for lang, b in blocks(walk) if lang == "python"]
        (clone / "patient.py").write_text(code[0])
        start = command(next(b for lang, b in blocks(walk) if b.startswith("toren dev")))
        dev = terminal(f"{activate_line} && {start} --port 0", "dev-patient")
        await dev.shows(r"OFFLINE model", timeout=120)
        sample = next(b for lang, b in blocks(walk) if b.startswith("$ toren run"))
        (run_cmd, _), (tail_cmd, before) = transcript(sample)
        started = await second(run_cmd)  # the id (stdout), then the console link (stderr)
        run_id = started.splitlines()[0]
        assert re.fullmatch(r"run/[0-9a-f-]{36}", run_id), started
        assert f"/#/runs/{run_id}" in started
        tail = terminal(
            f"{activate_line} && {re.sub(r'run/[0-9a-f-]{36}', run_id, tail_cmd)}", "tail"
        )
        await tail.shows(r"model call 2 .* next:", timeout=60)

        # kill -9 the process `toren workers` names, mid-call.
        workers = json.loads(await second("toren workers --json"))
        (pid,) = [w["pid"] for w in workers]
        assert str(pid) in await second("toren workers")
        os.kill(pid, signal.SIGKILL)
        assert await dev.exited(timeout=30) != 0
        dev = terminal(f"{activate_line} && {start} --port 0", "dev-again")
        assert await tail.exited(timeout=120) == 0, tail.output
        survived = time.monotonic() - began
        after = next(b for lang, b in blocks(walk) if "lost in flight once" in b)
        assert_shows(before + after.splitlines(), tail.output, clone, "the run's timeline")
        ((receipt_cmd, receipt_out),) = transcript(
            next(b for lang, b in blocks(walk) if b.startswith("$ toren jobs show"))
        )
        receipt = await second(re.sub(r"run/[0-9a-f-]{36}", run_id, receipt_cmd))
        assert_shows(receipt_out, receipt, clone, "the receipt after the kill")

        # "Write your first actor", "Run a worker with your actor", "Talk to it from Python".
        actor = [b for lang, b in blocks(section(quick, "Write your first actor")) if lang]
        (clone / "counter.py").write_text(actor[0])
        talk = blocks(section(quick, "Talk to it from Python"))
        (clone / "use_counter.py").write_text(talk[0][1])
        worker_part = blocks(section(quick, "Run a worker with your actor"))
        worker = terminal(f"{activate_line} && {command(worker_part[0][1])}", "worker")
        await worker.shows(r"worker \S+ up", timeout=60)
        printed = await second("python use_counter.py")
        assert_shows(talk[1][1].splitlines(), printed, clone, "use_counter.py")
        worker.ctrl_c()
        assert await worker.exited(timeout=60) == 0, worker.output

        dev.ctrl_c()
        assert await dev.exited(timeout=60) == 0, dev.output
        postgres = home / ".toren" / "pgdata" / "postmaster.pid"  # the one the kill left running

        async def stopped() -> bool:
            return not postgres.exists()

        await wait_for(stopped, timeout=30, interval=0.2, what="the embedded Postgres to stop")
        print(
            f"\nfrom a copy of the checkout: demo banner after {up:.0f} s, a first own agent's "
            f"run completed after {first_own:.0f} s, an own agent through a kill -9 after "
            f"{survived:.0f} s"
        )
    finally:
        for t in terminals:
            t.close()


def documented_json_fields() -> set[str]:
    """The names operations.md gives for `toren jobs show --json` (nested ones included)."""
    row = next(
        line for line in OPERATIONS.read_text().splitlines() if "| `toren jobs show RUN`" in line
    )
    listed = row.split("`--json`:", 1)[1]
    # Values named beside the fields (null, a status) are not fields.
    return set(re.findall(r"`([a-z_]+)`", listed)) - {"null", "run", "call_id", "parked"}
