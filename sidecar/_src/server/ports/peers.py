"""Connections by peer, bounded per peer and in total, and who gives way to a new one.

A port that anyone may reach is held by nobody: a new connection always gets in, unless
every connection is a different peer's (``total`` peers, each with one). Its room comes,
in this order, from

1. its own peer's oldest, where that peer holds ``per_peer`` already (a flood evicts its
   own connections first);
2. the oldest of the peer that holds the most, where the port holds ``total`` and that
   peer holds more than the new one's would (a flood from a few peers gives way to
   anyone else);
3. its own peer's oldest, where it holds any;

else it is refused (``Full``). The same rule as the handshake sessions'
(``limits.Sessions``), for connections: the health port's (``health_port.py``) and the
worker socket's connections that have not said their first frame (a peer there is a Unix
user: ``workers/workers.py``).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Bounds:
  """At most ``per_peer`` connections of one peer, ``total`` in all."""
  per_peer: int
  total: int

  def __post_init__(self):
    if not 1 <= self.per_peer <= self.total:
      raise ValueError(f"bounds need 1 <= per_peer <= total, got per_peer={self.per_peer!r} "
                       f"and total={self.total!r}")


class Full(Exception):
  """Every connection is held by a different peer (``total`` of them): the new one is
  refused."""


class PeerTable:
  """The open connections (any hashable key) of each peer (an address, a uid), oldest
  first. Not thread-safe: its owner calls it from one thread, or under its own lock."""

  def __init__(self, bounds: Bounds):
    self.bounds = bounds
    self._by_peer: dict[Hashable, collections.OrderedDict[Hashable, None]] = {}
    self._count = 0

  def __len__(self) -> int:
    return self._count

  def held(self, peer: Hashable) -> int:
    """How many connections ``peer`` holds."""
    return len(self._by_peer.get(peer, ()))

  def add(self, peer: Hashable, key: Hashable) -> list[Hashable]:
    """Counts the new connection ``key`` of ``peer``; returns the connections that give way
    to it (forgotten here: the caller closes them).

    Raises:
      Full: no connection gives way (every one is another peer's only one); ``key`` is not
        counted, and the caller closes it.
    """
    out: list[Hashable] = []
    if self.held(peer) >= self.bounds.per_peer:
      out.append(self._drop_oldest(peer))
    if self._count >= self.bounds.total:
      out.append(self.make_room(peer))
    self._by_peer.setdefault(peer, collections.OrderedDict())[key] = None
    self._count += 1
    return out

  def make_room(self, peer: Hashable) -> Hashable:
    """Forgets the connection that gives way to a new one of ``peer`` where the port is
    full (rules 2 and 3 above), and returns it.

    Raises:
      Full: none gives way.
    """
    most = max(self._by_peer, key=self.held, default=None)
    if most is not None and self.held(most) > self.held(peer) + 1:
      return self._drop_oldest(most)
    if self.held(peer):
      return self._drop_oldest(peer)
    raise Full(f"{self._count} connections are held, each by a different peer")

  def remove(self, peer: Hashable, key: Hashable) -> bool:
    """Forgets connection ``key`` of ``peer`` (closed); whether it was counted."""
    mine = self._by_peer.get(peer)
    if mine is None or key not in mine:
      return False
    del mine[key]
    if not mine:
      del self._by_peer[peer]
    self._count -= 1
    return True

  def _drop_oldest(self, peer: Hashable) -> Hashable:
    key = next(iter(self._by_peer[peer]))
    self.remove(peer, key)
    return key
