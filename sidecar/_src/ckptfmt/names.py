"""Names, not paths: what a client may call a file, and opening it beneath its directory.

A client never names a file the sidecar opens. Leaf keys (an Orbax leaf's
``param_name`` becomes its array's directory), DCP plan entries (the file an item lies
in) and the like are *names*: relative, no ``.``/``..``/empty component, no NUL, not
absolute, of bounded length (:func:`check_name`, called where they enter: ``wire/`` and
each format's engine again). Every path the sidecar opens is the directory it opened
and checked (``server/checkpoint/roots.py``) joined with such a name, and is opened
relative to that directory's descriptor, one component at a time, never following a
symlink (:func:`open_beneath`): a directory swapped for a symlink later cannot redirect
a write or a read. The directory itself is reached from ``/`` the same way: a symlink on
its path is followed only where nobody but the sidecar's user or root could have put it
there or swap it (:func:`open_dir`). Where a library opens the path itself (TensorStore),
it is handed a path through a directory already opened, in a tree nobody else can change
(``pinned.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import pathlib
import stat
import sys
from typing import Any

from sidecar._src.core import errors, paths

MAX_NAME = 4096  # bytes of a whole name (PATH_MAX)
MAX_COMPONENT = 255  # bytes of one component (NAME_MAX)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def check_name(value: Any, field: str, *, fix: str = "name it relative to its directory") -> str:
  """``value`` if it is a name (see the module's docstring), else InvalidArgumentError
  naming ``field``, the value and ``fix``."""
  why = _why_not(value)
  if why is not None:
    raise errors.InvalidArgumentError(
        f"{field} must be a name relative to its checkpoint directory ({why}), got "
        f"{value!r:.200}; {fix}")
  return value


def _why_not(value: Any) -> str | None:
  if not isinstance(value, str) or not value:
    return "a non-empty string"
  if "\0" in value:
    return "no NUL"
  if len(value.encode("utf-8", "surrogatepass")) > MAX_NAME:
    return f"at most {MAX_NAME} bytes"
  if value.startswith("/"):
    return "not an absolute path"
  for part in value.split("/"):
    if part in ("", ".", ".."):
      return "no empty, '.' or '..' component"
    if len(part.encode("utf-8", "surrogatepass")) > MAX_COMPONENT:
      return f"each component at most {MAX_COMPONENT} bytes"
  return None


def check_beneath(base: os.PathLike | str, path: os.PathLike | str, field: str) -> pathlib.Path:
  """``path`` if, resolved (symlinks, ``..``), it lies strictly beneath ``base`` resolved;
  else PermissionDeniedError naming ``field``. For paths a library opens by name."""
  real_base, real = os.path.realpath(base), os.path.realpath(path)
  if not paths.beneath(real, real_base):
    raise errors.PermissionDeniedError(
        f"{field} {os.fspath(path)!r:.200} resolves to {real!r:.200}, outside its checkpoint "
        f"directory {real_base!r:.200}; a save or read stays inside the directory it opened "
        "(remove the symlink that leads out)")
  return pathlib.Path(path)


def open_beneath(base: os.PathLike | str, name: str, flags: int, mode: int = 0o644, *,
                 make_dirs: bool = False, field: str = "name") -> int:
  """A descriptor of ``base``/``name`` (``name`` checked by :func:`check_name`), opened
  relative to ``base``'s descriptor (:func:`open_dir`) one component at a time with
  ``O_NOFOLLOW``: no symlink below ``base`` is followed (ELOOP or ENOTDIR: an OSError
  naming the path). ``make_dirs``: the directories on the way are made (0o755) where
  missing."""
  check_name(name, field)
  fd = open_dir(base)
  try:
    return open_at(fd, name, flags, mode, make_dirs=make_dirs, field=field,
                   shown=os.fspath(base))
  finally:
    os.close(fd)


def open_at(dir_fd: int, name: str, flags: int, mode: int = 0o644, *,
            make_dirs: bool = False, field: str = "name", shown: str = "") -> int:
  """:func:`open_beneath` relative to the directory descriptor ``dir_fd`` (the directory
  already opened, so nothing above it is resolved again); ``shown``: its path, for
  errors."""
  check_name(name, field)
  full = os.path.join(shown, name)
  if not make_dirs:  # one call where the kernel resolves beneath itself (openat2)
    opened = _openat2(dir_fd, name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                      _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS, full)
    if opened is not None:
      return opened
  fd = os.dup(dir_fd)
  try:
    for part in name.split("/")[:-1]:
      if make_dirs:
        with contextlib.suppress(FileExistsError):
          os.mkdir(part, 0o755, dir_fd=fd)
      nxt = _open_at(fd, part, _DIR_FLAGS, 0, full)
      os.close(fd)
      fd = nxt
    return _open_at(fd, name.rsplit("/", 1)[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                    full)
  finally:
    os.close(fd)


def open_dir(path: os.PathLike | str) -> int:
  """A descriptor of the directory ``path``, reached from ``/`` one component at a time
  with ``O_NOFOLLOW``, not by its name: a component swapped for a symlink between a check
  of the path and this open is not followed.

  A symlink on the way is followed only where it is trusted: its own owner is root or
  this process's user, and so is its directory's, which nobody else may write (sticky
  ``/tmp`` aside, where only the link's owner may replace it): nobody else could have
  planted or swapped it. Where the kernel has ``openat2``, a path with no symlink at all
  is one call (``RESOLVE_NO_SYMLINKS``).

  Raises:
    OSError: a component is missing or no directory (naming ``path``).
    PermissionDeniedError: a symlink on the way that someone else could have put there,
      naming it, its owner, its directory's owner and mode, and the fix.
  """
  path = os.path.abspath(os.fspath(path))
  fast = _openat2(_AT_FDCWD, path, _DIR_FLAGS, 0, _RESOLVE_NO_SYMLINKS, path, quiet=True)
  if fast is not None:
    return fast
  todo = [p for p in path.split("/") if p]
  fd, where, hops = os.open("/", _DIR_FLAGS), "/", 0
  try:
    while todo:
      part = todo.pop(0)
      if part == ".":
        continue
      try:
        nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
      except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR) or not stat.S_ISLNK(
            os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
          raise OSError(e.errno, e.strerror, path) from None
        hops += 1
        if hops > _MAX_HOPS:
          raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path) from None
        _check_link(fd, part, os.path.join(where, part), path)
        target = os.readlink(part, dir_fd=fd)
        todo[:0] = [p for p in target.split("/") if p]
        if target.startswith("/"):
          nxt, where = os.open("/", _DIR_FLAGS), "/"
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


def _check_link(dir_fd: int, name: str, link: str, path: str) -> None:
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
      f"refusing to follow the symlink {link!r:.200} on the way to the checkpoint directory "
      f"{path!r:.200}: it belongs to uid {owner}, in a directory of uid {d.st_uid} with mode "
      f"{stat.S_IMODE(d.st_mode):04o}, so someone other than this sidecar's user (uid "
      f"{os.geteuid()}) or root could have put it there or swap it later; name the directory "
      "by its resolved path, or keep the symlink in a directory only this user or root may "
      "write")


def _open_at(dir_fd: int, name: str, flags: int, mode: int, full: str) -> int:
  try:
    return os.open(name, flags, mode, dir_fd=dir_fd)
  except OSError as e:
    raise OSError(e.errno, e.strerror, full) from None


class _OpenHow(ctypes.Structure):
  _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
              ("resolve", ctypes.c_uint64)]


_AT_FDCWD = -100
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_SYS_OPENAT2 = 437  # the same number on every Linux architecture (since 5.6)
_MAX_HOPS = 40  # symlinks followed on one path, as the kernel's MAXSYMLINKS
_libc: list[Any] = []  # [libc], or [None] where openat2 cannot be called


def _openat2(dir_fd: int, name: str, flags: int, mode: int, resolve: int, full: str, *,
             quiet: bool = False) -> int | None:
  """``openat2(dir_fd, name, flags, mode, resolve)``; None where the kernel (or a seccomp
  filter) has no openat2, or, ``quiet``, where it refused (ELOOP, ENOTDIR...): the caller
  then walks component by component. Else an OSError naming ``full``."""
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
  if quiet or err in (errno.EINVAL, errno.E2BIG):
    return None
  raise OSError(err, os.strerror(err), full)
