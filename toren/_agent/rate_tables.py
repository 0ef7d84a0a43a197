"""``[rate_limits.NAME]`` tables: shared provider rate limits, as the settings file declares them.

::

    [rate_limits."anthropic/claude-sonnet-4-6"]   # a model: the calls to it
    requests_per_minute = 50
    tokens_per_minute = 40000

    [rate_limits.anthropic]                       # a provider: every call through its API key
    requests_per_minute = 100

A call takes from every limit that names its model or its provider (:func:`limits_for`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from toren._core.errors import ConfigError
from toren._core.rates import RateLimit
from toren.providers import PROVIDERS, parse_model

_KEYS = ("requests_per_minute", "tokens_per_minute")


def read_rate_tables(data: Any, source: str) -> tuple[RateLimit, ...]:
    """The limits of a file's ``rate_limits`` table (read from ``source``).

    Raises:
        ConfigError: a limit that names neither a provider nor a provider's model, an unknown
            key, or a cap that is not a positive whole number; the message names the table and
            the key.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"rate_limits in {source} must be tables: [rate_limits.NAME]")
    found = []
    for name, table in data.items():
        where = f'[rate_limits."{name}"] in {source}'
        if not isinstance(table, Mapping):
            raise ConfigError(f"{where} must be a table", hint=_HINT)
        checked_name(name, where)
        unknown = sorted(set(table) - set(_KEYS))
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}", hint=_HINT)
        for key in _KEYS:
            value = table.get(key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31
            ):
                raise ConfigError(f"{where}: {key} must be a positive whole number", hint=_HINT)
        if not any(key in table for key in _KEYS):
            raise ConfigError(f"{where}: give {' and/or '.join(_KEYS)}", hint=_HINT)
        found.append(RateLimit(name=name, **{k: table[k] for k in _KEYS if k in table}))
    return tuple(found)


_HINT = (
    'Such as [rate_limits."anthropic/claude-sonnet-4-6"] or [rate_limits.anthropic] with '
    "requests_per_minute = 50 and/or tokens_per_minute = 40000."
)


def checked_name(name: str, where: str) -> None:
    """Raise :class:`ConfigError` unless ``name`` is a provider or a provider's model."""
    if name in PROVIDERS:
        return
    try:
        parse_model(name)
    except ConfigError:
        raise ConfigError(
            f"{where}: a rate limit names a provider ({', '.join(PROVIDERS)}) or a model "
            "(provider/model)",
            hint=_HINT,
        ) from None


def limits_for(model: str, limits: Iterable[RateLimit]) -> tuple[RateLimit, ...]:
    """The limits a call to ``model`` (``provider/model-id``) takes from: its model's and its
    provider's."""
    provider = model.partition("/")[0]
    return tuple(limit for limit in limits if limit.name in (model, provider))
