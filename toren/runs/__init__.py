"""Agent runs as data: the messages a run receives, the events it records, and their fold.

Public, because the run actor, the CLI and the API all build on it.

A run is an actor (``run/<uuid>``, kind ``toren.run``) whose journal is the record of what the
agent did: every model call with its response, usage and cost, every tool call's intent and
result, every approval asked and given. Its state is the fold of those events (:func:`fold`), so
anything that can read the journal (the CLI, the API) sees the same run the worker sees, and a
resumed run rebuilds it without calling anything again.

The event format is versioned: every event carries ``v`` (1 today). A later version adds events
or fields with defaults; recorded journals of every earlier version are kept as test fixtures.
"""

from toren._agents import Agent, Tool, ToolContext, agent_named, agent_route, served_routes
from toren._digest import GENESIS, chain
from toren._model import (
    Message,
    ModelRequest,
    ModelResponse,
    Text,
    ToolCall,
    ToolSpec,
    Usage,
)
from toren.runs.client import (
    DECISION_WAIT,
    MESSAGE_CAP,
    IdempotencyConflict,
    MessageTooLarge,
    cancel,
    check_message,
    decide,
    read_run,
    retry,
    say,
    start_run,
)
from toren.runs.events import (
    FORMAT,
    RUN_KIND,
    ApprovalDecided,
    ApprovalRequested,
    Cancel,
    Continue,
    Decide,
    DecisionOutcome,
    DecisionRefused,
    MessageReceived,
    ModelCalled,
    Retry,
    RunCompleted,
    RunFailed,
    RunResumed,
    RunRetried,
    RunRetrying,
    RunStarted,
    Say,
    StartRun,
    StepsInvalidated,
    TimerFired,
    TimerSet,
    ToolIntended,
    ToolResulted,
    Wake,
)
from toren.runs.state import (
    Receipt,
    RunState,
    final_text,
    fold,
    judge_decision,
    receipt,
    summary,
    waiting_on,
)

__all__ = [
    "DECISION_WAIT",
    "FORMAT",
    "GENESIS",
    "MESSAGE_CAP",
    "RUN_KIND",
    "Agent",
    "ApprovalDecided",
    "ApprovalRequested",
    "Cancel",
    "Continue",
    "Decide",
    "DecisionOutcome",
    "DecisionRefused",
    "IdempotencyConflict",
    "Message",
    "MessageReceived",
    "MessageTooLarge",
    "ModelCalled",
    "ModelRequest",
    "ModelResponse",
    "Receipt",
    "Retry",
    "RunCompleted",
    "RunFailed",
    "RunResumed",
    "RunRetried",
    "RunRetrying",
    "RunStarted",
    "RunState",
    "Say",
    "StartRun",
    "StepsInvalidated",
    "Text",
    "TimerFired",
    "TimerSet",
    "Tool",
    "ToolCall",
    "ToolContext",
    "ToolIntended",
    "ToolResulted",
    "ToolSpec",
    "Usage",
    "Wake",
    "agent_named",
    "agent_route",
    "cancel",
    "chain",
    "check_message",
    "decide",
    "final_text",
    "fold",
    "judge_decision",
    "read_run",
    "receipt",
    "retry",
    "say",
    "served_routes",
    "start_run",
    "summary",
    "waiting_on",
]
