"""The offline model for ``telegram_assistant``: looks a city's time zone up when asked about
one, and otherwise says what it heard."""

from __future__ import annotations

import re

from toren.testing import ModelRequest, Reply, ToolCall, latest_results, latest_text


def script(request: ModelRequest) -> Reply:
    """``time in CITY`` calls the ``time_zone`` tool; its result is the answer."""
    results = latest_results(request)
    if results:
        return Reply(results[0].content if not results[0].is_error else "I do not know that city.")
    text = latest_text(request)
    asked = re.search(r"time in (\w+)", text, re.IGNORECASE)
    if asked:
        call = ToolCall(
            id=f"tz-{len(request.messages)}", name="time_zone", arguments={"city": asked[1]}
        )
        return Reply([call])
    return Reply(f"You said: {text}")
