"""The offline model for ``pair_coder``: writes a program, runs it (allowed), then cleans up
with a command that needs approval, and reports what the program printed."""

from __future__ import annotations

from toren.testing import ModelRequest, Reply, ToolCall, latest_results, turns

PROGRAM = "print(sum(n * n for n in range(10)))\n"


def _output(result: str) -> str:
    """What a command printed: its result starts ``$ command`` and ``[in /workspace; exit N]``."""
    return result.split("\n", 2)[-1].strip()


def script(request: ModelRequest) -> Reply:
    """Write squares.py, run it, remove it, then say what it printed."""
    step = turns(request)
    if step == 0:
        write = ToolCall(
            id="w1", name="write_file", arguments={"path": "squares.py", "content": PROGRAM}
        )
        return Reply(["I will write the program first.", write])
    if step == 1:
        return Reply([ToolCall(id="b1", name="bash", arguments={"command": "python3 squares.py"})])
    if step == 2:
        printed = _output(latest_results(request)[0].content)
        cleanup = ToolCall(id="b2", name="bash", arguments={"command": "rm squares.py"})
        return Reply([f"It printed {printed}. Removing the file.", cleanup])
    ran = next(
        r.content
        for m in request.messages
        for r in m.content
        if getattr(r, "tool_call_id", None) == "b1"
    )
    return Reply(f"The sum of the first ten squares is {_output(ran)}.")
