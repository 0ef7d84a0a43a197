"""The offline model for ``refund_desk``: a model script (see ``toren.testing``) that reads the
conversation as Toren messages and answers with text and tool calls."""

from __future__ import annotations

import json
import re

from toren.testing import ModelRequest, Reply, Text, ToolCall, Usage, latest_results, turns

USAGE = Usage(input_tokens=500, output_tokens=40)  # what each call reports (and is priced at)


def script(request: ModelRequest) -> Reply:
    """Look the order named in the task up, refund what was paid, then say how it went."""
    task = " ".join(b.text for b in request.messages[0].content if isinstance(b, Text))
    order = re.search(r"[A-Z]-\d+", task)
    if order is None:
        return Reply("Which order is it? Please give its id (like A-17).", usage=USAGE)
    results = latest_results(request)
    if turns(request) > 0 and not results:  # a message sent to the run after its answer
        return Reply(
            "This desk handles one refund per run: start a new run for another.", usage=USAGE
        )
    if turns(request) == 0:
        call = ToolCall(id="lookup-1", name="lookup_order", arguments={"order_id": order[0]})
        return Reply([call], usage=USAGE)
    if turns(request) == 1:
        if results[0].is_error:
            return Reply(f"I could not find order {order[0]}: {results[0].content}", usage=USAGE)
        paid = json.loads(results[0].content)["paid"]
        arguments = {"order_id": order[0], "amount": paid}
        return Reply(
            [ToolCall(id="refund-1", name="issue_refund", arguments=arguments)], usage=USAGE
        )
    if results[0].is_error:
        return Reply(f"No refund was made: {results[0].content}.", usage=USAGE)
    return Reply(f"Done: {results[0].content}.", usage=USAGE)
