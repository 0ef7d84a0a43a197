"""What every provider adapter shares: the protocol, the error, the retry policy, redaction.

An adapter implements one attempt (:meth:`RetryingProvider._send`) and maps its SDK's exceptions
to :class:`ProviderError` (:meth:`RetryingProvider._classify`); the base runs the attempts under
one tenacity policy. The SDKs' own retries are off, so :class:`RetryPolicy` is the only one that
counts (and the only one a test has to account for).
"""

from __future__ import annotations

import abc
import email.utils
import logging
import math
import random
import re
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, ClassVar, Protocol, Self, runtime_checkable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import anyio
import attrs
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
)
from tenacity.stop import stop_base

from toren._agent.model import Message, ModelRequest, ModelResponse, Text, ToolCall, ToolResult
from toren._core.errors import ConfigError, TorenError
from toren._core.json_text import SURROGATE as _SURROGATE

logger = logging.getLogger("toren.providers")


class ProviderError(TorenError):
    """A model provider refused or failed a call.

    Attributes:
        provider: ``"anthropic"``, ``"openai"`` or ``"bedrock"``.
        status: the HTTP status, or ``None`` when no response came (timeout, connection error).
        message: the provider's own message (or a description of the transport failure).
        retryable: whether the same call may succeed later (429, 5xx, timeouts, resets).
        retry_after: the delay in seconds the provider asked for, if it named one.
        answered: the provider answered, and its answer could not be read (malformed,
            nested too deeply, a number too long): the call was probably paid for. Never
            retryable.
        too_large: the provider refused the request as over the model's context window (or
            over its request size limit). Never retryable: the same request will not fit; a
            smaller one (a compacted conversation) may.
    """

    def __init__(
        self,
        *,
        provider: str,
        status: int | None,
        message: str,
        retryable: bool,
        retry_after: float | None = None,
        answered: bool = False,
        too_large: bool = False,
    ) -> None:
        self.provider = provider
        self.status = status
        self.message = redact_text(message)
        self.retryable = retryable and not answered and not too_large
        self.retry_after = retry_after
        self.answered = answered
        self.too_large = too_large
        what = f"HTTP {status}" if status is not None else "no response"
        if too_large:
            what += ", the request is over the model's context window"
            hint = (
                "the same request will not fit; shorten the conversation (compact it) "
                "or use a model with a larger window"
            )
        elif answered:
            what = "an answer that could not be read"
            hint = "asking again would pay again; retry the run if the provider is fixed"
        elif retryable:
            hint = "this is transient; the call may be retried"
        elif status in (401, 403):
            hint = "check the provider's API key and permissions"
        else:
            hint = "the request was refused; retrying it unchanged will not help"
        super().__init__(f"{provider} model call failed ({what}): {self.message} ({hint})")


@runtime_checkable
class ModelProvider(Protocol):
    """Makes model calls in Toren's neutral vocabulary.

    ``call`` raises :class:`ProviderError` when the provider fails (after the retry policy is
    exhausted, or at once when the failure is not retryable) and :class:`ConfigError` when the
    provider is not configured (for example, its API key is missing). ``aclose`` releases the
    SDK client's connections.
    """

    async def call(
        self, request: ModelRequest, *, before_attempt: Callable[[], None] | None = None
    ) -> ModelResponse:
        """Send ``request`` and return the model's answer; ``before_attempt`` is called before
        each attempt (a check that may raise to stop before anything is sent)."""
        ...

    async def aclose(self) -> None:
        """Close the provider's connections; it must not be used afterwards."""
        ...


@attrs.frozen(kw_only=True)
class RetryPolicy:
    """How a provider retries retryable failures (429, 5xx, timeouts, connection errors).

    The delay before attempt ``k + 1`` is ``min(cap, base * 2 ** (k - 1))``, scaled by a random
    factor in ``[1 - jitter, 1]``, and never shorter than the ``Retry-After`` the provider sent.
    A ``Retry-After`` longer than ``max_retry_after`` ends the retries at once (a caller that can
    park, like a run, does better than a worker waiting that long). Each attempt is bounded by
    ``attempt_timeout`` seconds (a cancel scope), which counts as a retryable timeout.
    """

    attempts: int = attrs.field(default=6, validator=attrs.validators.ge(1))
    base: float = attrs.field(default=0.5, validator=attrs.validators.ge(0))
    cap: float = attrs.field(default=30.0, validator=attrs.validators.ge(0))
    jitter: float = attrs.field(
        default=0.5, validator=[attrs.validators.ge(0), attrs.validators.le(1)]
    )
    max_retry_after: float = 120.0
    attempt_timeout: float = attrs.field(default=600.0, validator=attrs.validators.gt(0))

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RetryPolicy:
        """The default policy with ``TOREN_MODEL_RETRY_ATTEMPTS`` (a whole number, at least 1)
        and ``TOREN_MODEL_RETRY_BASE_SECONDS`` (a number, 0 or more) from ``env`` when set.

        Raises:
            ConfigError: one does not hold such a number; the message names the variable and
                never shows its value (it may be a secret set in the wrong variable).
        """
        values: dict[str, Any] = {}
        for field, var, typ, expected in (
            ("attempts", "TOREN_MODEL_RETRY_ATTEMPTS", int, "a whole number, at least 1"),
            ("base", "TOREN_MODEL_RETRY_BASE_SECONDS", float, "a number of seconds, 0 or more"),
        ):
            raw = env.get(var, "").strip()
            if not raw:
                continue
            try:
                values[field] = typ(raw)
                cls(**{field: values[field]})  # its validators: attempts >= 1, base >= 0
            except ValueError:
                raise ConfigError(
                    f"{var} must be {expected}",
                    hint="The value is not shown, in case it is a secret set in the wrong place.",
                ) from None
        return cls(**values)

    def delay(self, failures: int, retry_after: float | None = None) -> float:
        """Seconds to wait after the ``failures``-th consecutive failure (1-based)."""
        backoff = min(self.cap, self.base * 2.0 ** (failures - 1))
        backoff *= random.uniform(1 - self.jitter, 1)
        return max(backoff, retry_after or 0.0)


def parse_retry_after(headers: Mapping[str, str] | None) -> float | None:
    """Seconds from ``retry-after-ms``, or ``Retry-After`` as seconds or an HTTP date.

    Header names are matched case-insensitively; an unreadable value counts as absent, and so
    does one that is no finite number (``nan``, ``inf``: no block or timer can be set from it).
    """
    if not headers:
        return None
    lowered = {k.lower(): v for k, v in headers.items()}
    value = lowered.get("retry-after-ms")
    if value is not None:
        try:
            ms = float(value)
        except ValueError:
            pass
        else:
            if math.isfinite(ms):
                return max(ms / 1000, 0.0)
    value = lowered.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return max(seconds, 0.0) if math.isfinite(seconds) else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)


def retryable_status(status: int) -> bool:
    """429 and every 5xx may succeed later; other statuses will not."""
    return status == 429 or status >= 500


_SECRET_PARAM = re.compile(r"(key|token|secret|signature|sig|password|auth|credential)", re.I)


def redact_url(url: str) -> str:
    """``url`` with its password and secret-looking query values replaced by ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{host}" if ":" in userinfo else f"***@{host}"
    query = urlencode(
        [
            (k, "***" if _SECRET_PARAM.search(k) else v)
            for k, v in parse_qsl(parts.query, keep_blank_values=True)
        ],
        safe="*",
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


_URL = re.compile(r"https?://[^\s'\"<>]+")


def redact_text(text: str) -> str:
    """``text`` with every URL in it passed through :func:`redact_url`."""
    return _URL.sub(lambda m: redact_url(m.group(0)), text)


def require_env(env: Mapping[str, str], name: str, provider: str, hint: str = "") -> str:
    """The value of ``name`` in ``env``.

    Raises:
        ConfigError: the variable is unset or empty (the message names it, never a value).
    """
    value = env.get(name)
    if not value:
        raise ConfigError(
            f"{provider} needs the environment variable {name}, which is not set",
            hint=hint or f"export {name}=... in the worker's environment",
        )
    return value


def _first_line(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001  (a hostile __str__)
        return "(its message cannot be shown)"
    return text.splitlines()[0][:300] if text else ""


def _clean(value: Any) -> Any:
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_clean(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _dirty(value: Any) -> bool:
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(_dirty(k) or _dirty(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_dirty(v) for v in value)
    return False


def _clean_block(block: Text | ToolCall | ToolResult) -> Text | ToolCall | ToolResult:
    if isinstance(block, Text):
        return Text(text=_clean(block.text)) if _dirty(block.text) else block
    if isinstance(block, ToolResult):
        if _dirty(block.content):
            return attrs.evolve(block, content=_clean(block.content))
        return block
    if _dirty([block.name, block.raw_arguments, block.arguments]):
        return attrs.evolve(
            block,
            name=_clean(block.name),
            arguments=_clean(block.arguments),
            raw_arguments=_clean(block.raw_arguments),
        )
    return block


def wire_safe(request: ModelRequest) -> ModelRequest:
    """``request`` as a provider can be sent it: UTF-8, and so every SDK, cannot carry a lone
    surrogate (hostile model output or tool results can hold one), so each is sent as U+FFFD.
    The journal and the request's digest keep the text exactly; only what goes on the wire
    changes. The same object when nothing needs it."""
    if not _dirty(request.system) and all(
        _clean_block(b) is b for m in request.messages for b in m.content
    ):
        return request
    messages = tuple(
        Message(role=m.role, content=tuple(_clean_block(b) for b in m.content))
        for m in request.messages
    )
    return attrs.evolve(request, system=_clean(request.system), messages=messages)


class _RetryAfterTooLong(stop_base):
    """Stop when the provider asks to wait longer than the policy allows."""

    def __init__(self, limit: float) -> None:
        self.limit = limit

    def __call__(self, retry_state: RetryCallState) -> bool:
        outcome = retry_state.outcome
        exc = outcome.exception() if outcome is not None else None
        return (
            isinstance(exc, ProviderError)
            and exc.retry_after is not None
            and exc.retry_after > self.limit
        )


def _should_retry(exc: BaseException) -> bool:
    return isinstance(exc, ProviderError) and exc.retryable


class RetryingProvider(abc.ABC):
    """A :class:`ModelProvider` that runs one adapter's attempts under a :class:`RetryPolicy`."""

    name: ClassVar[str]

    def __init__(self, *, model: str, env: Mapping[str, str], retry: RetryPolicy) -> None:
        self.model = model
        self.retry = retry
        self._env = dict(env)

    async def call(
        self, request: ModelRequest, *, before_attempt: Callable[[], None] | None = None
    ) -> ModelResponse:
        """Send ``request`` (as :func:`wire_safe` makes it), retrying retryable failures under
        the policy; ``before_attempt`` runs before each attempt (the run checks its lease there,
        so a worker paused during a backoff sends nothing when it wakes).

        Raises:
            ProviderError: a non-retryable failure at once, or the last retryable failure once
                the policy gives up.
            ConfigError: the provider is not configured (e.g. its API key is missing).
        """
        request = wire_safe(request)
        # The first attempt is made directly: most calls need no other, and the retry loop's
        # machinery cost about 3% of a busy worker's time (bench agent). A retryable
        # failure is handed to the loop as its first attempt's outcome, so the stops, waits and
        # log lines are the loop's own.
        try:
            return await self._attempt(request, before_attempt)
        except ProviderError as exc:
            if not _should_retry(exc):
                raise
            first: list[ProviderError] = [exc]

        async def attempt() -> ModelResponse:
            if first:
                raise first.pop()
            return await self._attempt(request, before_attempt)

        retrying = AsyncRetrying(
            sleep=anyio.sleep,
            stop=stop_after_attempt(self.retry.attempts)
            | _RetryAfterTooLong(self.retry.max_retry_after),
            wait=self._wait,
            retry=retry_if_exception(_should_retry),
            before_sleep=self._log_retry,
            reraise=True,
        )
        response: ModelResponse = await retrying(attempt)
        return response

    async def _attempt(
        self, request: ModelRequest, before_attempt: Callable[[], None] | None
    ) -> ModelResponse:
        if before_attempt is not None:
            before_attempt()
        try:
            with anyio.fail_after(self.retry.attempt_timeout):
                return await self._send(request)
        except (ProviderError, ConfigError):
            raise
        except TimeoutError as exc:
            raise ProviderError(
                provider=self.name,
                status=None,
                message=f"no answer within {self.retry.attempt_timeout:g}s",
                retryable=True,
            ) from exc
        except Exception as exc:
            error = self._classify(exc)
            if error is None:
                # Not a failure the SDK knows: the answer could not be read (an SDK parsing a
                # hostile body raises RecursionError, ValueError, ...). Probably paid for: never
                # asked again by itself.
                error = ProviderError(
                    provider=self.name,
                    status=None,
                    message=f"{type(exc).__name__}: {_first_line(exc)}",
                    retryable=False,
                    answered=True,
                )
            raise error from exc

    def _wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome is not None else None
        retry_after = exc.retry_after if isinstance(exc, ProviderError) else None
        return self.retry.delay(state.attempt_number, retry_after)

    def _log_retry(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        delay = state.upcoming_sleep
        status = exc.status if isinstance(exc, ProviderError) else None
        message = exc.message if isinstance(exc, ProviderError) else repr(exc)
        logger.warning(
            "%s call failed (status %s: %s); retrying in %.2fs (attempt %d of %d)",
            self.name,
            status if status is not None else "none",
            message,
            delay,
            state.attempt_number + 1,
            self.retry.attempts,
        )

    @abc.abstractmethod
    async def _send(self, request: ModelRequest) -> ModelResponse:
        """Make one attempt through the SDK (whose own retries are off)."""

    @abc.abstractmethod
    def _classify(self, exc: Exception) -> ProviderError | None:
        """Map an SDK exception to a :class:`ProviderError`; ``None`` lets it propagate."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close the SDK client, if one was made."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with anyio.CancelScope(shield=True):
            await self.aclose()
