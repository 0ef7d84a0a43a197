"""The channel kind as a worker runs it: the channel actor, and the bots this worker runs."""

from __future__ import annotations

from toren.actors.channels.actor import ChannelActor
from toren.actors.channels.runtime import Channels, open_channels
from toren.channels.surfaces import SURFACES
from toren.kernel import Kind, WorkerEnv
from toren.runs import Agents


async def _open(env: WorkerEnv) -> Channels:
    return await open_channels(env.settings, env.pool, env.resources.get(Agents))


KIND = Kind(name="channel", actors=(ChannelActor,), open=_open, surfaces=SURFACES)
