"""Workspace stores: where sandbox checkpoints (:mod:`toren.sandboxes.checkpoints`) live.

The stores are the kernel's object stores (:mod:`toren._core.stores`), named here as sandboxes
have always imported them.
"""

from toren._core.stores import (
    CorruptObject,
    LocalStore,
    MissingObject,
    S3Store,
    StoredObject,
    StoreError,
    StoreUnavailable,
    WorkspaceStore,
    store_from_url,
)

__all__ = [
    "CorruptObject",
    "LocalStore",
    "MissingObject",
    "S3Store",
    "StoreError",
    "StoreUnavailable",
    "StoredObject",
    "WorkspaceStore",
    "store_from_url",
]
