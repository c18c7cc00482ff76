"""Names, not paths: what a client may call a file, and opening it beneath its directory.

A client never names a file the sidecar opens. Leaf keys (an Orbax leaf's
``param_name`` becomes its array's directory), DCP plan entries (the file an item lies
in) and the like are *names*: relative, no ``.``/``..``/empty component, no NUL, not
absolute, of bounded length (:func:`check_name`, called where they enter: ``wire/`` and
each format's engine again). Every path the sidecar opens is the directory it opened
and checked (``server/checkpoint/roots.py``) joined with such a name, and is opened
relative to that directory's descriptor, one component at a time, never following a
symlink (:func:`open_beneath`): a directory swapped for a symlink later cannot redirect
a write or a read. Where a library opens the path itself (TensorStore), the path is
resolved and checked to lie beneath the directory first (:func:`check_beneath`).
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

from sidecar._src.core import errors

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
  if not real.startswith(real_base.rstrip(os.sep) + os.sep):
    raise errors.PermissionDeniedError(
        f"{field} {os.fspath(path)!r:.200} resolves to {real!r:.200}, outside its checkpoint "
        f"directory {real_base!r:.200}; a save or read stays inside the directory it opened "
        "(remove the symlink that leads out)")
  return pathlib.Path(path)


def open_beneath(base: os.PathLike | str, name: str, flags: int, mode: int = 0o644, *,
                 make_dirs: bool = False, field: str = "name") -> int:
  """A descriptor of ``base``/``name`` (``name`` checked by :func:`check_name`), opened
  relative to ``base``'s descriptor one component at a time with ``O_NOFOLLOW``: no
  symlink below ``base`` (the directory the server resolved) is followed (ELOOP or
  ENOTDIR: an OSError naming the path). ``make_dirs``: the directories on the way are
  made (0o755) where missing."""
  check_name(name, field)
  parts = name.split("/")
  # ``base`` itself is the directory the server resolved and checked: opened as named.
  fd = os.open(base, _DIR_FLAGS & ~os.O_NOFOLLOW)
  try:
    for part in parts[:-1]:
      if make_dirs:
        try:
          os.mkdir(part, 0o755, dir_fd=fd)
        except FileExistsError:
          pass
      try:
        nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
      except OSError as e:
        raise OSError(e.errno, e.strerror, os.path.join(os.fspath(base), name)) from None
      os.close(fd)
      fd = nxt
    try:
      return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
    except OSError as e:
      raise OSError(e.errno, e.strerror, os.path.join(os.fspath(base), name)) from None
  finally:
    os.close(fd)
