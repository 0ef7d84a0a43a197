"""What ``toren worker``, ``toren up`` and ``toren dev`` do with an app before their worker
starts: load it and log what ``toren agents check`` would report. Its providers' SDKs are not
imported here: the worker imports them once it serves (``toren.actors.runs.kind``), so that it
registers seconds sooner.

Imported only by the commands that boot a worker (it brings the agent layer with it), so that
the other commands start without it.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Mapping
from types import ModuleType

from toren._agent.agents import Agent, agents_in, check
from toren._agent.app import load_app, loaded_agents
from toren._agent.tables import log_agent_findings
from toren._core.logs import show_info_from
from toren._core.secret_files import read_secret_files
from toren._settings import Settings
from toren.providers import parse_model

log = logging.getLogger("toren.worker")

# The variable each provider cannot call without (Bedrock also finds credentials in profiles
# and instance roles, so nothing is certain to be missing there).
PROVIDER_KEYS = {"anthropic": "ANTHROPIC_API_KEY", "openai": "OPENAI_API_KEY"}


def boot_app(app: str | None, settings: Settings) -> None:
    """What ``toren worker`` and ``toren up`` do before their worker starts: load the ``--app``
    module, read the secret files its channels name and log the boot checks. Without an app,
    the boot checks warn that the worker runs no agents. Then freeze what is loaded (see
    below).

    Raises:
        ConfigError: the app cannot be loaded, or a secret file cannot be read.
    """
    if not app:
        log_boot_checks(None, settings)
        return
    module = load_app(app, settings)
    read_secret_files(names=channel_variables(module))
    log_boot_checks(module, settings)
    # What is loaded now lives as long as the process: frozen, the garbage collector leaves it
    # alone. Importing an SDK once the worker serves (toren.actors.runs.kind) sets off full
    # collections, which stop the event loop (a takeover, a step) for as long as they scan:
    # 130-260 ms each over everything, 30-80 ms over what the import made (measured here).
    gc.freeze()


def log_boot_checks(module: ModuleType | None, settings: Settings) -> None:
    """At boot (``toren worker``, ``toren dev --app``, ``toren up``), what ``toren agents
    check`` reports: flagged tools, one-sided cross-agent consent (warnings) and
    ``[agents.NAME]`` tables for agents not loaded here (info); and a warning per agent whose
    provider key is not set. The app's own package logs from INFO from here on, as Toren does.
    Without an app (``module`` is ``None``), a warning that this worker runs no agents.

    Call it once the environment is final (secret files read, an offline model's variables
    set): the key check reads it.
    """
    if module is None:
        log.warning(
            "no --app: this worker runs no agents (only Toren's own actors). Give it the module "
            "that defines them: `toren worker --app MODULE` or TOREN_APP=MODULE "
            "(`--app toren.demo` runs the demo agent)."
        )
        return
    show_info_from(module.__name__.partition(".")[0])
    log_tool_flags(module)
    source = str(settings.config_file or "the settings file")
    agents = loaded_agents(module)
    log_agent_findings(agents, settings.agents, source, log)
    log_missing_keys(agents)


def log_missing_keys(agents: list[Agent], environ: Mapping[str, str] = os.environ) -> None:
    """Warn, once per agent, about a provider key that is not set: its runs would fail at
    their first model call. A local model server (an offline model, a gateway) is given a key
    too (any value), so it is not warned about."""
    for agent in agents:
        provider, _ = parse_model(agent.model)
        name = PROVIDER_KEYS.get(provider)
        if name is not None and not environ.get(name):
            log.warning(
                "agent %s uses %s, but %s is not set: its runs will fail at their first model "
                "call. Set %s in this process's environment (any value for a local gateway "
                "that needs none).",
                agent.name,
                agent.model,
                name,
                name,
            )


def log_tool_flags(module: ModuleType) -> None:
    """At boot, say loudly which tools can repeat a real-world effect with nobody asked."""
    for finding in check(agents_in(module).values()):
        if finding.flagged:
            log.warning(
                "agent %s: tool %s is external, unkeyed and needs no approval: a crash between "
                "its effect and its record repeats the effect (at-least-once). Make it keyed "
                "(pass ctx.idempotency_key on) or ask for approval.",
                finding.agent,
                finding.tool,
            )


def channel_variables(module: ModuleType) -> list[str]:
    """The variables the app's agents' channels read (``token_env``, ``webhook_secret_env``),
    as :func:`toren.load_app` registered them (settings-file tables applied)."""
    found: set[str] = set()
    for agent in loaded_agents(module):
        if agent.telegram is not None:
            found.update((agent.telegram.token_env, agent.telegram.webhook_secret_env))
    return sorted(n for n in found if n)
