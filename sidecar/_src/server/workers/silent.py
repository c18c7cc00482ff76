"""Worker-socket connections that have not said their first frame yet, by Unix user.

Each holds a thread and a place among ``max_worker_connections`` for up to
``workers.FIRST_FRAME_S``, and needs no token to: a user who may open the socket (its
group, in a pool of several users) could keep every place with silent connections, opened
again as they are closed, and no worker of another user could attach (issue 76). So where
every place is taken, the user holding the most silent connections gives its oldest
(``ports/remotes``: the same rule as the health port's), and a new connection is refused only
where every place is an attached worker's, or a silent one of a user holding as few.
"""

from __future__ import annotations

import socket
import threading

from sidecar._src.server.ports import remotes
from sidecar._src.wire import ipc


class Silent:
  """The silent connections of a socket of ``limit`` places; thread-safe."""

  def __init__(self, limit: int):
    self._lock = threading.Lock()
    self._table = remotes.RemoteTable(remotes.Bounds(per_remote=limit, total=limit))

  def arrive(self, conn: socket.socket, cred: ipc.Ucred | None, *,
             full: bool) -> tuple[list[socket.socket], bool]:
    """Counts new connection ``conn`` of ``cred``'s user (``full``: every place is taken
    now). The connections that give way to it (the caller shuts them down), and whether
    ``conn`` is refused all the same (then not counted)."""
    uid = -1 if cred is None else cred.uid
    gone: list[socket.socket] = []
    with self._lock:
      if full:
        try:
          gone.append(self._table.make_room(uid))  # type: ignore[arg-type]  # our keys
        except remotes.Full:
          return gone, True
      gone += self._table.add(uid, conn)  # type: ignore[arg-type]  # our keys
    return gone, False

  def spoke(self, conn: socket.socket, cred: ipc.Ucred | None) -> None:
    """``conn`` said its first frame, or ended: silent no more (idempotent)."""
    with self._lock:
      self._table.remove(-1 if cred is None else cred.uid, conn)
