"""Opening a path beneath a directory the sidecar opened, never outside it.

Two walks, both from descriptors, never by re-resolving a whole path a client could
change in between:

- :func:`open_dir`: a directory the sidecar itself was told of (a checkpoint root, a pool
  tenant's data root), reached from ``/`` one component at a time with ``O_NOFOLLOW``; a
  symlink on the way is followed only where nobody but this user or root could have put it
  there or swap it.
- :func:`open_within`: a path below such a directory (a tenant's data), symlinks and
  ``..`` included, resolved so that it never leaves the directory: the kernel's ``openat2``
  with ``RESOLVE_BENEATH`` where it has one, else one component at a time with
  ``O_NOFOLLOW``, each symlink read and walked on from the directory it lies in (an
  absolute one only where it names a path under the directory), ``..`` popping back to a
  directory already opened and never above the first. A symlink swapped in at any moment
  changes which entry beneath the directory is reached, never whether it is beneath.

``ckptfmt/names.py`` opens a client's names beneath a checkpoint directory with no symlink
at all; ``user/data_paths.py`` opens a pipeline's data beneath a tenant's data roots.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys
from typing import Any

from sidecar._src.core import errors

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
AT_FDCWD = -100
_SYS_OPENAT2 = 437  # the same number on every Linux architecture (since 5.6)
MAX_HOPS = 40  # symlinks followed on one path, as the kernel's MAXSYMLINKS
_libc: list[Any] = []  # [libc], or [None] where openat2 cannot be called


class _OpenHow(ctypes.Structure):
  _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
              ("resolve", ctypes.c_uint64)]


def openat2(dir_fd: int, name: str, flags: int, mode: int, resolve: int, full: str, *,
            quiet: bool = False, walk_on: tuple[int, ...] = ()) -> int | None:
  """``openat2(dir_fd, name, flags, mode, resolve)``; None where the kernel (or a seccomp
  filter) has no openat2, where it refused with an errno of ``walk_on``, or, ``quiet``,
  where it refused at all (ELOOP, ENOTDIR...): the caller then walks component by
  component. Else an OSError naming ``full``."""
  if not _libc:
    try:
      _libc.append(ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None)
    except OSError:
      _libc.append(None)
  libc = _libc[0]
  if libc is None:
    return None
  # The kernel refuses a mode without O_CREAT (EINVAL).
  how = _OpenHow(flags, mode if flags & (os.O_CREAT | os.O_TMPFILE) else 0, resolve)
  fd = libc.syscall(_SYS_OPENAT2, dir_fd, os.fsencode(name), ctypes.byref(how),
                    ctypes.sizeof(how))
  if fd >= 0:
    return fd
  err = ctypes.get_errno()
  if err in (errno.ENOSYS, errno.EPERM):  # no openat2 here (old kernel, seccomp): walk
    _libc[0] = None
    return None
  if quiet or err in (errno.EINVAL, errno.E2BIG, *walk_on):
    return None
  raise OSError(err, os.strerror(err), full)


def open_dir(path: os.PathLike | str, *, what: str = "checkpoint directory") -> int:
  """A descriptor of the directory ``path``, reached from ``/`` one component at a time
  with ``O_NOFOLLOW``, not by its name: a component swapped for a symlink between a check
  of the path and this open is not followed.

  A symlink on the way is followed only where it is trusted: its own owner is root or
  this process's user, and so is its directory's, which nobody else may write (sticky
  ``/tmp`` aside, where only the link's owner may replace it): nobody else could have
  planted or swapped it. Where the kernel has ``openat2``, a path with no symlink at all
  is one call (``RESOLVE_NO_SYMLINKS``). ``what`` names the directory in errors.

  Raises:
    OSError: a component is missing or no directory (naming ``path``).
    PermissionDeniedError: a symlink on the way that someone else could have put there,
      naming it, its owner, its directory's owner and mode, and the fix.
  """
  path = os.path.abspath(os.fspath(path))
  fast = openat2(AT_FDCWD, path, DIR_FLAGS, 0, RESOLVE_NO_SYMLINKS, path, quiet=True)
  if fast is not None:
    return fast
  todo = [p for p in path.split("/") if p]
  fd, where, hops = os.open("/", DIR_FLAGS), "/", 0
  try:
    while todo:
      part = todo.pop(0)
      if part == ".":
        continue
      try:
        nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
      except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR) or not stat.S_ISLNK(
            os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
          raise OSError(e.errno, e.strerror, path) from None
        hops += 1
        if hops > MAX_HOPS:
          raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path) from None
        _check_link(fd, part, os.path.join(where, part), path, what)
        target = os.readlink(part, dir_fd=fd)
        todo[:0] = [p for p in target.split("/") if p]
        if target.startswith("/"):
          nxt, where = os.open("/", DIR_FLAGS), "/"
        else:
          nxt = os.dup(fd)
      else:
        where = os.path.normpath(os.path.join(where, part))
      os.close(fd)
      fd = nxt
    return fd
  except BaseException:
    os.close(fd)
    raise


def _check_link(dir_fd: int, name: str, link: str, path: str, what: str) -> None:
  """PermissionDeniedError unless the symlink ``name`` in ``dir_fd`` is trusted (see
  :func:`open_dir`)."""
  mine = (0, os.geteuid())
  owner = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_uid
  d = os.fstat(dir_fd)
  others_write = d.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
  sticky = d.st_mode & stat.S_ISVTX
  if owner in mine and d.st_uid in mine and (not others_write or sticky):
    return
  raise errors.PermissionDeniedError(
      f"refusing to follow the symlink {link!r:.200} on the way to the {what} "
      f"{path!r:.200}: it belongs to uid {owner}, in a directory of uid {d.st_uid} with mode "
      f"{stat.S_IMODE(d.st_mode):04o}, so someone other than this sidecar's user (uid "
      f"{os.geteuid()}) or root could have put it there or swap it later; name the directory "
      "by its resolved path, or keep the symlink in a directory only this user or root may "
      "write")


def open_within(dir_fd: int, name: str, flags: int, *, top: str) -> int:
  """A descriptor of ``name`` (relative; symlinks and ``..`` allowed) resolved beneath the
  directory ``dir_fd`` (whose path is ``top``) and never outside it; see the module's
  docstring. ``flags`` are the last component's (``O_NOFOLLOW`` and ``O_CLOEXEC`` added).

  Raises:
    OSError: ENOENT or ENOTDIR (no such path beneath it), EXDEV (the path, or a symlink on
      it, leads out of the directory: refused before anything outside is looked up),
      ELOOP (more than ``MAX_HOPS`` symlinks), or what the last open met; naming the path.
  """
  full = os.path.join(top, name)
  flags |= os.O_CLOEXEC
  fast = openat2(dir_fd, name, flags, 0, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS, full,
                 walk_on=(errno.EXDEV, errno.ELOOP, errno.EAGAIN))
  if fast is not None:
    return fast
  # The walk: EXDEV above may be an absolute symlink that names a path under ``top``.
  stack = [os.dup(dir_fd)]  # the directories from ``top`` to here, each one opened
  todo = name.split("/")
  hops = 0
  try:
    while todo:
      part = todo.pop(0)
      if part in ("", "."):
        continue
      if part == "..":
        if len(stack) == 1:
          raise OSError(errno.EXDEV, "leads out of its directory by '..'", full)
        os.close(stack.pop())
        continue
      last = not any(p not in ("", ".") for p in todo)
      try:
        fd = os.open(part, (flags if last else DIR_FLAGS) | os.O_NOFOLLOW, dir_fd=stack[-1])
      except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
          raise OSError(e.errno, e.strerror, full) from None
        hops += 1
        if hops > MAX_HOPS:
          raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), full) from None
        try:
          target = os.readlink(part, dir_fd=stack[-1])
        except OSError as not_link:
          if not_link.errno == errno.EINVAL and e.errno == errno.ELOOP:
            todo.insert(0, part)  # a symlink at the open, swapped since: open it again
            continue
          raise OSError(e.errno if not_link.errno == errno.EINVAL else not_link.errno,
                        e.strerror, full) from None
        if target.startswith("/"):
          rest = _under(target, top)
          if rest is None:
            raise OSError(errno.EXDEV, "leads out of its directory by a symlink",
                          full) from None
          for extra in stack[1:]:
            os.close(extra)
          del stack[1:]
          todo[:0] = rest
        else:
          todo[:0] = target.split("/")
        continue
      if last:
        return fd
      stack.append(fd)
    return os.open(".", flags, dir_fd=stack[-1])  # ``name`` came back to a directory
  finally:
    for fd in stack:
      os.close(fd)


def _under(target: str, top: str) -> list[str] | None:
  """The components of the absolute path ``target`` below ``top`` (compared by components,
  as written: nothing is looked up), or None where it does not start with ``top``."""
  want = [p for p in top.split("/") if p not in ("", ".")]
  have = [p for p in target.split("/") if p not in ("", ".")]
  return have[len(want):] if have[:len(want)] == want else None
