"""The step statement and the claim, composed from named fragments with generated parameters.

A step is one statement (see :mod:`toren._core.mailbox`). Its parts are fragments, each one or
more CTEs named for what they do, in the order Postgres needs them (a CTE reads only the ones
before it)::

    fence      fence      the actor's row, if still ours, share-locked for the statement
    clash      clash      a spawn of an id that an actor of another kind holds
    consume    consumed   the message handled, deleted (nothing else happens without it)
    timers     cancelled  the timers set or cancelled, what was pending under their names removed
    limits     lim        an actor under limits: whether it still holds its permits, or (with
                          {release}) its permits given back and handed to the heads of queues
    claim      nxt        the actor's next queued message, when the step claims one
               claimed    ... its delivery count raised
    journal    ev         the events appended
    spawn      sp         the children created
    outbox     o          the messages sent, as rows
    claim_own  own        nothing queued to claim: the first due message the step sends itself
    send       dd         the dedupe keys of the messages sent, taken
               sent       the messages sent, inserted
    reply      rep        the reply to an ask()
    summary    summed     the actor's summary (unless the step re-routes it: then in routed)
    route      routed     the actor's new route (Context.reroute), with its summary
    notify     woken      recipients, askers and journal followers notified
    next       next       the message claimed (queued or sent), handed back
    result     (SELECT)   what the step did, counted, and the message claimed

The claim (:data:`CLAIM_FRAGMENTS`) is ``fence``, ``limits`` (``held``: the permits of an actor
under limits, taken if it lacks them and has user mail, else its place in the queue), ``claim``
and ``result``. Limits are described in :mod:`toren._core.limits`.

Fragments name their inputs (``{actor_id}``), never their numbers: :func:`render` numbers the
parameters from the fields of the inputs' record (:class:`StepInputs`, :class:`ClaimInputs`),
in field order, and :func:`arguments` lists a record's values in that same order. A chaos
mutation replaces a fragment by name: ``step_statement({**STEP_FRAGMENTS, "fence": ...})``.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs

from toren._core.errors import InternalError


@attrs.frozen(kw_only=True)
class StepInputs:
    """What a step commits; the order of the fields is the order of the statement's parameters."""

    actor_id: str
    owner: uuid.UUID
    epoch: int
    message_id: int  # the message handled
    event_seqs: Sequence[int]
    event_types: Sequence[str]
    event_data: Sequence[str]  # JSON text
    spawn_ids: Sequence[str]
    spawn_kinds: Sequence[str]
    spawn_args: Sequence[dict[str, Any]]
    replaced_timers: Sequence[str]  # cancelled, or set again (whatever is pending is removed)
    out_recipients: Sequence[str]
    out_lanes: Sequence[int]
    out_kinds: Sequence[str]
    out_bodies: Sequence[str]  # JSON text
    out_dedupe_keys: Sequence[str | None]
    out_timer_keys: Sequence[str | None]
    out_delays: Sequence[float]
    reply_to: uuid.UUID | None  # None: no reply to store
    reply_kind: str | None
    reply_body: str | None  # JSON text
    summary: dict[str, Any] | None  # None: the summary is left as it is
    claim: bool  # claim the actor's next message in the same statement
    spawn_routes: Sequence[str | None]
    # JSON text: the limits each child must hold to run (shorter than spawn_ids: none)
    spawn_limits: Sequence[str | None] = ()
    release: bool = False  # the actor no longer runs after this step: its permits go back
    route: str | None = None  # None: the actor's route is left as it is


@attrs.frozen(kw_only=True)
class ClaimInputs:
    """What a claim names; the order of the fields is the order of the statement's parameters."""

    actor_id: str
    owner: uuid.UUID
    epoch: int


_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def render(template: str, inputs: type[attrs.AttrsInstance]) -> str:
    """``template`` with each ``{field}`` of ``inputs`` replaced by its parameter, ``$n``.

    Raises:
        InternalError: the template names something that is not a field of ``inputs``.
    """
    numbers = {field.name: n for n, field in enumerate(attrs.fields(inputs), start=1)}

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in numbers:
            raise InternalError(f"a statement names {{{name}}}, no field of {inputs.__name__}")
        return f"${numbers[name]}"

    return _PLACEHOLDER.sub(number, template)


def arguments(inputs: attrs.AttrsInstance) -> tuple[Any, ...]:
    """The values of ``inputs`` in the order :func:`render` numbers them."""
    return tuple(getattr(inputs, field.name) for field in attrs.fields(type(inputs)))


def _compose(
    fragments: Mapping[str, str], parts: Mapping[str, str], inputs: type[attrs.AttrsInstance]
) -> str:
    """The statement whose CTEs are ``fragments`` (named as in ``parts``, in its order), the
    last one, ``result``, its final SELECT.

    Raises:
        InternalError: ``fragments`` leaves a part out or names one that does not exist.
    """
    if set(fragments) != set(parts):
        missing, unknown = sorted(set(parts) - set(fragments)), sorted(set(fragments) - set(parts))
        raise InternalError(f"statement fragments: missing {missing}, unknown {unknown}")
    ctes = ", ".join(fragments[name] for name in parts if name != "result")
    return render(f"\nWITH {ctes}\n{fragments['result']}\n", inputs)


_CLAIMED_RETURNING = """\
    RETURNING m.id, m.lane, m.sender, m.kind, m.body, m.reply_to, m.deliveries, m.attempts,
              m.timer_name IS NOT NULL AS is_timer"""

STEP_FRAGMENTS: Mapping[str, str] = MappingProxyType(
    {
        "fence": """fence AS (
    -- The row locked is its latest version: a watch set while this statement waited for the
    -- lock is seen here (see toren._core.client.JournalWatch).
    SELECT actor_id, watched_until, limits FROM toren.actors
    WHERE actor_id = {actor_id} AND owner = {owner} AND epoch = {epoch} AND status = 'live'
    FOR SHARE
)""",
        "clash": """clash AS (
    -- A spawn of an id that another kind holds fails the whole step.
    SELECT s.id, s.kind, a.kind AS existing
    FROM unnest({spawn_ids}::text[], {spawn_kinds}::text[]) AS s(id, kind)
    JOIN toren.actors a ON a.actor_id = s.id AND a.kind <> s.kind
)""",
        "consume": """consumed AS (
    DELETE FROM toren.mailbox m USING fence
    WHERE m.id = {message_id} AND m.actor_id = fence.actor_id AND NOT EXISTS (SELECT 1 FROM clash)
    RETURNING m.id
)""",
        "timers": """cancelled AS (
    -- Setting or cancelling a timer replaces whatever is pending under its name (also a timer
    -- being retried), except the message this step consumes.
    DELETE FROM toren.mailbox m USING consumed
    WHERE m.actor_id = {actor_id} AND m.timer_name = ANY({replaced_timers}::text[])
      AND m.id <> {message_id}
    RETURNING 1
)""",
        "limits": """lim AS (
    -- Only for an actor under limits (actors.limits; every other actor pays nothing here). It
    -- claims its next user message in this step only while it holds all its permits. A step
    -- after which it no longer runs (release: it parked on a human, a timer or a child, or
    -- ended) gives them back and leaves every queue, and each permit freed goes to the head of
    -- its limit's queue, woken at commit: the claim that frees a slot starts the next run.
    SELECT CASE WHEN {release} THEN toren.release_permits(fence.actor_id) < 0
                ELSE NOT EXISTS (
                    SELECT 1 FROM unnest(fence.limits) AS u(name)
                    WHERE NOT EXISTS (SELECT 1 FROM toren.permits h
                                      WHERE h.name = u.name AND h.actor_id = fence.actor_id))
           END AS runs
    FROM fence
    WHERE fence.limits IS NOT NULL AND EXISTS (SELECT 1 FROM consumed)
)""",
        "claim": """nxt AS (
    -- With {claim}, the step claims the actor's next message in the same statement (the host then
    -- needs no claim of its own): the first visible one already queued (system lane first), not
    -- a timer this step replaces; else the first due message the step sends itself (in sent).
    SELECT m.id FROM toren.mailbox m
    WHERE {claim} AND m.actor_id = {actor_id} AND m.visible_at <= now() AND m.id <> {message_id}
      AND (m.timer_name IS NULL OR m.timer_name <> ALL({replaced_timers}::text[]))
      AND EXISTS (SELECT 1 FROM consumed)
      AND (m.lane = 0 OR NOT EXISTS (SELECT 1 FROM lim WHERE NOT lim.runs))
    ORDER BY m.lane, m.id LIMIT 1
), claimed AS (
    UPDATE toren.mailbox m SET deliveries = m.deliveries + 1
    FROM nxt WHERE m.id = nxt.id
"""
        + _CLAIMED_RETURNING
        + "\n)",
        "journal": """ev AS (
    INSERT INTO toren.journal (actor_id, seq, epoch, type, data)
    SELECT {actor_id}, e.seq, {epoch}, e.type, e.data::jsonb
    FROM unnest({event_seqs}::bigint[], {event_types}::text[], {event_data}::text[])
        AS e(seq, type, data), consumed
    RETURNING 1
)""",
        "spawn": """sp AS (
    INSERT INTO toren.actors (actor_id, kind, args, parent, route, limits)
    SELECT s.id, s.kind, s.args, {actor_id}, s.route,
           CASE WHEN s.lim IS NOT NULL
                THEN ARRAY(SELECT jsonb_array_elements_text(s.lim::jsonb)) END
    FROM unnest({spawn_ids}::text[], {spawn_kinds}::text[], {spawn_args}::jsonb[],
                {spawn_routes}::text[], {spawn_limits}::text[]) AS s(id, kind, args, route, lim),
         consumed
    ON CONFLICT (actor_id) DO NOTHING
    RETURNING 1
)""",
        "outbox": """o AS (
    SELECT * FROM unnest({out_recipients}::text[], {out_lanes}::int[], {out_kinds}::text[],
                         {out_bodies}::text[], {out_dedupe_keys}::text[],
                         {out_timer_keys}::text[], {out_delays}::float8[]) WITH ORDINALITY
        AS o(recipient, lane, kind, body, dedupe_key, timer_key, delay, ord)
    WHERE EXISTS (SELECT 1 FROM consumed)
)""",
        "claim_own": """own AS (
    -- Nothing queued to claim: the first due message sent to itself is inserted claimed.
    SELECT o.ord FROM o
    WHERE {claim} AND o.recipient = {actor_id} AND o.delay <= 0 AND o.dedupe_key IS NULL
      AND NOT EXISTS (SELECT 1 FROM nxt)
      AND (o.lane = 0 OR NOT EXISTS (SELECT 1 FROM lim WHERE NOT lim.runs))
    ORDER BY o.lane, o.ord LIMIT 1
)""",
        "send": """dd AS (
    INSERT INTO toren.dedupe (actor_id, key)
    SELECT o.recipient, o.dedupe_key FROM o WHERE o.dedupe_key IS NOT NULL
    ON CONFLICT DO NOTHING
    RETURNING actor_id, key
), sent AS (
    INSERT INTO toren.mailbox
        (actor_id, lane, sender, kind, body, dedupe_key, timer_name, visible_at, deliveries)
    SELECT o.recipient, o.lane, {actor_id}, o.kind, o.body::jsonb, o.dedupe_key, o.timer_key,
           now() + make_interval(secs => o.delay),
           CASE WHEN o.ord = (SELECT ord FROM own) THEN 1 ELSE 0 END
    FROM o
    WHERE o.dedupe_key IS NULL
       OR EXISTS (SELECT 1 FROM dd WHERE dd.actor_id = o.recipient AND dd.key = o.dedupe_key)
    RETURNING actor_id, visible_at <= now() AS due, id, lane, sender, kind, body, reply_to,
              deliveries, attempts, timer_name IS NOT NULL AS is_timer
)""",
        "reply": """rep AS (
    INSERT INTO toren.replies (correlation_id, kind, body)
    SELECT {reply_to}, {reply_kind}, {reply_body}::text::jsonb FROM consumed
    WHERE {reply_to}::uuid IS NOT NULL
    ON CONFLICT DO NOTHING
    RETURNING correlation_id
)""",
        "summary": """summed AS (
    UPDATE toren.actors a SET summary = {summary}::jsonb
    FROM consumed WHERE a.actor_id = {actor_id} AND {summary}::jsonb IS NOT NULL
      AND {route}::text IS NULL
    RETURNING 1
)""",
        "route": """routed AS (
    -- Only a step that re-routes its actor (a run pinned to its agent's version): for every
    -- other step {route} is NULL and this writes and reads nothing. One statement updates a
    -- row once: the summary, if the step writes one, is written here with the route.
    UPDATE toren.actors a SET route = {route}::text,
                              summary = coalesce({summary}::jsonb, a.summary)
    FROM consumed WHERE a.actor_id = {actor_id} AND {route}::text IS NOT NULL
    RETURNING 1
)""",
        "notify": """woken AS (
    SELECT pg_notify('toren_mail', r.actor_id)
    FROM (SELECT DISTINCT actor_id FROM sent WHERE due AND actor_id <> {actor_id}) AS r
    UNION ALL
    SELECT pg_notify('toren_reply', r.correlation_id::text) FROM rep AS r
    UNION ALL
    -- Only an actor someone follows is notified of: a commit that notifies is serialized
    -- with every other one that does, WAL flush included.
    SELECT pg_notify('toren_journal', {actor_id}) FROM fence
    WHERE fence.watched_until > now() AND EXISTS (SELECT 1 FROM ev)
)""",
        "next": """next AS (
    SELECT * FROM claimed
    UNION ALL
    SELECT id, lane, sender, kind, body, reply_to, deliveries, attempts, is_timer
    FROM sent WHERE deliveries = 1
)""",
        "result": """\
SELECT (SELECT count(*) FROM fence) AS owned, (SELECT count(*) FROM consumed) AS consumed,
       (SELECT array[id, kind, existing] FROM clash LIMIT 1) AS clash,
       (SELECT count(*) FROM ev) AS events,
       (SELECT count(*) FROM sp) AS spawned, (SELECT count(*) FROM cancelled) AS cancelled,
       (SELECT count(*) FROM sent) AS sent_count, (SELECT count(*) FROM woken) AS woken,
       (SELECT count(*) FROM summed) AS summed, (SELECT count(*) FROM lim) AS limited,
       (SELECT count(*) FROM routed) AS routed, n.*
FROM (SELECT 1) AS one LEFT JOIN (SELECT * FROM next LIMIT 1) AS n ON true""",
    }
)
"""The step's fragments by name, in statement order (see the module's docstring)."""


CLAIM_FRAGMENTS: Mapping[str, str] = MappingProxyType(
    {
        "fence": """fence AS (
    SELECT actor_id, limits FROM toren.actors
    WHERE actor_id = {actor_id} AND owner = {owner} AND epoch = {epoch} AND status = 'live'
    FOR SHARE
)""",
        "limits": """held AS (
    -- An actor under limits with user mail due: its permits, held or taken now; else it keeps
    -- (or takes) its place in the queue of the first limit that is full, and only its system
    -- mail (a cancel) is claimed. Without due user mail nothing is taken.
    SELECT toren.take_permits(fence.actor_id) AS runs FROM fence
    WHERE fence.limits IS NOT NULL
      AND EXISTS (SELECT 1 FROM toren.mailbox u
                  WHERE u.actor_id = fence.actor_id AND u.lane <> 0 AND u.visible_at <= now())
)""",
        "claim": """next AS (
    SELECT id FROM toren.mailbox
    WHERE actor_id = {actor_id} AND visible_at <= now() AND EXISTS (SELECT 1 FROM fence)
      AND (lane = 0 OR NOT EXISTS (SELECT 1 FROM held WHERE NOT held.runs))
    ORDER BY lane, id LIMIT 1
), claimed AS (
    UPDATE toren.mailbox m SET deliveries = m.deliveries + 1
    FROM next WHERE m.id = next.id
"""
        + _CLAIMED_RETURNING
        + "\n)",
        "result": """\
SELECT (SELECT count(*) FROM fence) AS owned,
       (SELECT count(*) FROM held WHERE NOT held.runs) > 0 AS queued, c.*
FROM (SELECT 1) AS one LEFT JOIN claimed AS c ON true""",
    }
)
"""The claim's fragments by name, in statement order."""


def step_statement(fragments: Mapping[str, str] = STEP_FRAGMENTS) -> str:
    """The step statement composed from ``fragments``, its parameters those of
    :class:`StepInputs`.

    Raises:
        InternalError: ``fragments`` does not name the parts of :data:`STEP_FRAGMENTS`, or names
            an input that is not a field of :class:`StepInputs`.
    """
    return _compose(fragments, STEP_FRAGMENTS, StepInputs)


def claim_statement(fragments: Mapping[str, str] = CLAIM_FRAGMENTS) -> str:
    """The claim composed from ``fragments``, its parameters those of :class:`ClaimInputs`.

    Raises:
        InternalError: as :func:`step_statement`, for :data:`CLAIM_FRAGMENTS`.
    """
    return _compose(fragments, CLAIM_FRAGMENTS, ClaimInputs)


STEP = step_statement()
"""The step statement, as :func:`toren._core.mailbox.commit_step` runs it."""

CLAIM = claim_statement()
"""The claim, as :func:`toren._core.mailbox.claim_next` runs it."""
