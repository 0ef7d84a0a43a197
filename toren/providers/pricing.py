"""Dollar prices and context windows of models, from the maintained ``genai-prices`` library
(offline snapshot).

A model the library does not know is *unpriced* (``None``), never free: receipts show it as such;
its context window is unknown (``None``), and compaction falls back to a setting.
"""

from __future__ import annotations

import logging
import re
from decimal import Decimal
from functools import lru_cache

import genai_prices

from toren._model import Usage

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
    """
    tokens = genai_prices.Usage(input_tokens=usage.input_tokens, output_tokens=usage.output_tokens)
    for provider_id, model_ref in _candidates(provider, model):
        try:
            calculation = genai_prices.calc_price(
                tokens, model_ref=model_ref, provider_id=provider_id
            )
        except LookupError:
            continue
        return calculation.total_price
    logger.debug("no price known for %s/%s; the call is unpriced", provider, model)
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
