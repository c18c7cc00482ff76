"""The sidecar's Unix socket files: the worker socket and a ``unix:`` gRPC listen address.

Both are made the same way: their directory made if missing (and removed again if it was
made and is left empty), a socket file left by a killed sidecar replaced, one a live
process still serves refused with its pid (as a taken port is refused), and the file's
mode set before anyone can connect.

Nobody else may be able to take a socket's name: every directory on its way must be the
sidecar user's or root's, and not writable by others unless sticky (``/tmp``), where the
name itself must be unclaimed (``check_directories``). Otherwise another user could rename
the socket away after start and listen in its place, and each client would send it its
token (issue 42, attack 6). Clients check the serving user too (``wire/ipc.check_server``).
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import pwd
import socket
import stat

from sidecar._src.core import env as env_lib
from sidecar._src.wire import ipc

# How long a connection to an existing socket file may take to say it is live.
_PROBE_S = 1.0


def _user(uid: int) -> str:
  try:
    return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
  except KeyError:
    return f"uid {uid}"


def _on_the_way(path: str) -> list[str]:
  """The existing directories a client's path to socket ``path`` passes, as written and
  as resolved (a symbolic link's own directory counts), nearest last."""
  seen: list[str] = []
  for start in (os.path.abspath(path), os.path.realpath(path)):
    d = os.path.dirname(start)
    chain = []
    while True:
      chain.append(d)
      if os.path.dirname(d) == d:
        break
      d = os.path.dirname(d)
    seen += [d for d in reversed(chain) if d not in seen and os.path.isdir(d)]
  return seen


def _others_in_group(gid: int, owner: int) -> bool:
  """Whether group ``gid`` may hold a user other than ``owner`` (its members, and users
  whose primary group it is); an unknown group may."""
  try:
    members = set(grp.getgrgid(gid).gr_mem)
  except KeyError:
    return True
  members |= {u.pw_name for u in pwd.getpwall() if u.pw_gid == gid}
  try:
    members.discard(pwd.getpwuid(owner).pw_name)
  except KeyError:
    pass
  return bool(members)


def _shared(directory: str) -> bool:
  """Whether the operator vouches for ``directory`` though others may write it
  (``$SIDECAR_SHARED_SOCKET_DIR``: a pod's emptyDir, which only its containers see)."""
  vouched = env_lib.get(env_lib.SHARED_SOCKET_DIR)
  return vouched is not None and os.path.realpath(vouched) == os.path.realpath(directory)


def check_directories(path: str, *, what: str, flag: str) -> None:
  """Refuses a socket at ``path`` whose name another user could take: a directory on its
  way (``_on_the_way``) that belongs to another user than the sidecar's or root, or that
  others may write (any user, or a group holding other users) and is not sticky; in a
  sticky one others may write (``/tmp``), a socket of another user already at ``path``.

  Raises:
    PermissionError: naming the directory, its owner and mode, and the fix.
  """
  me = os.geteuid()
  for d in _on_the_way(path):
    info = os.stat(d)
    mode = info.st_mode & 0o7777
    if info.st_uid not in (me, 0):
      why = (f"belongs to {_user(info.st_uid)}, not to this sidecar's user ({_user(me)})"
             + (" or root" if me else ""))
      fix = f"as root: chown {me} {d}; chmod o-w {d}"
    elif mode & stat.S_IWOTH and not mode & stat.S_ISVTX and not _shared(d):
      why = "may be written by any user and is not sticky"
      fix = (f"chmod o-w {d} (or o-w,+t); for a Kubernetes emptyDir, which only the pod's "
             f"containers see, set {env_lib.SHARED_SOCKET_DIR}={d} instead")
    elif (mode & stat.S_IWGRP and not mode & stat.S_ISVTX and not _shared(d)
          and _others_in_group(info.st_gid, info.st_uid)):
      why = f"may be written by group {info.st_gid}, which holds other users, and is not sticky"
      fix = (f"chmod g-w {d} (or +t); for a Kubernetes emptyDir set "
             f"{env_lib.SHARED_SOCKET_DIR}={d} instead")
    else:
      continue
    raise OSError(errno.EACCES, (
        f"refusing to make the {what} {path}: the directory {d} (owner {_user(info.st_uid)}, "
        f"mode {mode:04o}) {why}: another user could rename the socket away and listen in "
        f"its place, and clients would send it their token. Give {flag} a path in a "
        f"directory of this sidecar's user that others may not write (mkdir -m 0700 DIR), "
        f"or {fix}"))
  try:
    info = os.lstat(path)
  except FileNotFoundError:
    return
  if stat.S_ISSOCK(info.st_mode) and info.st_uid != me:
    d = os.path.dirname(os.path.abspath(path))
    raise OSError(errno.EACCES, (
        f"refusing to make the {what} {path}: a socket of another user ({_user(info.st_uid)}) "
        f"already has its name in {d} (mode {os.stat(d).st_mode & 0o7777:04o}); it may be "
        f"an impostor waiting for clients. Remove it (as root), or give {flag} a path in a "
        f"directory of this sidecar's user (mkdir -m 0700 DIR)"))


def claim(path: str, *, what: str, flag: str) -> None:
  """Makes way for a new socket at ``path``: removes one nobody serves (left by a killed
  sidecar), refuses one a live process serves.

  Raises:
    OSError: EADDRINUSE naming the live process's pid and ``flag``; EEXIST where ``path``
      is something else than a socket (never removed: it is not ours); EACCES where
      another user could take its name (``check_directories``).
  """
  check_directories(path, what=what, flag=flag)  # again: a directory made since preflight
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
    pid = getattr(ipc.ucred_or_none(probe), "pid", "?")
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
  try:  # never writable by group or others, whatever the umask (check_directories)
    for d in reversed(made):
      with contextlib.suppress(FileExistsError):
        os.mkdir(d)
        os.chmod(d, stat.S_IMODE(os.stat(d).st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
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
