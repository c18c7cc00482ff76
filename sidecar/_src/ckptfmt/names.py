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
import os
import pathlib
from typing import Any

from sidecar._src.core import beneath, errors, paths

MAX_NAME = 4096  # bytes of a whole name (PATH_MAX)
MAX_COMPONENT = 255  # bytes of one component (NAME_MAX)
_DIR_FLAGS = beneath.DIR_FLAGS
_RESOLVE_NO_SYMLINKS = beneath.RESOLVE_NO_SYMLINKS
_RESOLVE_BENEATH = beneath.RESOLVE_BENEATH
_libc = beneath._libc  # one list: [None] there is a kernel without openat2 here too
_openat2 = beneath.openat2


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
  """A descriptor of the directory ``path``, reached from ``/`` with no untrusted symlink
  followed (``core/beneath.open_dir``, whose errors it raises)."""
  return beneath.open_dir(path, what="checkpoint directory")


def _open_at(dir_fd: int, name: str, flags: int, mode: int, full: str) -> int:
  try:
    return os.open(name, flags, mode, dir_fd=dir_fd)
  except OSError as e:
    raise OSError(e.errno, e.strerror, full) from None

