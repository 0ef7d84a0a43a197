"""The agent directory, for the kinds' actors and the worker: what each live worker says about
the agents it runs, and whether a route is served (see :mod:`toren._agent.directory`).

Not part of the kernel: the cards carry agents' consent lists. ``toren.kernel`` exported the
directory's functions until issue 29; they are a worker's :class:`Directory`'s methods now.
"""

from toren._agent.directory import Card, Directory, directory_of

__all__ = ["Card", "Directory", "directory_of"]
