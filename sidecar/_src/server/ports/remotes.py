"""Connections by remote (the other end: a client's address, or a Unix user), bounded per
remote and in total, and who gives way to a new one.

A port that anyone may reach is held by nobody: a new connection always gets in, unless
every connection is a different remote's (``total`` remotes, each with one). Its room comes,
in this order, from

1. its own remote's oldest, where that remote holds ``per_remote`` already (a flood evicts its
   own connections first);
2. the oldest of the remote that holds the most, where the port holds ``total`` and that
   remote holds more than the new one's would (a flood from a few remotes gives way to
   anyone else);
3. its own remote's oldest, where it holds any;

else it is refused (``Full``). The same rule as the handshake sessions'
(``limits.Sessions``), for connections: the health port's (``health_port.py``) and the
worker socket's connections that have not said their first frame (a remote there is a Unix
user: ``workers/silent.py``).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Bounds:
  """At most ``per_remote`` connections of one remote, ``total`` in all."""
  per_remote: int
  total: int

  def __post_init__(self):
    if not 1 <= self.per_remote <= self.total:
      raise ValueError(f"bounds need 1 <= per_remote <= total, got per_remote={self.per_remote!r} "
                       f"and total={self.total!r}")


class Full(Exception):
  """Every connection is held by a different remote (``total`` of them): the new one is
  refused."""


class RemoteTable:
  """The open connections (any hashable key) of each remote (an address, a uid), oldest
  first. Not thread-safe: its owner calls it from one thread, or under its own lock."""

  def __init__(self, bounds: Bounds):
    self.bounds = bounds
    self._by_remote: dict[Hashable, collections.OrderedDict[Hashable, None]] = {}
    self._count = 0

  def __len__(self) -> int:
    return self._count

  def held(self, remote: Hashable) -> int:
    """How many connections ``remote`` holds."""
    return len(self._by_remote.get(remote, ()))

  def add(self, remote: Hashable, key: Hashable) -> list[Hashable]:
    """Counts the new connection ``key`` of ``remote``; returns the connections that give way
    to it (forgotten here: the caller closes them).

    Raises:
      Full: no connection gives way (every one is another remote's only one); ``key`` is not
        counted, and the caller closes it.
    """
    out: list[Hashable] = []
    if self.held(remote) >= self.bounds.per_remote:
      out.append(self._drop_oldest(remote))
    if self._count >= self.bounds.total:
      out.append(self.make_room(remote))
    self._by_remote.setdefault(remote, collections.OrderedDict())[key] = None
    self._count += 1
    return out

  def make_room(self, remote: Hashable) -> Hashable:
    """Forgets the connection that gives way to a new one of ``remote`` where the port is
    full (rules 2 and 3 above), and returns it.

    Raises:
      Full: none gives way.
    """
    most = max(self._by_remote, key=self.held, default=None)
    if most is not None and self.held(most) > self.held(remote) + 1:
      return self._drop_oldest(most)
    if self.held(remote):
      return self._drop_oldest(remote)
    raise Full(f"{self._count} connections are held, each by a different remote")

  def remove(self, remote: Hashable, key: Hashable) -> bool:
    """Forgets connection ``key`` of ``remote`` (closed); whether it was counted."""
    mine = self._by_remote.get(remote)
    if mine is None or key not in mine:
      return False
    del mine[key]
    if not mine:
      del self._by_remote[remote]
    self._count -= 1
    return True

  def _drop_oldest(self, remote: Hashable) -> Hashable:
    key = next(iter(self._by_remote[remote]))
    self.remove(remote, key)
    return key
