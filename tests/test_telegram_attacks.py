"""Attacks on the Telegram channel (issue 16 review): each test here failed on the reviewed code
(599fc0c, and still at f983468) and showed one finding; each passes since its fix. They run
against the local Bot API server and the real python-telegram-bot client, with a running
worker (in this process, or a real ``toren worker`` whose DEBUG log is read) unless a test
says otherwise; the file tests need Docker, as tests/test_telegram_files.py does.

Findings, each with its test (the docstring says what broke and the fix suggested):

1. HIGH   a Bot API file path the worker's ``stat()`` refuses raises OSError, taken for a database
          error: the tick is retried for ever and the bot never answers anyone again
          (test_a_file_path_the_workers_stat_refuses_does_not_stall_the_bot).
2. HIGH   a file path refused for ``..`` is quoted as PTB's URL, which holds the bot token: the
          token is sent to the chat and journaled
          (test_a_refused_file_path_does_not_show_the_bot_token_to_the_chat).
3. MEDIUM the failure text of a channel step (here the OSError above) is stored unredacted:
          the bot token in ``toren.mailbox.last_error``
          (test_a_failed_download_writes_the_bot_token_to_no_table).
4. MEDIUM a button pressed after the call was decided elsewhere, before the channel read it,
          answers "Approved." and tells the chat "Approved by ..." while the run refused it
          (test_a_button_pressed_after_the_call_was_decided_elsewhere_claims_no_decision).
5. MEDIUM at-most-once sends a message twice when Telegram's answer to the first send is slow
          (test_at_most_once_does_not_send_again_after_an_unanswered_send).
6. MEDIUM a run that failed before the chat wrote again: the failure is never told
          (test_a_run_that_failed_before_the_chat_wrote_again_is_still_reported).
7. MEDIUM an unpaired chat is answered at every ``/pair``: anyone makes the bot send without
          limit (test_an_unpaired_chat_is_not_answered_at_every_pairing_attempt).
8. MEDIUM the webhook secret is in the worker's DEBUG log
          (test_the_webhook_secret_is_in_no_log_line).
9. MEDIUM after a group became a supergroup, its prompts' buttons decide nothing
          (test_the_buttons_of_a_group_that_became_a_supergroup_still_decide).
10. LOW   a button press is answered without a lease check
          (test_a_button_press_is_not_answered_without_a_held_lease).
11. LOW   what unpaired chats leave in the state (hints, failed codes) is never dropped
          (test_state_left_by_unpaired_chats_does_not_grow_for_ever).
12. LOW   ``poll_timeout`` under a second polls with timeout 0: the channel spins
          (test_a_poll_timeout_under_a_second_still_long_polls).
13. LOW   ``/pair@other_bot CODE`` in a group counts as a failed pairing here
          (test_a_pair_command_for_another_bot_in_a_group_is_not_an_attempt_here).
14. LOW   a button under a prompt of an unpaired chat still decides
          (test_a_button_under_a_prompt_of_an_unpaired_chat_decides_nothing).
15. LOW   ``toren channels pair`` requests that timed out are issued later and fill the cap
          (test_pair_requests_that_timed_out_do_not_use_up_the_pending_codes).
16. LOW   a document's caption reaches the agent over ``max_message_bytes``
          (test_a_caption_over_max_message_bytes_is_refused_like_a_text).
17. LOW   ``/start CODE`` in a paired chat sends a valid pairing code to the agent and journal
          (test_a_start_code_in_a_paired_chat_is_not_forwarded_to_the_agent).
18. LOW   at-most-once records ``lost`` a message whose step stopped before sending
          (test_at_most_once_does_not_lose_a_message_whose_send_stopped_before_sending).
19. LOW   a token Telegram refuses is logged as "Telegram did not answer", naming nothing to fix
          (test_a_token_telegram_refuses_is_reported_naming_where_it_came_from).
"""

from __future__ import annotations

from typing import Any

import anyio
import attrs
import pytest

import toren.providers.anthropic  # noqa: F401  (the SDK import is paid here, not in a step)
from tests import telegram_siege_app as siege
from tests.conftest import WorkerFactory, decide_waiting, person, running_worker, wait_for
from tests.telegram_support import (
    ALICE,
    APPROVER,
    FILER,
    ONCE,
    TOKENS,
    bots,
    channel_row,
    chat_model,
    filer,
    paired,
    polled_past,
    received,
    telegram,
)
from toren import Client, ConfigError
from toren._agent.app import load_app
from toren.channels import ChannelState, PairFailed, UpdateHandled, fold
from toren.channels.client import ChannelError, messages, pair, unpair
from toren.runs import cancel, read_run
from toren.testing.telegram_server import Hold, TelegramServer

pytestmark = pytest.mark.anyio
__all__ = ["bots", "filer"]  # the fixtures

TELLER_ID = 1001  # the teller token's bot id
TELLER_USERNAME = "toren_test_bot"  # the local server's default username for the first bot
STRANGER = 778
CHANNEL = "channel/telegram/teller"


# --- helpers --------------------------------------------------------------------------------


def buttons(message: Any) -> list[str]:
    rows = (message.reply_markup or {}).get("inline_keyboard", [])
    return [b["callback_data"] for row in rows for b in row]


async def conversation(client: Client, chat_id: int, bot: str = "teller") -> str:
    summary = await channel_row(client, bot)
    assert summary is not None
    [run] = [c["run"] for c in summary["chats"] if c["chat_id"] == chat_id]
    return str(run)


async def handled(client: Client, update_id: int, channel: str = CHANNEL) -> dict[str, Any]:
    """The channel's ``update.handled`` record of ``update_id`` (waited for)."""

    async def found() -> dict[str, Any] | None:
        return await record_of(client, update_id, channel)

    return dict(await wait_for(found, timeout=30, what=f"update {update_id} handled"))


async def record_of(
    client: Client, update_id: int, channel: str = CHANNEL
) -> dict[str, Any] | None:
    """The channel's ``update.handled`` record of ``update_id``, if there is one now."""
    row = await client.pool.fetchrow(
        "SELECT data FROM toren.journal WHERE actor_id = $1 AND type = 'update.handled' "
        "AND (data->>'update_id')::bigint = $2",
        channel,
        update_id,
    )
    return dict(row["data"]) if row else None


async def answer_to(server: TelegramServer, n: int) -> str:
    async def answered() -> str | None:
        answers = server.callback_answers
        return (answers[n - 1].text or "") if len(answers) >= n else None

    return str(await wait_for(answered, what=f"callback answer {n}"))


async def outbox_texts(client: Client, chat_id: int, agent: str = "teller") -> list[str]:
    """Every message queued for ``chat_id`` (pending or done), as the channel recorded it."""
    return [str(m["text"]) for m in await messages(client, agent, chat_id)]


async def hold_polls(server: TelegramServer) -> Hold:
    """Hold the next poll of every bot of the ``bots`` fixture (a hold is per method, and the four
    test bots poll the same server): the teller channel is then stuck in its tick, before it
    reads its runs, until the hold is released."""
    held = server.hold("getUpdates", n=len(TOKENS))
    with anyio.fail_after(15):
        await held.arrived
    assert TELLER_ID in {c.bot_id for c in held.calls}
    return held


# --- files: hostile paths from the Bot API (HIGH), a caption over the cap (LOW) -----------


async def pair_filer(client: Client, server: TelegramServer, chat_id: int) -> None:
    code, _ = await pair(client, "filer", by=person("op"))
    server.push_message(chat_id, f"/pair {code}", user_id=ALICE, token=FILER)
    await received(server, chat_id, lambda t: t.startswith("Paired with filer"), token=FILER)


LONG_PATH = "documents/" + "d/" * 2100 + "file_1.txt"  # over PATH_MAX: stat() refuses it


def serve_at(server: TelegramServer, filename: str, path: str) -> None:
    """The Bot API server answers getFile for the file pushed as ``filename`` with ``path``.
    Called right after the push, before the test yields to the event loop (the bot runs in
    this process), so before the bot asks for it."""
    with server._lock:
        for file_id, stored in list(server._files.items()):
            if stored.filename == filename:
                server._files[file_id] = attrs.evolve(stored, path=path)


async def token_in_tables(client: Client, token: str) -> list[str]:
    """The tables that hold the secret part of ``token`` anywhere in a row."""
    secret = token.split(":", 1)[1]
    found = []
    for table in ("journal", "mailbox", "deadletters", "actors", "snapshots"):
        count = await client.pool.fetchval(
            f"SELECT count(*) FROM toren.{table} t WHERE t::text LIKE $1",
            f"%{secret}%",
        )
        if count:
            found.append(table)
    return found


async def test_a_file_path_the_workers_stat_refuses_does_not_stall_the_bot(
    client: Client, filer: TelegramServer
) -> None:
    """``BotApi.download`` checks that the ``file_path`` names no local file with
    ``anyio.Path(path).exists()``, on the path as python-telegram-bot made it (for a remote file,
    ``<base_file_url>/<file_path>``). For a path over PATH_MAX (or a name over NAME_MAX as the
    first component) ``stat()`` raises ``OSError(ENAMETOOLONG)``: ``exists()`` swallows only
    ENOENT, ENOTDIR, EBADF and ELOOP. ``Inbound.handle`` re-raises any OSError as if the
    database had failed (``_RETRIED`` is ``TRANSIENT_DB_ERRORS``, which holds OSError), so the
    tick fails, is charged, and is tried again with the same updates for ever
    (``max_attempts`` is a million): the offset never moves and every chat of the bot is
    ignored from then on. Fix: retry only the database's own errors (not an OSError of the
    handler's own work), and turn any failure of a download into a refused file."""
    server = filer
    await pair_filer(client, server, 100)
    server.push_document(100, "long.txt", b"hello", user_id=ALICE, token=FILER)
    serve_at(server, "long.txt", LONG_PATH)
    server.push_message(100, "still there?", user_id=ALICE, token=FILER)
    await received(server, 100, lambda t: t == "echo: still there?", token=FILER, timeout=45)


async def test_a_failed_download_writes_the_bot_token_to_no_table(
    client: Client, filer: TelegramServer
) -> None:
    """Invariant 9. The OSError above quotes the path python-telegram-bot built, which holds
    the bot token (``http://.../file/bot<TOKEN>/documents/...``); the host records the failure
    text, unredacted, in ``toren.mailbox.last_error`` (and would in ``toren.deadletters``);
    were the OSError taken as an update that failed, ``update.handled``'s ``detail``
    (``f"{type(exc).__name__}: {exc}"``, not redacted either) would journal it. Fix: redact
    (``toren.channels.redact``) every text the channel records from an exception, and make
    the kernel's failure texts pass through the same redaction."""
    server = filer
    await pair_filer(client, server, 100)
    update_id = server.push_document(100, "long.txt", b"hello", user_id=ALICE, token=FILER)
    serve_at(server, "long.txt", LONG_PATH)

    async def settled() -> bool:  # recorded one way or another: a failure, or handled
        failed = await client.pool.fetchval(
            "SELECT count(*) FROM toren.mailbox WHERE actor_id = 'channel/telegram/filer' "
            "AND last_error IS NOT NULL"
        )
        done = await client.pool.fetchval(
            "SELECT count(*) FROM toren.journal WHERE actor_id = 'channel/telegram/filer' "
            "AND type = 'update.handled' AND (data->>'update_id')::bigint = $1",
            update_id,
        )
        return bool(failed or done)

    await wait_for(settled, timeout=30, what="the document's update handled or failed")
    assert await token_in_tables(client, FILER) == []


async def test_a_refused_file_path_does_not_show_the_bot_token_to_the_chat(
    client: Client, filer: TelegramServer
) -> None:
    """A ``file_path`` holding ``..`` is refused as promised, but the refusal quotes the path
    as python-telegram-bot made it, ``http://<api>/file/bot<TOKEN>/documents/..``, cut at 80
    characters: enough for the whole token (with api.telegram.org: 32 characters, then the
    46-character token). ``SendError``'s detail is not redacted, and ``_file`` sends it to the
    chat: the user who sent the file is given the bot token, and it is journaled
    (``outbox.queued``, ``update.handled``). Fix: quote only the server's own relative path
    (never PTB's URL) and redact every detail built from it."""
    server = filer
    await pair_filer(client, server, 100)
    server.push_document(100, "dots.txt", b"hello", user_id=ALICE, token=FILER)
    serve_at(server, "dots.txt", "documents/../file_1.txt")
    refusal = await received(server, 100, lambda t: "could not be fetched" in t, token=FILER)
    assert FILER.split(":", 1)[1] not in (refusal.text or ""), refusal.text
    assert await token_in_tables(client, FILER) == []


async def test_a_caption_over_max_message_bytes_is_refused_like_a_text(
    client: Client, filer: TelegramServer
) -> None:
    """``_forward`` refuses a text over ``max_message_bytes`` (64 KiB), but ``_file`` joins the
    caption into the run's input without that check: a document with a 100 KB caption (a
    webhook update or a Bot API server that does not cap captions at 1,024) reaches the model
    whole. Fix: check the caption (or the joined text) against the cap in ``_file``, before
    downloading."""
    server = filer
    await pair_filer(client, server, 100)
    server.push_document(100, "c.txt", b"hello", caption="z" * 100_000, user_id=ALICE, token=FILER)
    await received(server, 100, lambda t: "over 65536 bytes" in t, token=FILER, timeout=45)


# --- MEDIUM: a stale press claims a decision the run refused -------------------------------


async def test_a_button_pressed_after_the_call_was_decided_elsewhere_claims_no_decision(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    """The channel learns that a call was decided elsewhere only when it reads the run's
    journal, once per tick, before it polls. A press that arrives in the poll during which the
    call was decided (from the console, the CLI, MCP) is taken against the stale prompt: the
    button answers "Approved.", the chat is told "Approved by user4242: refund." and
    ``decision.sent`` is recorded, while the run had the call denied and records
    ``decision.refused`` (docs/channels.md: such a press "answers 'This call no longer waits
    for a decision' and records nothing"). Fix: before deciding, look the call up in the run's
    journal (``approval.decided`` for its call id) and answer stale if it is there; or answer
    and tell the chat only once the run's ``approval.decided`` / ``decision.refused`` is read."""
    server, _ = bots
    await paired(client, server, 100)
    server.push_message(100, "refund 5", user_id=ALICE)
    prompt = await received(server, 100, lambda t: "asks to run refund" in t)
    approve_data = buttons(prompt)[0]
    run_id = await conversation(client, 100)

    held = await hold_polls(server)  # the channel's next poll waits, its run reading too
    outcome = await decide_waiting(client, run_id, approved=False, by=person("op"), reason="no")
    assert outcome is not None
    assert outcome.outcome == "applied"
    server.push_callback(100, prompt.message_id, approve_data, user_id=APPROVER)
    held.release()

    answer = await answer_to(server, 1)
    assert "no longer waits" in answer, answer
    await wait_for(lambda: _done_echo(server), timeout=30, what="the denied call's turn ended")
    texts = await outbox_texts(client, 100)
    assert not [t for t in texts if t.startswith("Approved by")], texts


async def _done_echo(server: TelegramServer) -> bool:
    return any((m.text or "").startswith("done:") for m in server.sent(100))


# --- MEDIUM: a failure the chat is never told --------------------------------------------


async def test_a_run_that_failed_before_the_chat_wrote_again_is_still_reported(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    """docs/channels.md: "If the run fails, the chat is told why ... and its next message
    starts a new conversation." When the chat's next message is handled before the channel
    read the run's ``run.failed`` (the run failed during the poll that brought the message),
    ``_conversation`` sees the failed status,
    records ``conversation.ended`` and the fold drops the run's watch: the failure is never
    read, the chat never learns that (or why) its conversation ended. Fix: keep reading an
    ended conversation's run until its end event was read (or queue the failure notice in
    ``_conversation`` itself when it finds the run failed)."""
    server, _ = bots
    await paired(client, server, 100)
    server.push_message(100, "refund 5", user_id=ALICE)
    await received(server, 100, lambda t: "asks to run refund" in t)
    run_id = await conversation(client, 100)

    held = await hold_polls(server)  # the channel's next poll waits, its run reading too
    await cancel(client, run_id, by=person("op"), reason="stop it")

    async def cancelled() -> bool:
        return (await read_run(client, run_id)).status == "cancelled"

    await wait_for(cancelled, what="the run cancelled")
    server.push_message(100, "hello again", user_id=ALICE)
    held.release()
    await received(server, 100, lambda t: t == "echo: hello again")  # the new conversation
    texts = await outbox_texts(client, 100)
    assert [t for t in texts if t.startswith("The conversation was cancelled: ")], texts


# --- MEDIUM: an unpaired chat makes the bot talk without limit -----------------------------


async def test_an_unpaired_chat_is_not_answered_at_every_pairing_attempt(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    """docs/channels.md: an unpaired chat "gets a short hint on how to pair, at most once a
    minute, and nothing else", and past five failures "a chat is told to wait". But ``_pair``
    answers every attempt: five "wrong code" replies, then "Too many wrong codes" to each
    further ``/pair`` for ever. Anyone on Telegram can thus make the bot send without limit,
    spend the bot's global rate (30/s) and grow its outbox. Fix: tell a rate-limited chat to
    wait once per window (like the hint), and send nothing for later attempts."""
    server, model = bots
    attempts = 15
    for i in range(attempts):
        last = server.push_message(100, f"/pair GUESS{i:05d}", user_id=ALICE)
    await polled_past(server, last)  # every attempt handled
    texts = await outbox_texts(client, 100)
    assert len(texts) <= 6, f"{len(texts)} answers to {attempts} attempts: {texts[-2:]}"
    assert model.requests == []


# --- MEDIUM: the webhook secret in the worker's log ----------------------------------------

HOOK_TOKEN = "1005:siegehook-token-for-tests-0123456789"
HOOK_SECRET = "siegehook-webhook-SECRET_0123456789abcdef"


async def test_the_webhook_secret_is_in_no_log_line(
    client: Client, workers: WorkerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Invariant 9 (secrets never enter logs). A real ``toren worker`` at DEBUG (as tests and
    operators run it to debug a bot): python-telegram-bot logs "Calling Bot API endpoint
    `setWebhook` with parameters {... 'secret_token': '<the secret>' ...}". The formatter only
    redacts token-shaped text, so the webhook secret, with which anyone can post updates as
    Telegram (decisions by forged approvers included), is in the log. Fix: keep the
    ``telegram`` loggers at INFO (as httpx is kept at WARNING), or redact the secret's value
    (the formatter knows every configured secret's variable) in every line."""
    monkeypatch.setenv(siege.HOOK_TOKEN_ENV, HOOK_TOKEN)
    monkeypatch.setenv(siege.HOOK_SECRET_ENV, HOOK_SECRET)
    async with TelegramServer(token=HOOK_TOKEN, username="siegehook_bot") as server:
        worker = workers("tests.telegram_siege_app", telegram_api_url=server.url)

        async def webhook_set() -> bool:
            return bool(server.calls("setWebhook"))

        await wait_for(webhook_set, timeout=60, what="the worker set the webhook")

        async def logged() -> bool:  # the control: logged once setWebhook has returned
            return "serves agent 'siegehook'" in worker.log()

        await wait_for(logged, timeout=20, what="the channel's start in the worker's log")
        log = worker.log()
    assert HOOK_TOKEN.split(":", 1)[1] not in log  # the token is redacted (this holds)
    leaked = [line[-240:] for line in log.splitlines() if HOOK_SECRET in line]
    assert not leaked, leaked


# --- LOW: a button press answered without the lease -----------------------------------------


async def test_a_button_press_is_not_answered_without_a_held_lease() -> None:
    """Invariant 14: before a channel send, the host checks its lease. ``_callback`` answers the
    press (answerCallbackQuery: text the user sees) without ``ctx.ensure_lease()``: in webhook
    mode no lease check at all precedes it, and when polling only the one before getUpdates
    does (a step may download files for minutes before). A paused owner answers "Approved."
    for a step that will be fenced. Fix: ``ctx.ensure_lease()`` right before each
    ``answer_callback``. (A unit test: a context whose lease has lapsed.)"""
    from toren._core.actor import Context
    from toren._core.errors import LeaseExpired
    from toren.actors.channels import runtime
    from toren.actors.channels.actor import ChannelActor
    from toren.actors.channels.inbound import Inbound
    from toren.channels import PairingKey, Telegram

    actor_id = "channel/telegram/siegeunit"

    class Lapsed:
        def ensure(self) -> None:
            raise LeaseExpired(actor_id, 1.0)

    class Api:
        def __init__(self) -> None:
            self.answered: list[str] = []

        async def answer_callback(self, callback_id: str, text: str) -> None:
            self.answered.append(text)

    api = Api()
    actor = ChannelActor(actor_id, {"bot": "siegeunit"})
    state = ChannelState(agent="siegeunit", bot_id=1005, username="siegeunit_bot")
    ctx = Context(actor, state, 0, 1, None, lease=Lapsed())  # type: ignore[arg-type]
    key = PairingKey(b"k" * 32)
    bot = runtime.Bot(agent=None, settings=Telegram(bot="siegeunit"), api=api, pairing=key)  # type: ignore[arg-type]
    update = {
        "update_id": 7,
        "callback_query": {
            "id": "q1",
            "from": {"id": APPROVER, "is_bot": False, "first_name": "a"},
            "message": {"message_id": 3, "date": 0, "chat": {"id": 100, "type": "private"}},
            "chat_instance": "1",
            "data": "a:AAAAAAAAAAAAAAAA",
        },
    }
    with pytest.raises(LeaseExpired):
        await Inbound(ctx, bot, actor_id).handle(update, polling=False)
    assert api.answered == []


# --- LOW: state left by unpaired chats is never dropped --------------------------------------


def test_state_left_by_unpaired_chats_does_not_grow_for_ever() -> None:
    """``ChannelState.hinted`` (last hint per unpaired chat) and ``failures`` (failed codes per
    chat) get an entry for every chat that ever wrote or guessed, and nothing removes one
    (only pairing does): anyone can create groups, add the bot and write once, and the state,
    every snapshot and every fold grow with them. Entries older than the hint interval and the
    failure window mean nothing. Fix: drop expired entries as later events are folded (e.g.
    keep them in arrival order and trim the front). Since issue 26 both windows are a day (a
    hint at most once a day, at most 20 failed codes a day): a day's strangers are kept."""
    state = ChannelState()
    t0 = 1_700_000_000.0
    chats = 3 * 720
    for i in range(chats):
        at = t0 + i * 120.0  # one stranger every 2 minutes, for 3 days
        state = fold(
            state,
            UpdateHandled(
                update_id=i,
                chat_id=-(i + 1),
                user_id=i + 1,
                kind="message",
                outcome="hinted",
                at=at,
            ),
        )
        state = fold(state, PairFailed(chat_id=-(i + 1), at=at))
    day = 720 + 64  # a day of strangers, and what comes before the next trim
    assert len(state.hinted) <= day, len(state.hinted)
    assert len(state.failures) <= day, len(state.failures)


# --- LOW: poll_timeout under a second spins ----------------------------------------------------

SPIN_TOKEN = "1006:siegespin-token-for-tests-0123456789"


async def test_a_poll_timeout_under_a_second_still_long_polls(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``poll_timeout`` accepts any positive number (the docs: "Seconds a long poll waits"), but
    ``BotApi.get_updates`` sends ``int(wait)``: 0.5 becomes 0, Telegram answers at once, and the
    channel polls (and commits a step with a timer) back to back, hundreds of times a second,
    for as long as the bot runs. Fixed: ``poll_timeout`` under 1 is refused, and the wait sent
    is rounded up; the bot below polls at the least allowed, 1 s."""
    from toren._agent import registry as _agents
    from toren.channels import Telegram

    with pytest.raises(ConfigError, match="at least 1 second"):
        Telegram(bot="spin", poll_timeout=0.5)

    monkeypatch.setattr(_agents.PROCESS_AGENTS, "_registry", {})
    _agents.register_agents([siege.siegespin])
    monkeypatch.setenv(siege.SPIN_TOKEN_ENV, SPIN_TOKEN)
    async with (
        TelegramServer(token=SPIN_TOKEN, username="siegespin_bot") as server,
        running_worker(db_url, telegram_api_url=server.url),
    ):
        with anyio.fail_after(30):
            await server.until(lambda: len(server.calls("getUpdates")) >= 1)
        first = len(server.calls("getUpdates"))
        # A bounded window after the control: 3 s of 0.5-second long polls is about 6 polls.
        with anyio.move_on_after(3):
            await server.until(lambda: len(server.calls("getUpdates")) >= first + 30)
        polls = len(server.calls("getUpdates")) - first
        timeouts = {c.params.get("timeout") for c in server.calls("getUpdates")}
    assert polls < 30, (
        f"{polls} getUpdates within 3 s (timeouts sent: {sorted(map(str, timeouts))})"
    )


# --- LOW: a command for another bot in a group ---------------------------------------------


async def test_a_pair_command_for_another_bot_in_a_group_is_not_an_attempt_here(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    """In a group, ``/pair@other_bot CODE`` is meant for another bot, but ``_command`` accepts
    ``/cmd@anyname`` and the group filter lets every ``/pair...`` through: this bot answers
    "That code is wrong" and counts a failure against the group (five of them and the group's
    own pairing is refused for ten minutes). Fix: a command addressed to another username is
    not addressed to this bot (compare the ``@name`` with the bot's username)."""
    server, _ = bots
    group = -7000
    other = server.push_message(group, "/pair@other_bot ABCDEFGHJK", user_id=ALICE)
    control = server.push_message(group, f"@{TELLER_USERNAME} hello", user_id=ALICE)
    await handled(client, control)
    await polled_past(server, other)
    assert await record_of(client, other) is None  # ignored: from a stranger, no row (issue 26)
    assert not [t for t in await outbox_texts(client, group) if "wrong, used or expired" in t]


# --- LOW: an unpaired chat's old prompt still decides ----------------------------------------


async def test_a_button_under_a_prompt_of_an_unpaired_chat_decides_nothing(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    """``toren channels unpair`` promises the chat "no longer reaches the agent" (deny by
    default), but ``_dispatch`` handles callbacks before it looks at pairing, and the prompts
    of the chat stay open: a press on a prompt sent before the unpairing still sends a decision
    to the run. Fix: close (or refuse) an unpaired chat's prompts: a callback from a chat that
    is not paired decides nothing."""
    server, _ = bots
    await paired(client, server, 100)
    server.push_message(100, "refund 5", user_id=ALICE)
    prompt = await received(server, 100, lambda t: "asks to run refund" in t)
    run_id = await conversation(client, 100)
    await unpair(client, "teller", 100, by=person("op"))
    await received(server, 100, lambda t: "was unpaired" in t)
    press = server.push_callback(100, prompt.message_id, buttons(prompt)[0], user_id=APPROVER)
    await polled_past(server, press)
    assert await record_of(client, press) is None  # stale, from a stranger: no row (issue 26)
    assert [a.text for a in server.callback_answers] == ["This button is not known here."]
    assert (await read_run(client, run_id)).status == "parked"


# --- MEDIUM: a migrated group's prompts -------------------------------------------------------


async def test_the_buttons_of_a_group_that_became_a_supergroup_still_decide(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    """A group upgraded to a supergroup is followed to its new id (docs), but the fold of
    ``chat.migrated`` leaves the run's ``Watch.conversation`` key (and the open prompts) on the
    old chat id: every prompt opened afterwards gets ``PromptOpened.chat_id`` = the old id
    (``Reader._chat_of``), and ``_callback`` refuses a press from the chat the prompt is
    actually in ("This button is not known here."). After an upgrade (Telegram does it when a
    group becomes public, grows, or gets some admin settings), no call can be approved by
    button in that group again. Fix: fold ``chat.migrated`` into the watches' conversation keys
    and the open prompts (or compare chats through ``state.migrated``)."""
    server, _ = bots
    group, supergroup = -5000, -1_005_000_000_000
    code, _ = await pair(client, "teller", by=person("op"))
    server.push_message(group, f"/pair@{TELLER_USERNAME} {code}", user_id=ALICE, title="team")
    await received(server, group, lambda t: t.startswith("Paired with teller"))
    server.push_message(group, f"@{TELLER_USERNAME} hello", user_id=ALICE)
    await received(server, group, lambda t: t == "echo: hello")

    server.migrate(group, supergroup)  # Telegram's service message in the old group:
    moved = server.push_raw(
        {
            "message": {
                "message_id": 999,
                "date": 0,
                "chat": {"id": group, "type": "group", "title": "team"},
                "from": {"id": ALICE, "is_bot": False, "first_name": "alice"},
                "migrate_to_chat_id": supergroup,
            }
        }
    )
    assert (await handled(client, moved))["outcome"] == "migrated"
    server.push_message(supergroup, f"@{TELLER_USERNAME} refund 5", user_id=ALICE)
    prompt = await received(server, supergroup, lambda t: "asks to run refund" in t)
    press = server.push_callback(
        supergroup, prompt.message_id, buttons(prompt)[0], user_id=APPROVER
    )
    record = await handled(client, press)
    assert record["outcome"] == "decided", record


# --- LOW: pairing requests nobody answered are issued later ----------------------------------


async def test_pair_requests_that_timed_out_do_not_use_up_the_pending_codes(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``toren channels pair`` asks the channel actor and gives up after 10 s when no worker
    runs the bot ("is a worker with the bot's token running?"). The request stays queued: when
    a worker comes back, each one is issued as a code nobody ever saw, and each holds one of
    the ``max_pending_codes`` (20) slots for ``pair_code_ttl``. An operator who retried while
    the worker was down is then refused ("20 codes are pending") for ten minutes. Fix: give
    ``IssueCode`` the deadline of its ask and refuse (issue nothing for) a late one."""
    from toren.channels import client as channels_client

    load_app("tests.telegram_app")
    async with telegram(monkeypatch) as server, chat_model(monkeypatch):
        async with running_worker(db_url, telegram_api_url=server.url):

            async def started() -> bool:
                summary = await channel_row(client, "teller")
                return bool(summary and summary.get("username"))

            await wait_for(started, what="the teller channel started")
        monkeypatch.setattr(channels_client, "ASK_WAIT", 0.2)
        for _ in range(20):  # the operator retries while no worker runs the bot
            with pytest.raises(ChannelError, match="did not answer"):
                await pair(client, "teller", by=person("op"))
        monkeypatch.setattr(channels_client, "ASK_WAIT", 10.0)
        async with running_worker(db_url, telegram_api_url=server.url):
            code, _ = await pair(client, "teller", by=person("op"))  # refused today: the cap
            assert len(code) == 10
            server.push_message(100, f"/pair {code}", user_id=ALICE)
            await received(server, 100, lambda t: t.startswith("Paired with teller"))


# --- LOW: a pairing code sent in a paired chat goes to the agent -----------------------------


async def test_a_start_code_in_a_paired_chat_is_not_forwarded_to_the_agent(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    """docs/channels.md: "The journal keeps only the code's SHA-256, never a code that could be
    used." In a chat that is already paired, ``/pair CODE`` is answered "already paired", but
    ``/start CODE`` (what a ``t.me/<bot>?start=CODE`` link sends, opened in the wrong chat) is
    forwarded to the agent as text: the code, still unused and valid, is journaled in the run
    (``run.started`` input or ``message.received``), sent to the model and shown on every
    surface that reads the run. Fix: treat ``/start ARG`` in a paired chat like ``/pair``
    (answer, forward nothing)."""
    server, model = bots
    await paired(client, server, 100)
    code, _ = await pair(client, "teller", by=person("op"))
    server.push_message(100, f"/start {code}", user_id=ALICE)
    server.push_message(100, "ping", user_id=ALICE)  # the control: handled after it, end to end
    await received(server, 100, lambda t: t.startswith("echo:") and t.endswith("ping"))
    found = await client.pool.fetchval(
        "SELECT count(*) FROM toren.journal WHERE data::text LIKE $1", f"%{code}%"
    )
    assert found == 0
    assert not [r for r in model.requests if code in str(r)]


# --- LOW: at-most-once loses a message it never sent ------------------------------------------


async def test_at_most_once_does_not_lose_a_message_whose_send_stopped_before_sending(
    client: Client, bots: tuple[TelegramServer, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At-most-once: ``_send`` records a message ``lost`` whenever its step is handled a second
    time (``deliveries > 1``). But ``ensure_lease()`` is checked before the send, and a lease
    that looks lapsed (a slow renewal, a GC pause) makes the step stop *before* sending, with
    the message left queued and its delivery count raised: the next attempt records the
    message lost although Telegram never saw it. "A crash costs at most one message" holds,
    but here nothing crashed and nothing was sent. Fix: when the step is given up by
    ``LeaseExpired`` before the send, the at-most-once guard must not count it (e.g. record
    ``outbox.sending`` with an attempt token and compare it in ``_send``, or have the kernel not
    count a delivery that ended in ``LeaseExpired`` before any effect)."""
    from toren._core import actor as _actor
    from toren._core.errors import LeaseExpired

    server, _ = bots
    code, _ = await pair(client, "once", by=person("op"))
    server.push_message(100, f"/pair {code}", user_id=ALICE, token=ONCE)
    await received(server, 100, lambda t: t.startswith("Paired with once"), token=ONCE)

    checked = _actor.Context.ensure_lease
    lapsed: list[int] = []

    def once_lapsed(self: Any) -> None:
        envelope = self.envelope
        if envelope is not None and envelope.kind == "channel.send" and not lapsed:
            lapsed.append(envelope.id)  # this worker's clock says the lease may have lapsed
            raise LeaseExpired(self.actor_id, 0.1)
        checked(self)

    monkeypatch.setattr(_actor.Context, "ensure_lease", once_lapsed)
    server.push_message(100, "hi once", user_id=ALICE, token=ONCE)

    async def settled() -> list[tuple[str, str]]:
        found = [(m["state"], m["text"]) for m in await messages(client, "once", 100)]
        return [f for f in found if f[1] == "echo: hi once" and f[0] in ("sent", "lost")]

    [(state, _)] = await wait_for(settled, timeout=30, what="the reply sent or lost")
    assert lapsed  # the control: the lease check did stop one send step
    assert state == "sent"


# --- MEDIUM: at-most-once sends twice when Telegram answers slowly ---------------------------


async def test_at_most_once_does_not_send_again_after_an_unanswered_send(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    """At-most-once promises no duplicate. A send whose request reached Telegram but whose
    answer did not come back in time (python-telegram-bot's read timeout is 5 s; a slow
    Telegram, a dropped connection) raises ``TimedOut``/``NetworkError``, which ``classify``
    calls ``retry``; ``_undelivered`` then sets a timer that sends the message again ("it was
    not delivered: sending it later is not a second send"). It may well have been delivered:
    the chat gets it twice, with no crash anywhere. Fix: at most once, only an error that
    proves Telegram refused the request (an API error answer: 429, 400, 403, migrated) may be
    retried; a timeout or a network error after the request was written records the message
    ``lost`` (or asks getUpdates/chat history nothing: it cannot know)."""
    server, _ = bots
    code, _ = await pair(client, "once", by=person("op"))
    server.push_message(100, f"/pair {code}", user_id=ALICE, token=ONCE)
    await received(server, 100, lambda t: t.startswith("Paired with once"), token=ONCE)

    slow = server.hold("sendMessage", delivered=True)  # delivered, its answer held back
    server.push_message(100, "hi once", user_id=ALICE, token=ONCE)
    try:
        with anyio.fail_after(30):
            await slow.arrived

        async def settled() -> list[str]:
            found = [(m["state"], m["text"]) for m in await messages(client, "once", 100)]
            return [s for s, t in found if t == "echo: hi once" and s != "sending"]

        await wait_for(settled, timeout=40, what="the reply's send given up or repeated")
    finally:
        slow.release()
    echoes = [m for m in server.sent(100, token=ONCE) if m.text == "echo: hi once"]
    assert len(echoes) == 1, f"at most once, but the chat got it {len(echoes)} times"


# --- LOW: a token Telegram refuses, as the operator sees it -----------------------------------


async def test_a_token_telegram_refuses_is_reported_naming_where_it_came_from(
    client: Client, workers: WorkerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new user's first mistake: a token mistyped (or revoked in BotFather). The worker logs
    "bot ... runs agent ... here", then every 2, 4, ... 60 s for ever "Telegram did not answer
    (Unauthorized); trying again", which reads as a network problem: Telegram did answer, and
    no line says that the token in ``TOREN_TEST_TELEGRAM_SIEGESPIN_TOKEN`` was refused or what
    to do (``classify`` knows ``InvalidToken`` but ``_tick`` logs the raw error), and
    ``toren channels list`` shows the channel ``live``. Fix: on ``InvalidToken`` log an
    error naming the variable (or file) and the next step (check the token with @BotFather),
    and show it on the channel's row."""
    monkeypatch.setenv(siege.SPIN_TOKEN_ENV, "1006:a-mistyped-token-0123456789")
    async with TelegramServer(token=SPIN_TOKEN, username="siegespin_bot") as server:
        worker = workers("tests.telegram_siege_app", telegram_api_url=server.url)

        async def refused_twice() -> bool:  # the control: two polls were refused (401)
            return len([c for c in server.calls() if c.status == 401]) >= 2

        await wait_for(refused_twice, timeout=60, what="two calls with the wrong token")

        async def logged() -> bool:
            return worker.log().count("siegespin") >= 3  # each refusal is logged

        await wait_for(logged, timeout=20, what="the refusals logged")
        log = worker.log()
    said = [
        line
        for line in log.splitlines()
        if "siegespin" in line
        and (" WARNING " in line or " ERROR " in line)
        and siege.SPIN_TOKEN_ENV in line
    ]
    assert said, "no warning names the variable whose token Telegram refused"
