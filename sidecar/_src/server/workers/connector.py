"""Who is at the other end of a worker connection: the process the kernel names.

A worker's pid is the kernel's: the socket's peer credentials (``SO_PEERCRED``: the
process that called ``connect()``), never the ``pid`` its attach message claims (issue
69). The claim is only checked (an impossible pid is refused: :func:`claimed_pid`) and
logged (:func:`claim_note`). The process is named by its pid *and its start*
(``core/procfs.py``), read as soon as the connection is accepted, before the client says
anything (:meth:`Connector.of`, in the accept loop): a pid names that process only while
it lives, and a process that connects and exits leaves a session whose pid the next
process may get. So a
session's pid is listed only while its own process lives (``goodput/steps.py``), whoever
holds the connection since (issue 76, attack 5). Where the kernel gives no pid (a trainer in
another PID namespace), the pid is 0: unverified.

The window left: between ``connect()`` and this read (microseconds, or the accept loop's
wait for a thread) the pid would have to be freed and given out again, a whole turn of the
pid counter.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sidecar._src.core import errors, procfs
from sidecar._src.wire import ipc


@dataclasses.dataclass(frozen=True, slots=True)
class Connector:
  """The process that connected, as the kernel says: ``pid`` 0 where it says none (then
  ``start`` is None); ``uid`` None where the socket is gone."""
  pid: int
  start: int | None
  uid: int | None

  @classmethod
  def of(cls, cred: ipc.Ucred | None) -> Connector:
    """The process of ``cred`` (the socket's ``SO_PEERCRED``, read as it was accepted)."""
    if cred is None:
      return cls(0, None, None)
    pid = cred.pid if 0 < cred.pid < ipc.PID_LIMIT else 0  # 0: another PID namespace's
    start = procfs.start(pid) if pid else None
    return cls(pid if start is not None else 0, start, cred.uid)


def claimed_pid(value: Any) -> int | None:
  """The pid an attach message claims, checked (None: it claims none). Only logged: the
  session's pid is the kernel's (:class:`Connector`).

  Raises:
    InvalidArgumentError: no process can have it (negative, 0, past any kernel's limit,
      not an int), naming the value.
  """
  if value is None:
    return None
  if isinstance(value, int) and not isinstance(value, bool) and 0 < value < ipc.PID_LIMIT:
    return value
  raise errors.InvalidArgumentError(
      f"attach: pid {value!r:.40} is no process's (a pid is an int from 1 to "
      f"{ipc.PID_LIMIT - 1}); the sidecar reads a worker's pid from the kernel and never acts "
      "on the one it claims: send os.getpid(), or no pid (sidecar's Worker sends its own)")


def claim_note(claimed: int | None, pid: int) -> str:
  """What the attach log line adds where the worker claimed another pid than the kernel's."""
  if claimed is None or claimed == pid:
    return ""
  if pid:
    return f" (it claimed pid {claimed}: another PID namespace's, or false; ignored)"
  return f" (it claimed pid {claimed}; the kernel gives none: another PID namespace)"


def small_int(value: Any) -> int:
  """An attach message's rank or restart: an int >= 0, else -1 (not given)."""
  ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31
  return value if ok else -1


def user(cred: ipc.Ucred | None) -> str:
  """Whose log lines a worker connection's are before it attaches: the Unix user the
  kernel names (``client_log.py``)."""
  return "a worker of an unknown user" if cred is None else f"the workers of uid {cred.uid}"
