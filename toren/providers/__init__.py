"""Model providers: Anthropic, OpenAI (and compatible gateways) and Bedrock, through their SDKs.

:func:`provider_for` turns ``"anthropic/<model>"``, ``"openai/<model>"`` or ``"bedrock/<model>"``
into a :class:`ModelProvider`. The SDKs' own retries are off: :class:`RetryPolicy` decides, and a
failed call raises :class:`ProviderError` carrying whether it was retryable and whether the
request was over the model's context window. Prices come from :func:`price`, context windows from
:func:`context_window`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from toren._core.errors import ConfigError
from toren.providers._base import ModelProvider, ProviderError, RetryingProvider, RetryPolicy
from toren.providers.pricing import context_window, price

__all__ = [
    "PROVIDERS",
    "ModelProvider",
    "ProviderError",
    "RetryPolicy",
    "RetryingProvider",
    "context_window",
    "parse_model",
    "price",
    "provider_for",
]

PROVIDERS = ("anthropic", "openai", "bedrock")


def parse_model(model: str) -> tuple[str, str]:
    """Split ``"provider/model-id"`` into its provider name and the provider's model id.

    Raises:
        ConfigError: the prefix is not one of :data:`PROVIDERS`, or the model id is empty.
    """
    provider, sep, model_id = model.partition("/")
    if not sep or provider not in PROVIDERS or not model_id:
        raise ConfigError(
            f"unknown model {model!r}",
            hint=f"name it as <provider>/<model>, with provider one of {', '.join(PROVIDERS)} "
            "(for example anthropic/claude-sonnet-4-6)",
        )
    return provider, model_id


def provider_for(
    model: str, *, env: Mapping[str, str] | None = None, retry: RetryPolicy | None = None
) -> RetryingProvider:
    """The provider for ``"anthropic/<model>"``, ``"openai/<model>"`` or ``"bedrock/<model>"``.

    Keys, base URLs and regions are read from ``env`` (default: ``os.environ``) when the provider
    is first used, not here; a missing key then raises :class:`ConfigError` naming the variable.
    The provider sends each request's own ``model``; ``provider.model`` records the one named here.
    Close it with ``await provider.aclose()`` (or use it with ``async with``).

    Raises:
        ConfigError: the prefix is not one of :data:`PROVIDERS`.
    """
    name, model_id = parse_model(model)
    environment = os.environ if env is None else env
    policy = retry if retry is not None else RetryPolicy()
    if name == "anthropic":
        from toren.providers.anthropic import AnthropicProvider

        return AnthropicProvider(model=model_id, env=environment, retry=policy)
    if name == "openai":
        from toren.providers.openai import OpenAIProvider

        return OpenAIProvider(model=model_id, env=environment, retry=policy)
    from toren.providers.bedrock import BedrockProvider

    return BedrockProvider(model=model_id, env=environment, retry=policy)
