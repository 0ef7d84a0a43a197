"""The sandbox actor (kind ``toren.sandbox``): one run's container, its commands, its workspace.

Every tool call arrives as ``sandbox.exec`` and takes two steps, so that a command's intent is in
the journal before the command can start:

1. ``command.intended`` (with the marker the command will carry in the container), and a
   ``sandbox.go`` to itself;
2. the container made ready (adopted by its labels, started, or made again from the last
   checkpoint), the command run, the workspace checkpointed if it may have changed, and
   ``command.finished`` with the checkpoint's id, committed with the ``run.sandbox_done`` that
   tells the run.

A ``sandbox.go`` handled a second time (its first handling never committed: a crash, a lost
lease) finds what the first one left: a command still running is killed, one that finished is
reported with its exit code, one that started is reported interrupted with its partial output,
and only one with no trace runs (unless the sandbox is declared rerunnable). The first step of
every activation kills whatever command still runs from a previous owner.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
import time
from typing import Any

import aiodocker

from toren import Actor, ConfigError, Context
from toren.actors.sandboxes import runtime
from toren.actors.sandboxes.docker import Docker, Unavailable
from toren.actors.sandboxes.hardening import Limits
from toren.actors.sandboxes.outcomes import Outcome, PathRefused, WorkspaceTooLarge
from toren.kernel import kill_point
from toren.sandboxes import (
    CHANGES_WORKSPACE,
    SANDBOX_KIND,
    SEND_MAX,
    WORKSPACE,
    Checkpointed,
    Command,
    CommandFinished,
    CommandIntended,
    Exec,
    Go,
    Idle,
    Reap,
    Sandbox,
    SandboxCreated,
    SandboxDone,
    SandboxNotice,
    SandboxReaped,
    SandboxRestored,
    SandboxState,
    SandboxStopped,
    WriteFiles,
    fold,
    run_of,
    summary,
)
from toren.sandboxes.checkpoints import Manifest, checkpoint, load_manifest, restore
from toren.sandboxes.store import StoreError, WorkspaceStore

log = logging.getLogger("toren.sandbox")

_LISTED = 1000  # entries list_files shows at most
_LABEL_RUN = "toren.run"
_LABEL_SANDBOX = "toren.sandbox"


def container_name(sandbox_id: str) -> str:
    """A Docker name for the sandbox: readable, unique, within Docker's alphabet."""
    tail = re.sub(r"[^a-zA-Z0-9_.-]", "-", sandbox_id.removeprefix("sandbox/"))[:40]
    digest = hashlib.sha256(sandbox_id.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"toren-{tail}-{digest}"


def marker(sandbox_id: str, call_id: str) -> str:
    """What a command carries in the container, so that it can be found (and killed)."""
    text = f"{sandbox_id}\0{call_id}".encode("utf-8", "surrogatepass")
    return hashlib.sha256(text).hexdigest()[:24]


class SandboxActor(Actor[SandboxState]):
    """One run's sandbox."""

    kind = SANDBOX_KIND
    idle_seconds = 5.0
    max_attempts = 4
    retry_base_seconds = 1.0
    # A long-lived sandbox (thousands of commands) is activated from a snapshot and the events
    # since, not its whole journal.
    snapshot_every = 500
    state_type = SandboxState
    snapshot_version = 1

    def __init__(self, actor_id: str, args: Any) -> None:
        super().__init__(actor_id, args)
        self.run_id = str(args.get("run") or run_of(actor_id))
        self.settings = Sandbox.from_args(args.get("settings") or {})
        # A fork's sandbox starts from its source's workspace at the step it was forked from.
        start = args.get("checkpoint")
        self._start = start if isinstance(start, str) and start else None
        self._attached = False  # this activation checked its container (leftovers killed)
        self._manifest: Manifest | None = None  # the last checkpoint's, once loaded
        self._records: list[str] = []  # markers of commands journaled here, records kept
        self._swept = False  # this activation dropped the record its predecessor left

    def initial_state(self) -> SandboxState:
        return SandboxState(checkpoint=self._start)

    def apply(self, state: SandboxState, event: Any) -> SandboxState:
        return fold(state, event)

    def summarize(self, state: SandboxState) -> dict[str, Any]:
        return summary(state) | {"run": self.run_id}

    async def handle(self, ctx: Context[SandboxState], msg: Any) -> None:
        if isinstance(msg, Exec):
            self._exec(ctx, msg)
        elif isinstance(msg, Go):
            await self._go(ctx, msg)
        elif isinstance(msg, Idle):
            await self._idle(ctx, msg)
        elif isinstance(msg, Reap):
            await self._reap(ctx)
        elif isinstance(msg, WriteFiles):
            await self._write_files(ctx, msg)

    def on_dead_letter(self, ctx: Context[SandboxState], msg: Any, error: str) -> None:
        """A command whose step kept failing (Docker trouble) ends with an error result: the run
        is told, never left waiting."""
        if isinstance(msg, Go):
            command = ctx.state.commands.get(msg.call_id)
            if command is not None and command.finished is None:
                text = f"the sandbox could not run this call: {error[:2000]}"
                self._finish(ctx, command, _refused(command, text))

    # -- steps ----------------------------------------------------------------------------------

    def _exec(self, ctx: Context[SandboxState], msg: Exec) -> None:
        known = ctx.state.commands.get(msg.call_id)
        if known is not None:
            if known.finished is not None:  # asked again (the run was retried): the same answer
                ctx.send(self.run_id, _done(known.finished))
            return
        ctx.emit(
            CommandIntended(
                call_id=msg.call_id,
                tool=msg.tool,
                arguments=msg.arguments,
                marker=marker(self.actor_id, msg.call_id),
                rerunnable=msg.rerunnable,
                at=time.time(),
            )
        )
        ctx.send(self.actor_id, Go(call_id=msg.call_id))

    async def _go(self, ctx: Context[SandboxState], msg: Go) -> None:
        command = ctx.state.commands.get(msg.call_id)
        if command is None or command.finished is not None:
            return
        try:
            await self._run(ctx, command)
        except Unavailable as exc:
            self._finish(ctx, command, _refused(command, f"no sandbox: {exc}"), fatal=True)
        except ConfigError as exc:  # the store's settings (a missing bucket, no credentials)
            text = f"the workspace store refused: {exc}"
            self._finish(ctx, command, _refused(command, text), fatal=True)
        except aiodocker.DockerError as exc:
            if exc.status == 400:  # a limit Docker refuses: settings, not a passing fault
                text = f"Docker refused the sandbox's settings: {exc.message}"
                self._finish(ctx, command, _refused(command, text), fatal=True)
                return
            self._last_try(ctx, command, exc)
        except Exception as exc:  # noqa: BLE001  (tried again, and the run told at the last)
            self._last_try(ctx, command, exc)

    def _last_try(self, ctx: Context[SandboxState], command: Command, exc: Exception) -> None:
        """A failure that may pass (the daemon, the store): the step is tried again, and on its
        last attempt the run gets an error result instead of waiting for ever."""
        envelope = ctx.envelope
        # attempts: the failures recorded before this one; this is the last when it fails too.
        if envelope is None or envelope.attempts + 1 < self.max_attempts:
            raise exc
        text = f"the sandbox could not run this call ({envelope.attempts + 1} attempts): {exc}"
        # The store kept refusing (a path that is not a directory, no permission): settings,
        # the run cannot go on without its workspace being kept.
        fatal = isinstance(exc, OSError | StoreError)
        self._finish(ctx, command, _refused(command, text[:4000]), fatal=fatal)

    async def _run(self, ctx: Context[SandboxState], command: Command) -> None:
        docker, store = runtime.of(ctx).current()
        had_container = ctx.state.container_id is not None
        container, fresh = await self._ready(ctx, docker, store)
        envelope = ctx.envelope
        again = envelope is not None and (envelope.deliveries > 1 or envelope.attempts > 0)
        intent = command.intent
        started = time.monotonic()
        outcome: Outcome | None = None
        marker_ = intent.marker
        if again and intent.rerunnable and intent.tool == "bash":
            marker_ = f"{intent.marker}-r{envelope.deliveries if envelope else 0}"
        # Only bash may not run twice: write_file writes the same bytes again, the rest read.
        if again and not intent.rerunnable and intent.tool == "bash":
            if fresh and not had_container:
                pass  # no container was ever made for it: it never ran
            elif fresh:  # the container it may have run in is gone, and what it did with it
                outcome = Outcome(state="interrupted", exit_code=None, output="", output_bytes=0)
            else:
                outcome = await docker.recover(container, intent.marker)
                if outcome.state == "not_started":
                    outcome = None
        content, is_error = "", False
        if outcome is None:
            await self._forget(ctx.state, docker, container, intent.marker if again else None)
            kill_point("sandbox.executing")
            ctx.ensure_lease()
            content, is_error, outcome = await self._call(docker, container, intent, marker_)
            kill_point("sandbox.executed")
        else:
            content, is_error = _recovered(intent, outcome)
        checkpoint_id = ctx.state.checkpoint
        # send_file checkpoints too: the channel sends the file from the checkpoint named here.
        if (intent.tool in CHANGES_WORKSPACE and outcome is not None) or (
            intent.tool == "send_file" and not is_error
        ):
            try:
                checkpoint_id = await self._checkpoint(ctx, docker, store, container)
            except WorkspaceTooLarge as exc:
                content += (
                    f"\n[the workspace was not checkpointed: {exc}. Until it is back under "
                    "its size, files written since the last checkpoint are lost with the "
                    "container.]"
                )
        finished = CommandFinished(
            call_id=intent.call_id,
            state=outcome.state if outcome is not None else "finished",
            exit_code=outcome.exit_code if outcome is not None else None,
            content=content,
            is_error=is_error,
            output_bytes=outcome.output_bytes if outcome is not None else 0,
            timed_out=bool(outcome and outcome.timed_out),
            oom_killed=bool(outcome and outcome.oom_killed),
            checkpoint=checkpoint_id,
            seconds=round(time.monotonic() - started, 3),
            marker=marker_,
            at=time.time(),
        )
        self._finish(ctx, command, finished)
        if intent.tool == "bash":
            self._records.append(marker_)

    async def _forget(
        self, state: SandboxState, docker: Docker, container: str, rerun: str | None
    ) -> None:
        """Drop the container's records of commands whose results are journaled (their stored
        output fills /tmp otherwise), and the record of a rerunnable command run again.

        An activation drops the records of the commands it journaled before its next one; the
        last command journaled before this activation (its predecessor passivated, or died,
        before another came) is dropped by this activation's first command."""
        if not self._swept:
            self._swept = True
            self._records.extend(_last_journaled(state))
        for marker_ in dict.fromkeys([*self._records, *([rerun] if rerun else [])]):
            await docker.forget(container, marker_)
        self._records.clear()

    async def _call(
        self, docker: Docker, container: str, intent: CommandIntended, marker_: str
    ) -> tuple[str, bool, Outcome | None]:
        """Run one tool call in the container: (what the model is told, is it an error, the
        command's outcome for ``bash``)."""
        args = intent.arguments
        cap = self.settings.output_cap
        try:
            if intent.tool == "bash":
                command = str(args.get("command", ""))
                outcome = await docker.run(
                    container,
                    marker=marker_,
                    command=command,
                    timeout=self.settings.command_timeout,
                    output_cap=cap,
                )
                return _shown(command, outcome, self.settings), _failed(outcome), outcome
            path = str(args.get("path", "."))
            if intent.tool == "read_file":
                data, size = await docker.read_file(container, path, cap)
                text = data.decode("utf-8", errors="replace")
                if size > len(data):
                    text += f"\n[file cut: {size} bytes, the first {len(data)} shown]"
                return text, False, None
            if intent.tool == "write_file":
                data = str(args.get("content", "")).encode("utf-8", "surrogatepass")
                await docker.write_file(container, path, data)
                done = Outcome(state="finished", exit_code=0, output="", output_bytes=0)
                return f"wrote {len(data)} bytes to {path}", False, done
            if intent.tool == "send_file":
                _, size = await docker.read_file(container, path, 0)
                if size > SEND_MAX:
                    return f"send_file refused: {path} is {size} bytes, over {SEND_MAX}", True, None
                if size == 0:
                    return f"send_file refused: {path} is empty", True, None
                return f"{path} ({size} bytes) will be sent to the chat", False, None
            if intent.tool == "list_files":
                entries = await docker.list_files(container, path, recursive=True, limit=_LISTED)
                text = _listing(path, entries)
                if len(entries) >= _LISTED:
                    text += f"\n[the list stops at {_LISTED} entries: list a subdirectory]"
                return text, False, None
        except PathRefused as exc:  # a path outside the workspace, or not one
            return f"{intent.tool} refused: {exc}", True, None
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            return f"{intent.tool} failed: {exc.strerror or exc}", True, None
        return f"unknown sandbox tool {intent.tool!r}", True, None

    async def _ready(
        self, ctx: Context[SandboxState], docker: Docker, store: WorkspaceStore
    ) -> tuple[str, bool]:
        """The run's container, running, with its workspace: adopted by its labels, started
        again (and its workspace restored), or made anew from the last checkpoint. Returns its id
        and whether it is new since the last command (what ran before is not in it)."""
        state = ctx.state
        found = await docker.find(self.run_id)
        fresh = False
        if found is None:
            await docker.check_image(self.settings.image)
            kill_point("sandbox.creating")
            labels = {
                _LABEL_RUN: self.run_id,
                _LABEL_SANDBOX: self.actor_id,
                runtime.SCOPE_LABEL: runtime.of(ctx).scope,
            }
            container = await docker.create(
                name=container_name(self.actor_id),
                image=self.settings.image,
                limits=_limits(self.settings),
                labels=labels,
            )
            ctx.emit(
                SandboxCreated(
                    container_id=container,
                    name=container_name(self.actor_id),
                    image=self.settings.image,
                    at=time.time(),
                )
            )
            fresh = True
        else:
            container = found.container_id
            if container != state.container_id:
                ctx.emit(
                    SandboxCreated(
                        container_id=container,
                        name=found.name,
                        image=self.settings.image,
                        adopted=True,
                        at=time.time(),
                    )
                )
            fresh = found.state != "running" or state.status == "stopped"
        if fresh:
            kill_point("sandbox.starting")
            await docker.start(container)
            await self._restore(ctx, docker, store, container)
        elif not self._attached:
            killed = await docker.kill_all(container)
            if killed:
                log.warning("%s: killed %d command(s) left from before", self.actor_id, killed)
        self._attached = True
        return container, fresh

    async def _restore(
        self, ctx: Context[SandboxState], docker: Docker, store: WorkspaceStore, container: str
    ) -> None:
        """Put the last checkpoint's workspace in a container that has none."""
        checkpoint_id = ctx.state.checkpoint
        if checkpoint_id is None:
            return
        tar = await restore(store, checkpoint_id)
        await docker.import_(container, tar, clear=True)
        manifest = await self._last_manifest(store, checkpoint_id)
        ctx.emit(
            SandboxRestored(
                container_id=container,
                checkpoint=checkpoint_id,
                files=manifest.files,
                at=time.time(),
            )
        )
        ctx.send(
            self.run_id,
            SandboxNotice(
                text=f"sandbox container started anew; workspace restored from checkpoint "
                f"{checkpoint_id[:12]} ({manifest.files} files)"
            ),
        )

    async def _last_manifest(self, store: WorkspaceStore, checkpoint_id: str) -> Manifest:
        if self._manifest is None or self._manifest.id != checkpoint_id:
            self._manifest = await load_manifest(store, checkpoint_id)
        return self._manifest

    async def _checkpoint(
        self, ctx: Context[SandboxState], docker: Docker, store: WorkspaceStore, container: str
    ) -> str | None:
        """Checkpoint the workspace if it changed; the id of its latest checkpoint."""
        previous = ctx.state.checkpoint
        before = await self._last_manifest(store, previous) if previous else None
        tar = await docker.export(container, self.settings.workspace_size)
        manifest, stats = await checkpoint(store, tar, before)
        kill_point("sandbox.checkpointing")
        self._manifest = manifest
        if not stats.unchanged:
            ctx.emit(
                Checkpointed(
                    checkpoint=stats.manifest_id,
                    files=stats.files,
                    bytes=stats.bytes_total,
                    uploaded_bytes=stats.bytes_uploaded,
                    blobs_uploaded=stats.blobs_uploaded,
                    at=time.time(),
                )
            )
        return stats.manifest_id

    def _finish(
        self,
        ctx: Context[SandboxState],
        command: Command,
        finished: CommandFinished,
        *,
        fatal: bool = False,
    ) -> None:
        ctx.emit(finished)
        ctx.send(self.run_id, _done(finished, fatal=fatal))
        ctx.set_timer("idle", self.settings.idle_stop, Idle(commands=ctx.state.finished))

    async def _idle(self, ctx: Context[SandboxState], msg: Idle) -> None:
        """Stop a container that has had no command since the timer was set (a parked run
        holds no container running); the next command starts it again."""
        state = ctx.state
        if state.finished != msg.commands or state.status != "running" or state.open:
            return
        docker, _ = runtime.of(ctx).current()
        if state.container_id is not None:
            await docker.stop(state.container_id)
        ctx.emit(SandboxStopped(reason=f"idle for {self.settings.idle_stop:g}s", at=time.time()))

    async def _reap(self, ctx: Context[SandboxState]) -> None:
        """The run ended: remove the container (the checkpoints stay in the store)."""
        if ctx.state.status == "reaped":
            return
        docker, _ = runtime.of(ctx).current()
        found = await docker.find(self.run_id)
        if found is not None:
            await docker.remove(found.container_id)
        ctx.cancel_timer("idle")
        ctx.emit(SandboxReaped(at=time.time()))

    async def _write_files(self, ctx: Context[SandboxState], msg: WriteFiles) -> None:
        """Files written from outside the run (the workspace-file API), then checkpointed."""
        docker, store = runtime.of(ctx).current()
        container, _ = await self._ready(ctx, docker, store)
        try:
            for path, content in msg.files.items():
                await docker.write_file(container, path, base64.b64decode(content, validate=True))
        except ValueError as exc:
            ctx.reply({"ok": False, "error": str(exc)})
            return
        checkpoint_id = await self._checkpoint(ctx, docker, store, container)
        ctx.set_timer("idle", self.settings.idle_stop, Idle(commands=ctx.state.finished))
        ctx.reply({"ok": True, "checkpoint": checkpoint_id})


def _last_journaled(state: SandboxState) -> list[str]:
    """The marker of the bash command whose result was journaled last, if any."""
    done = [
        c for c in state.commands.values() if c.intent.tool == "bash" and c.finished is not None
    ]
    last = max(done, key=lambda c: c.finished.at if c.finished else 0.0, default=None)
    if last is None or last.finished is None:
        return []
    return [last.finished.marker or last.intent.marker]


def _limits(settings: Sandbox) -> Limits:
    return Limits(
        memory_bytes=settings.memory,
        cpus=settings.cpus,
        pids=settings.pids,
        workspace_bytes=settings.workspace_size,
        tmp_bytes=settings.tmp_size,
        records_bytes=max(16 * 1024**2, 2 * settings.output_cap + 1024**2),
        network=settings.network,
    )


def _done(finished: CommandFinished, *, fatal: bool = False) -> SandboxDone:
    return SandboxDone(
        call_id=finished.call_id,
        content=finished.content,
        is_error=finished.is_error,
        checkpoint=finished.checkpoint,
        fatal=fatal,
    )


def _refused(command: Command, text: str) -> CommandFinished:
    return CommandFinished(
        call_id=command.intent.call_id,
        state="refused",
        exit_code=None,
        content=text,
        is_error=True,
        at=time.time(),
    )


def _failed(outcome: Outcome) -> bool:
    """A command that could not finish by itself is an error; a non-zero exit is not (it is
    what the command said, shown to the model with its code)."""
    return outcome.timed_out or outcome.oom_killed or outcome.state != "finished"


def _shown(command: str, outcome: Outcome, settings: Sandbox) -> str:
    """What the model is told of a finished command: where it ran, how it ended, its output."""
    if outcome.timed_out:
        end = f"killed at the time limit of {settings.command_timeout:g}s"
    elif outcome.oom_killed:
        end = f"killed: out of memory (limit {settings.memory // 1024**2} MiB)"
    else:
        end = f"exit {outcome.exit_code}"
    text = f"$ {command}\n[in {WORKSPACE}; {end}]\n{outcome.output}"
    if outcome.truncated:
        kept = len(outcome.output.encode("utf-8", "surrogatepass"))
        text += f"\n[output cut: {outcome.output_bytes} bytes written, the first {kept} shown]"
    return text


def _recovered(intent: CommandIntended, outcome: Outcome) -> tuple[str, bool]:
    """What the model is told of a command that was running when its worker stopped."""
    command = str(intent.arguments.get("command", intent.arguments.get("path", "")))
    if outcome.state == "finished":
        return (
            f"$ {command}\n[in {WORKSPACE}; exit {outcome.exit_code}; finished while its "
            f"worker was stopping: the output is what was kept]\n{outcome.output}",
            False,
        )
    partial = f"\n[output before the interruption]\n{outcome.output}" if outcome.output else ""
    return (
        f"$ {command}\n[in {WORKSPACE}; interrupted: the worker running it stopped before it "
        "finished. Exit status unknown; it was killed if it was still running, and is not run "
        f"again by itself (at-most-once). Check what it did before running it again.]{partial}",
        True,
    )


def _listing(path: str, entries: list[tuple[str, str, int]]) -> str:
    if not entries:
        return f"{path}: empty"
    lines = [
        f"{name}/"
        if kind == "dir"
        else f"{name} -> (link)"
        if kind == "link"
        else f"{name}  {size}"
        for name, kind, size in entries
    ]
    return "\n".join(lines)
