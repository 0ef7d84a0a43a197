"""Object stores: where sandbox checkpoints (:mod:`toren.sandboxes.checkpoints`) live, and
archived journals.

A store maps flat keys (``blobs/<sha256>``, ``manifests/<id>``) to immutable bytes. Two kinds:
:class:`LocalStore`, files under a directory (``toren dev``), and :class:`S3Store`, an
S3-compatible bucket (S3, MinIO, R2) through ``aioboto3``; :func:`store_from_url` picks one
from a URL.

Errors::

    TorenError
    └── StoreError
        ├── MissingObject      no object under that key (also a KeyError)
        ├── CorruptObject      an object's content does not match its hash
        └── StoreUnavailable   the store did not answer, after botocore's own retries (retryable)

A bad store URL, a missing bucket, denied access or missing credentials are ``ConfigError``.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import tempfile
import urllib.parse
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import aioboto3  # type: ignore[import-untyped]
import aiohttp
import anyio
import attrs
from aiobotocore.config import AioConfig  # type: ignore[import-untyped]
from botocore.exceptions import (  # type: ignore[import-untyped]
    BotoCoreError,
    ClientError,
    NoCredentialsError,
)

from toren._core.errors import ConfigError, TorenError

_KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_URL_HINT = "use a directory (file:///path or a plain path) or s3://bucket/prefix"
# Errors never show the URL: it comes from the environment (TOREN_WORKSPACE_STORE,
# TOREN_ARCHIVE_STORE), where a secret set in the wrong variable may have landed. They name the
# setting it came from (store_from_url's ``setting``).


class StoreError(TorenError):
    """An object store (a workspace store, the archive store) could not give back what was
    asked."""


class MissingObject(StoreError, KeyError):
    """No object under this key."""

    def __init__(self, key: str, where: str) -> None:
        self.key = key
        self.where = where
        super().__init__(
            f"no object {key!r} in the workspace store {where}: the checkpoint was written to "
            "another store, or the object was removed"
        )

    def __str__(self) -> str:  # KeyError would show the message quoted
        return str(self.args[0])


class CorruptObject(StoreError):
    """An object's content does not hash to its id: it is never restored."""

    def __init__(self, key: str, detail: str) -> None:
        self.key = key
        self.detail = detail
        super().__init__(
            f"object {key!r} in the workspace store is corrupt ({detail}); it was not restored: "
            "restore an earlier checkpoint, or copy the object back from a backup"
        )


class StoreUnavailable(StoreError):
    """The store did not answer (botocore has already retried)."""

    retryable = True

    def __init__(self, where: str, cause: BaseException) -> None:
        self.where = where
        self.cause = cause
        super().__init__(f"the workspace store {where} did not answer: {cause}")


# -- stores ------------------------------------------------------------------------------------


class WorkspaceStore(Protocol):
    """An object store (sandbox checkpoints, journal and dead-letter archives): flat keys
    (``a/b`` style) to immutable bytes. The kernel calls it :data:`ObjectStore`."""

    async def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, replacing any object there; all or nothing."""
        ...

    async def get(self, key: str) -> bytes:
        """The object under ``key``; raises MissingObject if there is none."""
        ...

    async def exists(self, key: str) -> bool: ...

    async def close(self) -> None: ...

    def list_objects(self, prefix: str) -> AsyncIterator[StoredObject]:
        """Every object whose key starts with ``prefix``, with its size and last write, in no
        particular order (a put during the listing may or may not be seen)."""
        ...

    def list_keys(self, prefix: str) -> AsyncIterator[str]:
        """The keys of :meth:`list_objects`."""
        ...

    async def delete(self, key: str, *, written_before: float | None = None) -> bool:
        """Delete the object under ``key``; with ``written_before`` (a Unix time) only if it was
        last written before then (an object written again since it was listed is kept).
        Returns whether it was deleted (False: no such object, or written since)."""
        ...


def _check_key(key: str) -> str:
    if not _KEY.fullmatch(key):
        raise ValueError(f"invalid workspace store key {key!r}")
    return key


class LocalStore:
    """Objects as files under ``root``; each written to a temporary file, fsynced, renamed."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    async def put(self, key: str, data: bytes) -> None:
        await anyio.to_thread.run_sync(_write_atomic, self.root / _check_key(key), data)

    async def get(self, key: str) -> bytes:
        try:
            return await anyio.to_thread.run_sync((self.root / _check_key(key)).read_bytes)
        except FileNotFoundError:
            raise MissingObject(key, str(self.root)) from None

    async def exists(self, key: str) -> bool:
        return await anyio.to_thread.run_sync((self.root / _check_key(key)).is_file)

    async def close(self) -> None:
        return None

    async def list_objects(self, prefix: str) -> AsyncIterator[StoredObject]:
        found = await anyio.to_thread.run_sync(_list_local, self.root, prefix)
        for item in found:
            yield item

    async def list_keys(self, prefix: str) -> AsyncIterator[str]:
        async for item in self.list_objects(prefix):
            yield item.key

    async def delete(self, key: str, *, written_before: float | None = None) -> bool:
        path = self.root / _check_key(key)
        return await anyio.to_thread.run_sync(_delete_local, path, written_before)


def _write_atomic(path: Path, data: bytes) -> None:
    # Temporary names start with a dot, which no key component may: they never collide.
    created = not path.parent.is_dir()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    for directory in (path.parent, path.parent.parent) if created else (path.parent,):
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


class S3Store:
    """Objects in an S3-compatible bucket (S3, MinIO, R2) through one ``aioboto3`` client.

    The client is made on first use; credentials come from the usual AWS chain (environment,
    profile, instance role) and are never logged. The bucket must exist: Toren does not create
    it. Transient failures are retried by botocore (standard mode, ``attempts`` in all, with
    exponential backoff); what still fails raises StoreUnavailable.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        attempts: int = 5,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.endpoint_url = endpoint_url
        self.region = region
        self.profile = profile
        self.attempts = attempts
        self._client: Any = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._lock = anyio.Lock()

    def __repr__(self) -> str:
        return f"S3Store({self.where})"

    @property
    def where(self) -> str:
        at = f" at {self.endpoint_url}" if self.endpoint_url else ""
        return f"s3://{self.bucket}/{self.prefix}{at}"

    async def put(self, key: str, data: bytes) -> None:
        client = await self._s3()
        with self._translate(key):
            await client.put_object(
                Bucket=self.bucket, Key=self.prefix + _check_key(key), Body=data
            )

    async def get(self, key: str) -> bytes:
        client = await self._s3()
        with self._translate(key):
            response = await client.get_object(
                Bucket=self.bucket, Key=self.prefix + _check_key(key)
            )
            async with response["Body"] as body:
                data: bytes = await body.read()
                return data

    async def exists(self, key: str) -> bool:
        client = await self._s3()
        try:
            with self._translate(key):
                await client.head_object(Bucket=self.bucket, Key=self.prefix + _check_key(key))
        except MissingObject:
            return False
        return True

    async def close(self) -> None:
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            with anyio.CancelScope(shield=True):
                await stack.aclose()

    async def _s3(self) -> Any:
        if self._client is not None:
            return self._client
        async with self._lock:
            if self._client is None:
                session = aioboto3.Session(profile_name=self.profile)
                config = AioConfig(retries={"mode": "standard", "max_attempts": self.attempts})
                async with contextlib.AsyncExitStack() as stack:
                    client = await stack.enter_async_context(
                        session.client(
                            "s3",
                            endpoint_url=self.endpoint_url,
                            region_name=self.region,
                            config=config,
                        )
                    )
                    with self._translate(None):
                        await client.head_bucket(Bucket=self.bucket)
                    self._stack, self._client = stack.pop_all(), client
            return self._client

    @contextlib.contextmanager
    def _translate(self, key: str | None) -> Iterator[None]:
        """botocore's errors as Toren's: what is missing, what to configure, what to retry."""
        try:
            yield
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "NoSuchBucket" or (key is None and status == 404):
                raise ConfigError(
                    f"the S3 bucket {self.bucket!r} does not exist ({self.where})",
                    hint="create it (Toren does not create buckets), or fix the store URL",
                ) from None
            if key is not None and (code in ("NoSuchKey", "NotFound") or status == 404):
                raise MissingObject(key, self.where) from None
            if status == 403 or code in ("AccessDenied", "InvalidAccessKeyId"):
                raise ConfigError(
                    f"access to the S3 bucket {self.bucket!r} was denied ({code})",
                    hint="check the AWS credentials (environment or profile) and the bucket's "
                    "policy: Toren needs GetObject, PutObject, ListBucket and DeleteObject",
                ) from None
            raise StoreUnavailable(self.where, e) from e
        except NoCredentialsError:
            raise ConfigError(
                "no AWS credentials found for the S3 workspace store",
                hint="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE",
            ) from None
        except (BotoCoreError, aiohttp.ClientError, OSError) as e:
            raise StoreUnavailable(self.where, e) from e

    async def list_objects(self, prefix: str) -> AsyncIterator[StoredObject]:
        client = await self._s3()
        paginator = client.get_paginator("list_objects_v2")
        with self._translate(None):
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                for item in page.get("Contents", ()):
                    yield StoredObject(
                        key=item["Key"][len(self.prefix) :],
                        size=int(item["Size"]),
                        written_at=item["LastModified"].timestamp(),
                    )

    async def list_keys(self, prefix: str) -> AsyncIterator[str]:
        async for item in self.list_objects(prefix):
            yield item.key

    async def delete(self, key: str, *, written_before: float | None = None) -> bool:
        # S3 has no delete conditional on the time of the last write (an ETag does not tell a
        # rewrite of the same content-addressed bytes): the object's time is read just before,
        # which leaves a window of one request (docs/operations.md, "Housekeeping").
        client = await self._s3()
        full = self.prefix + _check_key(key)
        try:
            with self._translate(key):
                head = await client.head_object(Bucket=self.bucket, Key=full)
        except MissingObject:
            return False
        if written_before is not None and head["LastModified"].timestamp() >= written_before:
            return False
        with self._translate(key):
            await client.delete_object(Bucket=self.bucket, Key=full)
        return True


def store_from_url(
    url: str, env: Mapping[str, str] | None = None, *, setting: str = "workspace_store"
) -> WorkspaceStore:
    """The store a URL names: ``file:///path`` or a plain path (a directory), or
    ``s3://bucket/prefix`` (with the endpoint from ``TOREN_S3_ENDPOINT_URL`` or
    ``AWS_ENDPOINT_URL`` if set, for MinIO or R2). Raises ConfigError on anything else (the
    message names ``setting``, the setting the URL came from, and does not show the URL)."""
    env = os.environ if env is None else env
    noun = f"the {setting.replace('_', ' ')} URL"
    named = f"{noun} ({setting}; not shown)"
    if not url.strip():
        raise ConfigError(f"{noun} is empty", hint=_URL_HINT)
    parts = urllib.parse.urlsplit(url)
    if parts.username is not None or parts.password is not None:
        raise ConfigError(
            f"{noun} holds credentials, which are not accepted there",
            hint="give them as AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE",
        )
    if parts.scheme == "":
        return LocalStore(Path(url).expanduser().absolute())
    if parts.query or parts.fragment:
        raise ConfigError(f"{named} has an unexpected ?query or #fragment", hint=_URL_HINT)
    if parts.scheme == "file":
        path = urllib.parse.unquote(parts.path)
        if parts.netloc not in ("", "localhost") or not path.startswith("/"):
            raise ConfigError(f"{named} is a file:// URL with no local path", hint=_URL_HINT)
        return LocalStore(Path(path))
    if parts.scheme == "s3":
        if not _BUCKET.fullmatch(parts.netloc):
            raise ConfigError(
                f"the bucket in {named} is not a valid S3 bucket name",
                hint="3 to 63 lowercase letters, digits, dots and hyphens: s3://bucket/prefix",
            )
        var = "TOREN_S3_ENDPOINT_URL" if env.get("TOREN_S3_ENDPOINT_URL") else "AWS_ENDPOINT_URL"
        endpoint = env.get(var) or None
        if endpoint is not None:
            where = urllib.parse.urlsplit(endpoint)
            if where.scheme not in ("http", "https") or not where.hostname:
                raise ConfigError(
                    f"{var} must be an http:// or https:// URL (the value given is not shown)",
                    hint="the address of your S3-compatible server, e.g. http://minio:9000",
                )
        return S3Store(parts.netloc, parts.path, endpoint_url=endpoint)
    raise ConfigError(f"{named} has an unsupported scheme", hint=_URL_HINT)


ObjectStore = WorkspaceStore
"""The kernel's name for a store (sandboxes call it a workspace store)."""


@attrs.frozen(kw_only=True)
class StoredObject:
    """An object as a store lists it."""

    key: str
    size: int
    written_at: float  # Unix time of its last write (a put replacing it counts)


def _list_local(root: Path, prefix: str) -> list[StoredObject]:
    found = []
    # the directory the prefix is in (a prefix "blobs/ab" lists blobs/ for names starting "ab")
    base = root / prefix.rpartition("/")[0] if "/" in prefix else root
    if not base.is_dir():
        return []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith("."):  # temporary files of a write under way, trash of a delete
                continue
            path = Path(dirpath, name)
            key = path.relative_to(root).as_posix()
            if not key.startswith(prefix):
                continue
            try:
                st = path.stat()
            except FileNotFoundError:  # deleted meanwhile
                continue
            found.append(StoredObject(key=key, size=st.st_size, written_at=st.st_mtime))
    return found


def _delete_local(path: Path, written_before: float | None) -> bool:
    """Delete ``path`` unless it was written at or after ``written_before``; a write racing the
    delete is never lost: the file is first moved aside (a put replaces the key's name, not the
    file moved), then its time is checked, and a file written since is put back."""
    try:
        if written_before is not None and path.stat().st_mtime >= written_before:
            return False
        aside = path.with_name(f".trash-{os.getpid()}-{secrets.token_hex(6)}")
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    if written_before is not None and aside.stat().st_mtime >= written_before:
        # written again between the check and the move: back under its name, unless a newer
        # write is there already (the same content: keys of a store are written once)
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
        os.unlink(aside)
        return False
    os.unlink(aside)
    return True
