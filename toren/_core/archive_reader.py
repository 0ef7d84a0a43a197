"""An archive store as readers of runs use it (the CLI, the API): opened at its first read."""

from __future__ import annotations

from typing import Any

from toren._core.journal import ArchiveReader, JournalEntry


class ArchivesAt:
    """The archive store at ``url`` (``archive_store``) as readers of runs use it: opened at
    its first read, so that a process that never needs archived events (nearly every read
    starts from a snapshot) never loads the object stores."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._reader: ArchiveReader | None = None

    async def read(self, ref: Any) -> list[JournalEntry]:
        """See :meth:`toren._core.truncation.Archives.read`."""
        if self._reader is None:
            from toren._core.stores import store_from_url
            from toren._core.truncation import Archives

            self._reader = Archives(store_from_url(self.url, setting="archive_store"))
        return await self._reader.read(ref)
