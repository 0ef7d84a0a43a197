"""Testing helpers for Toren and its users: local, scripted, wire-compatible model servers.

See :mod:`toren.testing.model_servers`. Nothing here reaches the network: the servers listen on
127.0.0.1 and the provider SDKs are pointed at them through their usual base-URL settings.
"""

from toren._model import Text, ToolCall, Usage
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
    "Hold",
    "OpenAIServer",
    "ReceivedRequest",
    "Reply",
    "ScriptedServer",
    "Step",
    "Text",
    "ToolCall",
    "Usage",
]
