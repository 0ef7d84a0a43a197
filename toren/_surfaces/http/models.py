"""What the API accepts and returns: pydantic models, from which the OpenAPI document's schemas
are generated, so the document and the handlers cannot drift apart."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)
from pydantic.json_schema import SkipJsonSchema

from toren.runs.limits import Shown as RunStatus

# Identifiers (keys) cannot hold NUL; text that is journaled (inputs, messages, reasons) can,
# and round-trips exactly.
NO_NUL = r"^[^\x00]*$"
AGENT_NAME = r"^[A-Za-z0-9_.-]+$"
CALL_ID = r"^[^\x00]+$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StartRunBody(_Strict):
    agent: str = Field(min_length=1, max_length=100, pattern=AGENT_NAME)
    input: str = Field(
        min_length=1,
        description="Up to `max_message_bytes` (64 KiB by default) in UTF-8; longer: 413.",
    )
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=200, pattern=NO_NUL)
    concurrency_key: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        pattern=NO_NUL,
        description="Runs of the agent that share this key go at most `max_runs_per_key` at "
        "a time (1 by default: one at a time, in order of arrival); the others are `queued`. "
        "Up to 200 bytes in UTF-8.",
    )


class Queued(BaseModel):
    limit: str = Field(
        description="The concurrency limit the run waits for: `agent/<agent>` (the agent's "
        "`max_runs`) or `key/<agent>/<concurrency key>` (`max_runs_per_key`)."
    )
    position: int = Field(description="Its place in that limit's queue (1: next).")
    cap: int | None = Field(description="The limit's cap.")


class MessageBody(_Strict):
    text: str = Field(
        min_length=1,
        description="Up to `max_message_bytes` (64 KiB by default) in UTF-8; longer: 413. "
        "Never truncated; any text (NUL included) is recorded exactly.",
    )


class ApprovalBody(_Strict):
    call_id: str = Field(
        min_length=1,
        max_length=200,
        pattern=CALL_ID,
        description="The waiting call this decides (`waiting_on[].call_id` of the run; a "
        "call a child run waits on is decided from its parent's page too: the decision goes "
        "to `waiting_on[].run`).",
    )
    approved: bool
    reason: str = Field(default="", max_length=2_000)
    run: str | None = Field(
        default=None,
        pattern=r"^(run/)?[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
        description="The run whose call this decides (`waiting_on[].run`): this run, or a run "
        "below it that it waits on. Needed only when the call id waits in more than one (409 "
        "otherwise).",
    )


class CancelBody(_Strict):
    reason: str = Field(default="", max_length=2_000)


class RetryBody(_Strict):
    """A retry resumes the run as it failed (an empty object, or no body); with ``upgrade``,
    on the newest version of its agent."""

    upgrade: bool = Field(
        default=False,
        description="Move the run to the newest version of its agent first (as `POST "
        "/runs/{uuid}/upgrade` does): for a failure whose fix exists only in that version.",
    )


class ForkBody(_Strict):
    at: int = Field(
        ge=1,
        le=2**31 - 1,
        description="The step to go back to: model call `at` (as the run's timeline numbers "
        "them, from 1) is made again; the calls before it are copied from the run and "
        "replayed, not paid again.",
    )
    upgrade: bool = Field(
        default=False,
        description="Run the rest on the agent's current version (else on the run's).",
    )
    message: str | None = Field(
        default=None,
        description="Replaces the last human message before the step. Up to "
        "`max_message_bytes` in UTF-8; no NUL. Not with `input`.",
    )
    input: str | None = Field(
        default=None,
        description="Replaces the run's input. Up to `max_message_bytes` in UTF-8; no NUL. "
        "Not with `message`.",
    )


class ForkedFrom(BaseModel):
    run: str = Field(description="The run this one was forked from.")
    step: int = Field(description="The step it was forked at: the first call made again.")
    calls_replayed: int = Field(
        description="The calls it took from that run by value: replayed, not paid again."
    )
    usd_not_repaid: str = Field(description="What those calls had cost.")


class Forked(BaseModel):
    id: str = Field(description="The new run: `run/<uuid>`.")
    forked_from: ForkedFrom


class Receipt(BaseModel):
    calls_made: int
    calls_replayed: int
    input_tokens: int
    output_tokens: int
    usd_paid: str
    usd_not_repaid: str
    unpriced_calls: int
    child_runs: int = Field(default=0, description="Child runs this run's calls started.")
    child_calls_made: int = 0
    child_usd_paid: str = "0"
    usd_total: str = Field(default="0", description="This run's and its children's dollars.")
    compactions_soft: int = Field(
        default=0, description="Context compactions that elided old tool results."
    )
    compactions_hard: int = Field(
        default=0,
        description="Context compactions that summarised older turns (each a model call, "
        "counted in calls_made and paid like any).",
    )
    tokens_saved: int = Field(
        default=0,
        description="Input tokens the compactions took out of the requests that triggered "
        "them (estimated).",
    )
    calls_lost: int = Field(
        default=0,
        description="Model calls lost in flight: sent by a worker that stopped before it "
        "recorded the answer, then made again (not in calls_made). The provider may have "
        "billed each: calls_made + calls_lost is what it was asked.",
    )
    usd_lost_estimated: str = Field(
        default="0",
        description="What the calls lost in flight cost, estimated (their estimated input "
        "tokens at the model's price; not in usd_paid or usd_total).",
    )
    child_calls_lost: int = Field(
        default=0, description="Model calls of the child runs lost in flight."
    )
    child_usd_lost_estimated: str = Field(
        default="0", description="What the child runs' calls lost in flight cost, estimated."
    )
    calls_inherited: int = Field(
        default=0,
        description="A fork's calls copied from the run it was forked from: replayed, not "
        "made or paid by it (not in calls_made or usd_paid; in calls_replayed).",
    )
    usd_inherited: str = Field(
        default="0",
        description="What those calls cost the run they were copied from (in usd_not_repaid).",
    )


def _no_default(schema: dict[str, Any]) -> None:
    """A field the API leaves out rather than send null: no ``default: null`` in the
    document."""
    schema.pop("default", None)


class PendingApproval(BaseModel):
    call_id: str
    tool: str
    arguments: dict[str, Any]
    run: str = Field(
        description="The run whose call this is: this run, or a run below it (a child of its "
        "cross-agent calls)."
    )
    agent: str = Field(description="That run's agent (a token limited to agents needs it).")
    cwd: str | SkipJsonSchema[None] = Field(
        default=None,
        description="A sandboxed command's working directory (`/workspace`): the approval "
        "shows the exact command (`arguments.command`) and where it runs. Absent for a call "
        "that runs outside a sandbox.",
        json_schema_extra=_no_default,
    )

    @model_serializer(mode="wrap")
    def _absent_cwd(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        shown: dict[str, Any] = handler(self)
        if shown.get("cwd") is None:
            shown.pop("cwd", None)  # absent, not null, for a call outside a sandbox
        return shown


class ChildRun(BaseModel):
    run: str = Field(description="The child run a cross-agent call started.")
    agent: str
    call_id: str = Field(description="The call of this run that started it.")
    status: RunStatus
    usd_paid: str | None = Field(
        description="What it cost (its children included), once it ended; null while it runs."
    )


_VERSION = (
    "The agent version the run is pinned to (its route `agent:NAME@VERSION`); null while it "
    "is not pinned (not started yet, or run under the `upgrade` policy)."
)
_WAITING_FOR = (
    "Status `parked` because no live worker serves the version the run is pinned to: "
    "`waiting for a worker serving version V`. It goes on when a worker serving V starts, or "
    "once upgraded (`POST /runs/{uuid}/upgrade`). Null otherwise."
)


class RunSummary(BaseModel):
    id: str = Field(description="The run's id: `run/<uuid>`; paths take the uuid.")
    agent: str
    status: RunStatus
    input: str = Field(description="The first 200 characters of the input.")
    calls_made: int
    usd_paid: str
    error_class: str | None
    created_at: str
    queued_for: str | None = Field(
        default=None, description="Status `queued`: the concurrency limit the run waits for."
    )
    queue_position: int | None = Field(
        default=None, description="Status `queued`: its place in that limit's queue."
    )
    version: str | None = Field(default=None, description=_VERSION)
    waiting_for: str | None = Field(default=None, description=_WAITING_FOR)


class ScheduledBy(BaseModel):
    name: str = Field(description="The schedule: `AGENT/SLOT`.")
    slot: str = Field(description="Its slot: an instant in UTC, or `manual-ID` for a trigger.")


class Pruned(BaseModel):
    """What the audit record of a pruned run keeps beyond a run's fields (its journal is
    gone: no events, no timeline; ``toren jobs restore`` reads its archive, if any)."""

    pruned_at: str = Field(description="When its journal and row were deleted.")
    events: int = Field(description="How many events its journal held.")
    archive: dict[str, Any] | None = Field(
        description="Where its journal was archived (location, sha256, seqs, bytes), or null."
    )
    started_by: dict[str, Any] | None = Field(description="Who started it, and via what.")
    decisions: list[dict[str, Any]] = Field(
        description="Each decision on its calls: call_id, tool, approved, by, who, reason, "
        "channel, at."
    )


class Run(BaseModel):
    id: str
    agent: str
    status: RunStatus = Field(
        description="`cancelled`: ended by a cancel (`error_class` `cancelled`), apart from "
        "`failed`; a cancelled run is not retried. `queued`: the run waits for a slot of a "
        "concurrency limit (`queued` says which); it starts when a run ahead of it parks or "
        "ends."
    )
    input: str
    output: str | None
    error_class: str | None
    error: str | None
    created_at: str
    waiting_on: list[PendingApproval]
    receipt: Receipt
    parent: str | None = Field(
        default=None, description="The run whose cross-agent call started this one."
    )
    children: list[ChildRun] = Field(default_factory=list)
    schedule: ScheduledBy | None = Field(
        default=None, description="The schedule and slot that started this run, if one did."
    )
    concurrency_key: str | None = Field(
        default=None, description="The concurrency key it was started with."
    )
    queued: Queued | None = Field(
        default=None, description="Status `queued`: the limit it waits for, and where."
    )
    version: str | None = Field(default=None, description=_VERSION)
    waiting_for: str | None = Field(default=None, description=_WAITING_FOR)
    forked_from: ForkedFrom | None = Field(
        default=None, description="The run and step this run was forked from, if it is a fork."
    )
    pruned: Pruned | None = Field(
        default=None,
        description="Set when the run was pruned (retention): it is shown from its audit "
        "record; `input` and `output` are not kept (empty and null).",
    )


class RunList(BaseModel):
    runs: list[RunSummary]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page.")


class Event(BaseModel):
    seq: int
    type: str
    data: dict[str, Any]
    at: str


class EventList(BaseModel):
    events: list[Event]


class Accepted(BaseModel):
    run: str
    accepted: Literal[True] = True


class Decision(BaseModel):
    """What became of a decision: ``applied`` now, ``repeated`` (the call was already decided
    the same way), or ``pending`` (no worker answered in time: it is applied only if the call
    still waits when the run handles it)."""

    run: str
    call_id: str
    outcome: Literal["applied", "repeated", "pending"]
    detail: str


class WorkerInfo(BaseModel):
    worker_id: str
    name: str
    version: str
    heartbeat_at: str


class VersionRuns(BaseModel):
    """An agent version that still has runs not ended."""

    agent: str
    version: str
    unfinished_runs: int
    served: bool = Field(description="A live worker serves it; if not, its runs are parked.")


class Health(BaseModel):
    """Whether the database answers and workers are live. ``workers``, ``versions`` and
    ``agent_versions`` are shown only to an authenticated caller (they name hosts and
    versions); anonymously they are null."""

    status: Literal["ok", "degraded"]
    database: bool
    workers_live: int
    workers: list[WorkerInfo] | None
    versions: list[str] | None
    version_skew: bool
    agent_versions: list[VersionRuns] | None = Field(
        default=None,
        description="The agent versions that still have runs not ended, each with whether a "
        "live worker serves it (`served: false`: its runs are parked).",
    )


class VersionWorker(BaseModel):
    """A live worker serving an agent version."""

    worker_id: str
    name: str
    code_version: str = Field(
        description="The worker's code version as `toren workers` shows it (Toren's version, "
        "`+LABEL` with a deploy label)."
    )
    deploy_label: str | None
    started_at: str


class AgentVersionItem(BaseModel):
    version: str = Field(description="The agent version: 12 hex characters.")
    policy: str | None = Field(
        description="`pin`, `upgrade` or `next_turn`, as its newest worker publishes it; null "
        "when no live worker serves it."
    )
    newest: bool = Field(description="What an upgrade moves a run to.")
    served: bool = Field(description="A live worker serves it; if not, its runs are parked.")
    workers: list[VersionWorker]
    unfinished_runs: int = Field(description="Runs not ended that are pinned to it.")


class AgentVersions(BaseModel):
    agent: str
    newest: str | None = Field(
        description="Of the versions live workers serve, the one first seen latest; null "
        "when no live worker serves the agent."
    )
    versions: list[AgentVersionItem] = Field(
        description="The newest first, then the versions no live worker serves."
    )
    unpinned_runs: int = Field(
        description="Runs not ended and not pinned to a version (not started yet, or run "
        "under the `upgrade` policy)."
    )
    stranded_runs: int = Field(description="Runs pinned to a version no live worker serves.")


class AgentVersionList(BaseModel):
    agents: list[AgentVersions]


class UpgradeBody(_Strict):
    """Nothing: the run moves to the newest version of its agent (an empty object, or no
    body)."""


class Upgraded(BaseModel):
    run: str
    from_version: str | None = Field(
        description="The version it was pinned to (null: it was not pinned)."
    )
    to_version: str = Field(description="The version it moves to: its agent's newest.")
    accepted: Literal[True] = True


WorkerState = Literal["starting", "running", "reconnecting", "draining"]


class Readiness(BaseModel):
    """Whether this server process should get traffic: the database answers, its schema is
    migrated, and, in a process that runs a worker too (``toren up``), that worker is
    registered and not draining. ``reason`` says what is missing when ``ready`` is false."""

    ready: bool
    reason: str | None
    database: bool
    schema_version: int
    schema_latest: int
    worker: WorkerState | None = Field(
        description="This process's worker; null when the process runs none (`toren serve`)."
    )


class FieldError(BaseModel):
    field: str
    message: str


class Problem(BaseModel):
    """An RFC 9457 problem document."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str
    errors: list[FieldError] = []


BOT_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class ChannelChat(BaseModel):
    """A chat paired with a channel's bot."""

    chat_id: int
    title: str = Field(description="The chat's title or its user's name, as Telegram gave it.")
    type: str = Field(description="`private`, `group`, `supergroup` (as Telegram gave it).")
    paired_by: str = Field(description="The name of the Telegram user who sent the code.")
    paired_by_id: str = Field(description="Their stable identity: `telegram:<user id>`.")
    paired_at: str
    blocked: bool = Field(
        description="The user blocked the bot: nothing is sent until they write again."
    )
    run: str | None = Field(description="The chat's conversation run, once it wrote.")


class ChannelFailing(BaseModel):
    """Telegram does not answer the channel's bot, or refuses it."""

    since: str = Field(description="When it began (the first failure of this outage).")
    error: str = Field(description="Why (the last reason recorded; never the bot's token).")


class Channel(BaseModel):
    """A Telegram bot's channel (``channel/telegram/<bot>``), from its row's summary."""

    bot: str
    channel: str = Field(description="The channel actor's id: `channel/telegram/<bot>`.")
    agent: str
    username: str = Field(description="The bot's @username (empty until a worker started it).")
    status: str = Field(description="The channel actor's status: `live`, `failed`, `stopped`.")
    chats: list[ChannelChat]
    pending: int = Field(description="Outbound messages queued or being sent.")
    sent: int
    failed: int = Field(description="Outbound messages lost, blocked or refused.")
    updates: int = Field(
        description="Updates from Telegram recorded (not those of unpaired chats that did nothing)."
    )
    observing: list[str] = Field(description="Runs and agents its chats observe.")
    failing: ChannelFailing | None = Field(
        default=None,
        description="Set while Telegram does not answer the bot (null once it answers again).",
    )


class ChannelList(BaseModel):
    channels: list[Channel]


class OutboundMessage(BaseModel):
    """One outbound message of a channel and its delivery state."""

    n: int = Field(description="Its number in the channel's outbox (in order).")
    chat_id: int = Field(description="Where it goes (a migrated chat's new id).")
    kind: str = Field(
        description="`text` (a run's reply), `prompt` (an approval prompt), `notice`, "
        "`observer`, `file`."
    )
    state: str = Field(
        description="`queued`, `sending` (at-most-once: being sent), `sent`, `lost` "
        "(at-most-once: the worker stopped during its send), `blocked` (the user blocked the "
        "bot), `refused` (Telegram refused it for good)."
    )
    text: str = Field(description="Its first 300 characters.")
    queued_at: str
    at: str = Field(description="When its state last changed.")
    age_seconds: float = Field(description="Seconds since it was queued.")
    message_ids: list[int] = Field(description="Telegram's ids of what was sent.")
    source: str = Field(description="What caused it: `run/<uuid>#<seq>`, or empty.")


class ChannelMessages(BaseModel):
    bot: str
    messages: list[OutboundMessage] = Field(
        description="Pending ones and the last 200 delivered or failed, oldest first."
    )


class WebhookAck(BaseModel):
    ok: Literal[True] = True
