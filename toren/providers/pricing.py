"""Dollar prices and context windows of models, from the maintained ``genai-prices`` library
(offline snapshot).

A model the library does not know is *unpriced* (``None``), never free: receipts show it as such;
its context window is unknown (``None``), and compaction falls back to a setting.
"""

from __future__ import annotations

import logging
import re
from datetime import UTC, datetime
from decimal import Decimal
from functools import lru_cache

import genai_prices
from genai_prices import data_snapshot, types

from toren._agent.model import Usage

__all__ = ["bedrock_model_refs", "context_window", "price"]

logger = logging.getLogger("toren.providers")

# Toren's provider names to genai-prices provider ids.
_PROVIDER_IDS = {"anthropic": "anthropic", "openai": "openai", "bedrock": "aws"}

# Cross-region inference profiles prefix the model id with a geography.
_GEO_PREFIX = re.compile(r"^(us|eu|apac|ap|jp|au|ca|us-gov|global)\.", re.I)
_VERSION_SUFFIX = re.compile(r"-v\d+(:\d+)?$")


def bedrock_model_refs(model: str) -> list[tuple[str, str]]:
    """``(provider_id, model_ref)`` pairs to try, best first, for a Bedrock model id.

    ``arn:aws:bedrock:...:inference-profile/us.anthropic.claude-sonnet-4-6`` and
    ``us.anthropic.claude-sonnet-4-6-v1:0`` are tried as Bedrock (``aws``) models first, then as
    the vendor's own model (``anthropic`` / ``claude-sonnet-4-6``) when the library knows the
    vendor.
    """
    bare = model.rsplit("/", 1)[-1] if model.startswith("arn:") else model
    refs = [("aws", bare)]
    unprefixed = _GEO_PREFIX.sub("", bare)
    if unprefixed != bare:
        refs.append(("aws", unprefixed))
    vendor, _, name = unprefixed.partition(".")
    if name and vendor in _PROVIDER_IDS:
        refs.append((_PROVIDER_IDS[vendor], _VERSION_SUFFIX.sub("", name)))
    return refs


def _candidates(provider: str, model: str) -> list[tuple[str, str]]:
    """``(provider_id, model_ref)`` pairs to look ``model`` up by, best first (none: unknown)."""
    if provider == "bedrock":
        return bedrock_model_refs(model)
    if provider in _PROVIDER_IDS:
        return [(_PROVIDER_IDS[provider], model)]
    return []


def price(provider: str, model: str, usage: Usage) -> Decimal | None:
    """The price in US dollars of a call with ``usage``, or ``None`` if the model is unknown.

    ``provider`` is Toren's provider name (``anthropic``, ``openai``, ``bedrock``) and ``model``
    the provider's model id. Never raises for an unknown provider or model: that is unpriced.

    The model is looked up once per name. A model whose price now is a plain rate per input and
    per output token is priced from those rates (what the library computes for such a price,
    value and digits; ``tests/test_providers.py`` checks it for every model it knows); any other
    (tiers, conditions, fees) by the library's own calculation, which costs about a hundred times
    as much and ran twice per model step (the announcement's estimate and the call).
    """
    found = _model(provider, model)
    if found is None:
        logger.debug("no price known for %s/%s; the call is unpriced", provider, model)
        return None
    vendor, info = found
    now = datetime.now(tz=UTC)
    prices = info.get_prices(now)
    if linear_rates(prices) is not None:
        # As the library sums it, unit by unit from zero: the same value in the same digits.
        counts = {"input_mtok": usage.input_tokens, "output_mtok": usage.output_tokens}
        total = Decimal(0)
        for key, rate in vars(prices).items():
            if rate is not None:
                total += rate * counts.get(key, 0) / (1000 if key.endswith("_kcount") else _MTOK)
        return total
    tokens = genai_prices.Usage(input_tokens=usage.input_tokens, output_tokens=usage.output_tokens)
    return info.calc_price(tokens, vendor, genai_request_timestamp=now).total_price


_MTOK = 1_000_000
# Prices that a call reporting only input and output tokens never pays (cache and media tokens,
# searches): a model with any other (a fee per request, tiers) is priced by the library.
_UNUSED = frozenset(
    {
        "cache_read_mtok",
        "cache_write_mtok",
        "cache_write_1h_mtok",
        "cache_audio_read_mtok",
        "cache_image_read_mtok",
        "input_audio_mtok",
        "output_audio_mtok",
        "input_image_mtok",
        "output_image_mtok",
        "web_searches_kcount",
        "storage_searches_kcount",
    }
)


def linear_rates(prices: types.ModelPrice) -> tuple[Decimal, Decimal] | None:
    """The prices per million input and output tokens, if ``prices`` is nothing more for a call
    that reports only those; ``None`` otherwise."""
    per_input = getattr(prices, "input_mtok", None)
    per_output = getattr(prices, "output_mtok", None)
    if not isinstance(per_input, Decimal) or not isinstance(per_output, Decimal):
        return None
    others = {k for k, v in vars(prices).items() if v is not None} - {"input_mtok", "output_mtok"}
    return (per_input, per_output) if others <= _UNUSED else None


@lru_cache(maxsize=256)
def _model(provider: str, model: str) -> tuple[types.Provider, types.ModelInfo] | None:
    """The library's provider and model for Toren's ``provider`` and ``model`` (the first of
    :func:`_candidates` it knows), or ``None``."""
    snapshot = data_snapshot.get_snapshot()
    for provider_id, model_ref in _candidates(provider, model):
        try:
            return snapshot.find_provider_model(model_ref, None, provider_id, None)
        except LookupError:
            continue
    return None


@lru_cache(maxsize=256)
def context_window(provider: str, model_id: str) -> int | None:
    """The context window in tokens of ``model_id``, or ``None`` if it is unknown.

    The model is matched as :func:`price` matches it (a Bedrock id as a Bedrock model first, then
    as its vendor's) and its window read from the library's model data; the first match that
    names a window wins. Never raises: a model or provider the library does not know, or a model
    without a window in its data, is ``None``.
    """
    nothing = genai_prices.Usage(input_tokens=0, output_tokens=0)
    for provider_id, model_ref in _candidates(provider, model_id):
        try:
            calculation = genai_prices.calc_price(
                nothing, model_ref=model_ref, provider_id=provider_id
            )
        except LookupError:
            continue
        if calculation.model.context_window is not None:
            return calculation.model.context_window
    return None
