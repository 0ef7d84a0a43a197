"""Testing helpers for Toren and its users: local, scripted, wire-compatible model servers, model
scripts written in Toren's own terms, and a harness that runs an app against them.

See :mod:`toren.testing.model_servers`. Nothing here reaches the network: the servers listen on
127.0.0.1 and the provider SDKs are pointed at them through their usual base-URL settings.
"""

from toren._agent.model import Message, ModelRequest, Text, ToolCall, ToolResult, Usage
from toren.testing._harness import Harness, RunEnded, harness
from toren.testing._script import (
    ModelScript,
    ScriptedModel,
    latest_results,
    latest_text,
    load_script,
    turns,
)
from toren.testing.model_servers import (
    AnthropicServer,
    BedrockServer,
    Disconnect,
    Fail,
    Hold,
    OpenAIServer,
    ReceivedRequest,
    Reply,
    ScriptedServer,
    Step,
)

__all__ = [
    "AnthropicServer",
    "BedrockServer",
    "Disconnect",
    "Fail",
    "Harness",
    "Hold",
    "Message",
    "ModelRequest",
    "ModelScript",
    "OpenAIServer",
    "ReceivedRequest",
    "Reply",
    "RunEnded",
    "ScriptedModel",
    "ScriptedServer",
    "Step",
    "Text",
    "ToolCall",
    "ToolResult",
    "Usage",
    "harness",
    "latest_results",
    "latest_text",
    "load_script",
    "turns",
]
