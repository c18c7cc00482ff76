"""The sidecar's Unix socket files: the worker socket and a ``unix:`` gRPC listen address.

Both are made the same way: their directory made if missing (and removed again if it was
made and is left empty), a socket file left by a killed sidecar replaced, one a live
process still serves refused with its pid (as a taken port is refused), and the file's
mode set before anyone can connect.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import socket
import stat
import struct

# How long a connection to an existing socket file may take to say it is live.
_PROBE_S = 1.0


def peer_pid(conn: socket.socket) -> int:
  """The pid of the process at the other end of a Unix socket connection (the one that
  listens, seen from a client), from SO_PEERCRED; 0 where unknown."""
  try:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
  except OSError:
    return 0
  return struct.unpack("3i", creds)[0]


def claim(path: str, *, what: str, flag: str) -> None:
  """Makes way for a new socket at ``path``: removes one nobody serves (left by a killed
  sidecar), refuses one a live process serves.

  Raises:
    OSError: EADDRINUSE naming the live process's pid and ``flag``; EEXIST where ``path``
      is something else than a socket (never removed: it is not ours).
  """
  try:
    info = os.lstat(path)
  except FileNotFoundError:
    return
  if not stat.S_ISSOCK(info.st_mode):
    raise OSError(errno.EEXIST, f"cannot make the {what} {path}: a file that is not a socket "
                  f"is there; remove it, or give {flag} another path")
  probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  probe.settimeout(_PROBE_S)
  try:
    probe.connect(path)
  except (ConnectionRefusedError, FileNotFoundError):
    with contextlib.suppress(FileNotFoundError):
      os.unlink(path)  # a socket file left by a killed sidecar: nobody listens on it
    return
  except PermissionError:
    raise OSError(errno.EACCES, f"cannot make the {what} {path}: a socket this process may "
                  f"not open is there (another user's sidecar?); give {flag} another "
                  "path") from None
  except OSError as e:  # a full backlog (timeout): someone listens
    raise OSError(errno.EADDRINUSE, f"cannot make the {what} {path}: a live process serves "
                  f"it ({e}); stop it, or give {flag} another path") from None
  else:
    pid = peer_pid(probe)
    raise OSError(errno.EADDRINUSE, f"cannot make the {what} {path}: a live process (pid "
                  f"{pid}, another sidecar?) serves it; stop it, or give {flag} another path")
  finally:
    probe.close()


@contextlib.contextmanager
def private_umask():
  """Files made inside get no permission for group or others: a socket bound inside is
  the owner's alone until ``restrict`` opens it to a group (no window where anyone may
  connect)."""
  old = os.umask(0o177)
  try:
    yield
  finally:
    os.umask(old)


def group_id(group: str) -> int:
  """The gid of ``group`` (a name or a number).

  Raises:
    OSError: no such group, naming it and the flag.
  """
  if group.strip().isdigit():
    return int(group)
  try:
    return grp.getgrnam(group.strip()).gr_gid
  except KeyError:
    raise OSError(errno.EINVAL, f"--socket-group {group}: no such group on this machine; "
                  "give a group name or gid that exists (see /etc/group)") from None


def restrict(path: str, *, mode: int, group: str | None = None) -> None:
  """Sets the socket file's ``mode`` and, with ``group``, its group (the group may then
  connect where ``mode`` lets it).

  Raises:
    OSError: the group cannot be set (this process is not in it), naming the flag.
  """
  if group is not None:
    gid = group_id(group)
    try:
      os.chown(path, -1, gid)
    except PermissionError:
      raise OSError(errno.EPERM, f"--socket-group {group}: cannot give {path} to group "
                    f"{gid}: this process (uid {os.getuid()}) is not in it; add the "
                    "sidecar's user to that group, or name one of its groups") from None
  os.chmod(path, mode)


def make_dirs(directory: str, *, what: str, flag: str) -> list[str]:
  """Makes ``directory`` and its missing parents; returns those it made, deepest first."""
  made = []
  d = directory
  while not os.path.isdir(d) and os.path.dirname(d) != d:
    made.append(d)
    d = os.path.dirname(d)
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as e:
    raise OSError(e.errno, f"cannot make the {what}'s directory {directory} "
                  f"({e.strerror}): give {flag} a path in a writable directory") from e
  return made


def remove_dirs(made: list[str]) -> None:
  """Removes the directories ``make_dirs`` made, deepest first, while they are empty."""
  for d in made:
    try:
      os.rmdir(d)
    except OSError:
      return  # Not empty (someone else's files) or gone: leave it and its parents.


def remove_if_same(path: str, inode: tuple[int, int] | None) -> None:
  """Removes the socket file at ``path`` if it is still the one made (``(st_dev, st_ino)``),
  not one a later sidecar made in its place."""
  with contextlib.suppress(OSError):
    info = os.lstat(path)
    if inode is not None and (info.st_dev, info.st_ino) == inode:
      os.unlink(path)


def inode_of(path: str) -> tuple[int, int] | None:
  with contextlib.suppress(OSError):
    info = os.lstat(path)
    return info.st_dev, info.st_ino
  return None
