"""Who attaches to the worker socket: what its attach message claims (a pid, a rank, a
restart), checked and only logged, and what the kernel says (``SO_PEERCRED``), which is
what counts (issue 69): the session's pid, and, before it attached, whose log lines its
connection's are (``client_log``)."""

from __future__ import annotations

from typing import Any

from sidecar._src.core import errors
from sidecar._src.wire import ipc


def small_int(value: Any) -> int:
  """An attach message's rank or restart: an int >= 0, else -1 (not given)."""
  ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31
  return value if ok else -1


def claimed_pid(value: Any) -> int | None:
  """The pid an attach message claims, checked (None: it claims none). Only logged: the
  session's pid is the kernel's (:func:`verified_pid`).

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


def verified_pid(cred: ipc.Ucred | None) -> int:
  """The attaching process's pid as the kernel says (``SO_PEERCRED``), in this sidecar's
  PID namespace; 0 where it does not say (a process of another PID namespace)."""
  if cred is None or not 0 < cred.pid < ipc.PID_LIMIT:
    return 0
  return cred.pid


def user(cred: ipc.Ucred | None) -> str:
  """Whose log lines a worker connection's are before it attaches: the Unix user the
  kernel names (client_log.py)."""
  return "a worker of an unknown user" if cred is None else f"the workers of uid {cred.uid}"
