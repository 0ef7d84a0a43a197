"""The local Telegram Bot API server of toren.testing, driven by the real python-telegram-bot."""

from __future__ import annotations

import asyncio
import datetime as dtm
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
from aiohttp import web
from telegram import Bot, InlineKeyboardButton, InlineKeyboardMarkup, ReplyParameters
from telegram.error import BadRequest, ChatMigrated, Conflict, Forbidden, InvalidToken, RetryAfter

from toren.testing.telegram_server import TelegramServer

pytestmark = pytest.mark.anyio

TOKEN = "123:ABC"
CHAT = 42


@pytest.fixture(autouse=True)
def _ptb_timedelta(monkeypatch: pytest.MonkeyPatch) -> None:
    # PTB 22 warns on every RetryAfter it builds unless told to use timedelta (and the warning is
    # an error under this suite's filterwarnings): opt in, as Toren's Telegram surface must.
    monkeypatch.setenv("PTB_TIMEDELTA", "true")


@pytest.fixture
async def tg() -> AsyncIterator[TelegramServer]:
    async with TelegramServer(token=TOKEN) as server:
        yield server


@pytest.fixture
async def bot(tg: TelegramServer) -> AsyncIterator[Bot]:
    async with Bot(TOKEN, base_url=tg.base_url, base_file_url=tg.base_file_url) as client:
        yield client


def _keyboard(data: str) -> InlineKeyboardMarkup:
    return InlineKeyboardMarkup([[InlineKeyboardButton("Approve", callback_data=data)]])


async def test_initialize_calls_get_me(tg: TelegramServer, bot: Bot) -> None:
    assert bot.username == "toren_test_bot"
    assert bot.id == 123
    assert [c.status for c in tg.calls("getMe")] == [200]
    assert tg.env() == {"TOREN_TELEGRAM_API_URL": tg.url}


async def test_an_unknown_token_is_refused(tg: TelegramServer) -> None:
    with pytest.raises(InvalidToken):
        async with Bot("999:NOPE", base_url=tg.base_url):
            pass
    assert tg.calls("getMe")[0].status == 401


async def test_long_poll_returns_a_pushed_message_and_confirms_by_offset(
    tg: TelegramServer, bot: Bot
) -> None:
    async with anyio.create_task_group() as group:
        result: list[Any] = []

        async def poll() -> None:
            result.extend(await bot.get_updates(timeout=30))

        group.start_soon(poll)
        with anyio.fail_after(5):
            await tg.until(lambda: len(tg.calls("getUpdates")) == 1)
            update_id = tg.push_message(CHAT, "/start hello", username="ada")
    (update,) = result
    assert update.update_id == update_id
    assert update.message.text == "/start hello"
    assert update.message.from_user.username == "ada"
    assert update.message.chat.type == "private"
    assert update.message.entities[0].type == "bot_command"
    assert update.message.entities[0].length == len("/start")
    assert await bot.get_updates(offset=update_id + 1) == ()
    assert tg.updates_confirmed == update_id + 1
    assert tg.pending_updates() == []


async def test_updates_stay_until_confirmed(tg: TelegramServer, bot: Bot) -> None:
    first = tg.push_message(CHAT, "one")
    tg.push_message(CHAT, "two")
    assert [u.update_id for u in await bot.get_updates()] == [first, first + 1]
    assert [u.update_id for u in await bot.get_updates(offset=first + 1)] == [first + 1]
    assert [u.update_id for u in await bot.get_updates(offset=-1)] == [first + 1]


async def test_a_group_mention_gets_its_entity(tg: TelegramServer, bot: Bot) -> None:
    tg.push_message(-100500, "@toren_test_bot ping", chat_type="supergroup", title="Team")
    (update,) = await bot.get_updates()
    assert update.message.chat.title == "Team"
    assert update.message.from_user.id != -100500
    entity = update.message.entities[0]
    assert (entity.type, entity.offset, entity.length) == ("mention", 0, len("@toren_test_bot"))


async def test_each_bot_has_its_own_updates_and_messages(tg: TelegramServer, bot: Bot) -> None:
    tg.add_bot("777:SECOND", "second_test_bot")
    tg.push_message(CHAT, "for the second", token="777:SECOND")
    async with Bot("777:SECOND", base_url=tg.base_url) as second:
        assert second.username == "second_test_bot"
        (update,) = await second.get_updates()
        assert update.message.text == "for the second"
        await second.send_message(CHAT, "from the second")
    assert await bot.get_updates() == ()
    with pytest.raises(BadRequest, match=r"(?i)chat not found"):
        await bot.send_message(CHAT, "the first bot never saw this chat")
    assert tg.sent(CHAT) == []
    assert [m.text for m in tg.sent(CHAT, token="777:SECOND")] == ["from the second"]


async def test_a_newer_long_poll_ends_the_older_with_conflict(tg: TelegramServer, bot: Bot) -> None:
    async with Bot(TOKEN, base_url=tg.base_url) as second:
        async with anyio.create_task_group() as group:
            errors: list[BaseException] = []

            async def poll() -> None:
                try:
                    await bot.get_updates(timeout=30)
                except Conflict as exc:
                    errors.append(exc)

            group.start_soon(poll)
            with anyio.fail_after(5):
                await tg.until(lambda: len(tg.calls("getUpdates")) == 1)
                group.start_soon(second.get_updates, None, None, 30)
                await tg.until(lambda: tg.calls("getUpdates")[0].status == 409)
                tg.push_message(CHAT, "ends the newer poll")
        assert "terminated by other getUpdates request" in str(errors[0])


async def test_send_message_is_recorded(tg: TelegramServer, bot: Bot) -> None:
    tg.push_message(CHAT, "hi")
    sent = await bot.send_message(
        CHAT, "Deploy?", reply_markup=_keyboard("approve:7"), reply_parameters=ReplyParameters(1)
    )
    second = await bot.send_message(CHAT, "and more")
    assert (sent.message_id, second.message_id) == (2, 3)
    assert sent.reply_to_message.text == "hi"
    assert sent.reply_markup == _keyboard("approve:7")
    record = tg.message(CHAT, 2)
    assert (record.kind, record.text, record.reply_to) == ("text", "Deploy?", 1)
    assert record.reply_markup == _keyboard("approve:7").to_dict()
    assert [m.text for m in tg.sent(CHAT)] == ["Deploy?", "and more"]


async def test_a_chat_never_seen_is_not_found(bot: Bot) -> None:
    with pytest.raises(BadRequest, match=r"(?i)Chat not found"):
        await bot.send_message(7, "hello?")


async def test_text_is_measured_in_utf16_units(tg: TelegramServer, bot: Bot) -> None:
    tg.add_chat(CHAT)
    await bot.send_message(CHAT, "😀" * 2048)  # 4096 units in 2048 characters
    with pytest.raises(BadRequest, match=r"(?i)Message is too long"):
        await bot.send_message(CHAT, "😀" * 2048 + "a")
    with pytest.raises(BadRequest, match=r"(?i)Message text is empty"):
        await bot.send_message(CHAT, "  \n ")
    assert len(tg.sent(CHAT)) == 1


async def test_callback_data_is_measured_in_bytes(tg: TelegramServer, bot: Bot) -> None:
    tg.add_chat(CHAT)
    await bot.send_message(CHAT, "ok", reply_markup=_keyboard("é" * 32))  # 64 bytes
    with pytest.raises(BadRequest, match=r"(?i)button_data_invalid"):
        await bot.send_message(CHAT, "too long", reply_markup=_keyboard("é" * 32 + "x"))


async def test_text_that_utf8_cannot_carry_is_refused(tg: TelegramServer, bot: Bot) -> None:
    tg.add_chat(CHAT)
    with pytest.raises(BadRequest, match=r"(?i)Text must be encoded in UTF-8"):
        await bot.send_message(CHAT, "a\x00b")
    url = f"{tg.base_url}{TOKEN}/sendMessage"
    body = b'{"chat_id": 42, "text": "\\ud800"}'
    async with httpx.AsyncClient() as client:
        lone = await client.post(url, content=body, headers={"Content-Type": "application/json"})
        bad = await client.post(url, content=b"chat_id=42&text=%ff")
    for response in (lone, bad):
        assert response.status_code == 400
        assert response.json()["description"] == "Bad Request: text must be encoded in UTF-8"


async def test_markup_is_parsed_by_its_parse_mode(tg: TelegramServer, bot: Bot) -> None:
    tg.add_chat(CHAT)
    with pytest.raises(BadRequest, match=r"(?i)Can't parse entities: character '\.' is reserved"):
        await bot.send_message(CHAT, "Done.", parse_mode="MarkdownV2")
    with pytest.raises(BadRequest, match=r"(?i)Can't parse entities"):
        await bot.send_message(CHAT, "<b>bold", parse_mode="HTML")
    with pytest.raises(BadRequest, match=r"(?i)Can't parse entities"):
        await bot.send_message(CHAT, "<blink>x</blink>", parse_mode="HTML")
    await bot.send_message(CHAT, r"*Done*\. [see](https://x.y/a_b)", parse_mode="MarkdownV2")
    await bot.send_message(CHAT, "<b>a &lt; b</b>", parse_mode="HTML")
    await bot.send_message(CHAT, "Done. (1+1=2)")
    assert len(tg.sent(CHAT)) == 3


async def test_a_scripted_429_is_retry_after(tg: TelegramServer, bot: Bot) -> None:
    tg.add_chat(CHAT)
    tg.fail_next("sendMessage", status=429, retry_after=3)
    with pytest.raises(RetryAfter) as caught:
        await bot.send_message(CHAT, "hi")
    assert caught.value.retry_after == dtm.timedelta(seconds=3)
    assert tg.calls("sendMessage")[0].description == "Too Many Requests: retry after 3"
    await bot.send_message(CHAT, "hi")
    assert len(tg.sent(CHAT)) == 1


async def test_a_blocked_user_is_forbidden(tg: TelegramServer, bot: Bot) -> None:
    tg.add_chat(CHAT)
    tg.block(CHAT)
    with pytest.raises(Forbidden, match="bot was blocked by the user"):
        await bot.send_message(CHAT, "hi")
    tg.unblock(CHAT)
    await bot.send_message(CHAT, "hi")


async def test_a_migrated_group_names_its_new_id(tg: TelegramServer, bot: Bot) -> None:
    tg.add_chat(-500, "group", "Team")
    tg.migrate(-500, -1000500)
    with pytest.raises(ChatMigrated) as caught:
        await bot.send_message(-500, "hi")
    assert caught.value.new_chat_id == -1000500
    await bot.send_message(-1000500, "hi")
    assert tg.sent(-1000500)[0].text == "hi"


async def test_limit_rate_throttles_and_finds_violations(tg: TelegramServer, bot: Bot) -> None:
    tg.add_chat(CHAT)
    tg.limit_rate(per_chat_interval=60, retry_after=30)
    await bot.send_message(CHAT, "one")
    with pytest.raises(RetryAfter):
        await bot.send_message(CHAT, "two")
    assert tg.violations() == []
    with pytest.raises(RetryAfter):
        await bot.send_message(CHAT, "three")  # inside the 30 s it was told to wait
    assert [t.scope for t in tg.throttled] == ["chat", "chat"]
    assert [c.params["text"] for c in tg.violations()] == ["three"]


async def test_a_user_document_can_be_downloaded(tg: TelegramServer, bot: Bot) -> None:
    tg.push_document(CHAT, "report.pdf", b"%PDF-1.7 data", caption="read this")
    (update,) = await bot.get_updates()
    document = update.message.document
    assert (document.file_name, document.mime_type) == ("report.pdf", "application/pdf")
    assert update.message.caption == "read this"
    file = await bot.get_file(document.file_id)
    assert file.file_size == len(b"%PDF-1.7 data")
    assert await file.download_as_bytearray() == bytearray(b"%PDF-1.7 data")


async def test_a_user_photo_can_be_downloaded(tg: TelegramServer, bot: Bot) -> None:
    tg.push_photo(CHAT, b"\xff\xd8 jpeg", width=640, height=480)
    (update,) = await bot.get_updates()
    largest = update.message.photo[-1]
    assert (largest.width, largest.height) == (640, 480)
    file = await largest.get_file()
    assert await file.download_as_bytearray() == bytearray(b"\xff\xd8 jpeg")


async def test_send_document_records_the_file(tg: TelegramServer, bot: Bot) -> None:
    tg.add_chat(CHAT)
    message = await bot.send_document(CHAT, b"a,b\n1,2\n", filename="out.csv", caption="data")
    assert message.document.file_name == "out.csv"
    (record,) = tg.sent(CHAT)
    assert (record.kind, record.filename, record.data, record.text) == (
        "document",
        "out.csv",
        b"a,b\n1,2\n",
        "data",
    )
    photo = await bot.send_photo(CHAT, b"\x89PNG fake")
    assert tg.message(CHAT, photo.message_id).kind == "photo"


async def test_a_callback_press_is_answered(tg: TelegramServer, bot: Bot) -> None:
    tg.add_chat(CHAT)
    sent = await bot.send_message(CHAT, "Deploy?", reply_markup=_keyboard("approve"))
    tg.push_callback(CHAT, sent.message_id, "approve", user_id=CHAT)
    (update,) = await bot.get_updates()
    query = update.callback_query
    assert (query.data, query.message.text) == ("approve", "Deploy?")
    await query.answer("Approved", show_alert=True)
    await bot.edit_message_text("Deploy? approved", CHAT, sent.message_id)
    with pytest.raises(BadRequest, match=r"(?i)Query is too old"):
        await query.answer("again")
    (answer,) = tg.callback_answers
    assert (answer.callback_query_id, answer.text, answer.show_alert) == (
        query.id,
        "Approved",
        True,
    )
    assert (tg.message(CHAT, sent.message_id).text, tg.message(CHAT, sent.message_id).edits) == (
        "Deploy? approved",
        1,
    )
    assert tg.message(CHAT, sent.message_id).reply_markup is None
    with pytest.raises(BadRequest, match=r"(?i)Message is not modified"):
        await bot.edit_message_text("Deploy? approved", CHAT, sent.message_id)


async def test_a_held_send_arrives_and_waits_for_release(tg: TelegramServer, bot: Bot) -> None:
    tg.add_chat(CHAT)
    hold = tg.hold("sendMessage")
    async with anyio.create_task_group() as group:
        group.start_soon(bot.send_message, CHAT, "held")
        with anyio.fail_after(5):
            await hold.arrived
        (call,) = tg.calls("sendMessage")
        assert (call.params["text"], call.status) == ("held", None)
        assert tg.sent(CHAT) == []
        hold.release()
    assert tg.calls("sendMessage")[0].status == 200
    assert [m.text for m in tg.sent(CHAT)] == ["held"]


async def test_a_delivered_hold_sends_before_it_answers(tg: TelegramServer, bot: Bot) -> None:
    tg.add_chat(CHAT)
    hold = tg.hold("sendMessage", delivered=True)
    async with anyio.create_task_group() as group:
        group.start_soon(bot.send_message, CHAT, "gone out")
        with anyio.fail_after(5):
            await hold.arrived
            await tg.until(lambda: len(tg.sent(CHAT)) == 1)
        group.cancel_scope.cancel()  # the client dies before the answer
    assert tg.calls("sendMessage")[0].status is None
    hold.release()


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[str, list[tuple[str | None, dict[str, Any]]]]]:
    got: list[tuple[str | None, dict[str, Any]]] = []

    async def hook(request: web.Request) -> web.Response:
        secret = request.headers.get("X-Telegram-Bot-Api-Secret-Token")
        got.append((secret, await request.json()))
        return web.Response(status=200 if secret == "s3cret-token" else 403)

    app = web.Application()
    app.add_routes([web.post("/hook", hook)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/hook", got
    await runner.cleanup()


async def test_webhook_delivery_checks_the_secret(
    tg: TelegramServer, bot: Bot, receiver: tuple[str, list[tuple[str | None, dict[str, Any]]]]
) -> None:
    url, got = receiver
    with pytest.raises(BadRequest, match=r"(?i)Secret token contains unallowed characters"):
        await bot.set_webhook(url, secret_token="not secret!")
    assert await bot.set_webhook(url, secret_token="s3cret-token")
    update_id = tg.push_message(CHAT, "via webhook")
    with pytest.raises(Conflict, match="webhook is active"):
        await bot.get_updates()
    assert await tg.deliver(update_id, secret="wrong") == 403
    info = await bot.get_webhook_info()
    assert info.pending_update_count == 1
    assert info.last_error_message == "Wrong response from the webhook: 403 Forbidden"
    assert await tg.deliver() == 200
    assert [(secret, body["message"]["text"]) for secret, body in got] == [
        ("wrong", "via webhook"),
        ("s3cret-token", "via webhook"),
    ]
    assert tg.pending_updates() == []
    assert await bot.delete_webhook()
    assert await bot.get_updates() == ()


async def test_shutdown_ends_a_pending_long_poll() -> None:
    tg = TelegramServer(token=TOKEN)
    await tg.__aenter__()
    result: list[Any] = []
    async with Bot(TOKEN, base_url=tg.base_url) as bot:

        async def poll() -> None:
            result.append(await bot.get_updates(timeout=40))

        async with anyio.create_task_group() as group:
            group.start_soon(poll)
            with anyio.fail_after(5):
                await tg.until(lambda: len(tg.calls("getUpdates")) == 1)
                await tg.__aexit__(None, None, None)
    assert result == [()]


async def test_a_client_that_leaves_a_long_poll_is_dropped(tg: TelegramServer) -> None:
    url = f"{tg.base_url}{TOKEN}/getUpdates"
    async with httpx.AsyncClient() as client:

        async def poll() -> None:
            await client.post(url, data={"timeout": "30"})

        async with anyio.create_task_group() as group:
            group.start_soon(poll)
            with anyio.fail_after(5):
                await tg.until(tg.polling)
            group.cancel_scope.cancel()  # the client hangs up
    with anyio.fail_after(5):
        await tg.until(lambda: not tg.polling())
    update_id = tg.push_message(CHAT, "still here")
    assert [u["update_id"] for u in tg.pending_updates()] == [update_id]
    assert tg.calls("getUpdates")[0].status is None


def test_in_thread_serves_a_client_in_another_loop() -> None:
    with TelegramServer.in_thread(token=TOKEN) as tg:
        update_id = tg.push_message(CHAT, "from the test thread")

        async def client() -> str:
            async with Bot(TOKEN, base_url=tg.base_url) as bot:
                (update,) = await bot.get_updates(timeout=5)
                await bot.send_message(update.message.chat_id, "pong")
                return str(update.message.text)

        assert asyncio.run(client()) == "from the test thread"
        tg.until_sync(lambda: len(tg.sent(CHAT)) == 1, timeout=5)
        assert tg.sent(CHAT)[0].text == "pong"
        assert tg.pending_updates()[0]["update_id"] == update_id  # not confirmed yet


async def test_the_standalone_server_is_scripted_over_http() -> None:
    command = [sys.executable, "-m", "toren.testing.telegram_server", "--token", "555:XYZ"]
    async with await anyio.open_process(command) as process:
        assert process.stdout is not None
        with anyio.fail_after(10):
            url = (await process.stdout.receive()).decode().strip()
        try:
            async with httpx.AsyncClient(base_url=url) as control:
                pushed = await control.post(
                    "/_toren/push_message", json={"chat_id": 5, "text": "hi"}
                )
                async with Bot("555:XYZ", base_url=f"{url}/bot") as bot:
                    (update,) = await bot.get_updates()
                    await bot.send_message(5, "pong")
                sent = (await control.post("/_toren/sent")).json()["result"]
        finally:
            process.terminate()
    assert update.update_id == pushed.json()["result"]
    assert [(m["chat_id"], m["text"]) for m in sent] == [(5, "pong")]
