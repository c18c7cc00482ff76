"""The checks on what a checkpoint call names: paths under the roots, steps, and owners.

Every path a checkpoint call names must lie under one of the checkpoint roots.

A path is resolved (symlinks, ``..``) before the check; a sidecar started without any
root (``sidecar serve --checkpoint-root DIR``) refuses them all
(``PermissionDeniedError``). What a step operation then renames or removes it reaches
through the directory it acts in, opened once from its root with no symlink followed
(:meth:`Roots.open`, ``ckptfmt/dir_fd.py``), never through the path string again.
``delete`` and ``abort`` remove only directories a checkpoint wrote. What a checkpoint's
directories look like is its format's: this module asks the format registry
(``ckptfmt/registry.py``) and names no format.

**Owners on disk.** Where each client (a pool's tenant, or a ``--client-tokens`` client)
has checkpoints of its own, the first open of a directory records its owner in it
(:data:`OWNER_FILE`, the tenant's name, written by the sidecar): a restart keeps it, and
another client's open of the directory, of one inside it, or of one that holds it is
refused (:func:`foreign_owner`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import pathlib
import secrets
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np

from sidecar._src.ckptfmt import dir_fd, registry as formats_lib
from sidecar._src.core import env as env_lib, errors, paths

ROOTS_FLAG = "--checkpoint-root"
ROOTS_ENV = env_lib.CHECKPOINT_ROOTS

OWNER_FILE = ".sidecar-owner"  # in a checkpoint directory: the client that owns it
_OWNER_MAX = 4096  # bytes of an owner file read: a tenant's name
# The paths resolved in the request running on this thread (:func:`one_resolution`), or None.
_RESOLVED: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "sidecar_resolved_paths", default=None)
F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def one_resolution() -> Iterator[None]:
  """Within the block (a request, on its thread), :meth:`Roots.resolve` resolves each
  path once: it looks up a path it resolved already, and resolves one a part or two below
  a directory it resolved (``d/name``, ``d/step/item``, no ``.`` or ``..``) by one ``lstat``
  of each of those parts, not of every part from ``/``. So a request's checks (the
  service's, of every path field against the client's directories) and its acts see one
  resolution of each path: a directory swapped for a symlink between them cannot make the
  act resolve to another tenant's directory (issue 76, attack 1; the act then reaches it
  from the root with no symlink followed: :meth:`Roots.open`). A block inside another
  shares the outer one's. Nothing is kept from request to request.

  A Stage that begins its step resolves its directory, the step's tmp directories and its
  final one, all below that directory: five paths of seven parts here, 0.05-0.12 ms each
  on this 2-core machine, of a round trip of about 2 ms (issue 69)."""
  if _RESOLVED.get() is not None:
    yield
    return
  token = _RESOLVED.set({})
  try:
    yield
  finally:
    _RESOLVED.reset(token)


def resolved_once(fn: F) -> F:
  """Runs ``fn`` (a call's handler) inside :func:`one_resolution` (a decorator)."""
  @functools.wraps(fn)
  def wrapper(*args: Any, **kwargs: Any) -> Any:
    with one_resolution():
      return fn(*args, **kwargs)
  return wrapper  # type: ignore[return-value]


def _realpath(path: str) -> str:
  """``os.path.realpath(path)``, once per :func:`one_resolution` block (outside one: always)."""
  memo = _RESOLVED.get()
  if memo is None:
    return os.path.realpath(path)
  found = memo.get(path)
  if found is None:
    found = memo[path] = _below_resolved(path, memo) or os.path.realpath(path)
  return found


def _below_resolved(path: str, memo: dict[str, str], parts: int = 2) -> str | None:
  """``path`` resolved, where it lies at most ``parts`` parts below a directory in
  ``memo`` (resolved) and none of those parts is a symlink (``realpath`` lstats each part
  and keeps one that is none as it is); else None."""
  rest, head = [], path
  while len(rest) < parts:
    head, tail = os.path.split(head)
    if tail in ("", ".", ".."):
      return None
    rest.append(tail)
    base = memo.get(head)
    if base is not None:
      for part in reversed(rest):
        base = os.path.join(base, part)
        if os.path.islink(base):
          return None
      return base
  return None


def owner_of(path: str) -> str | None:
  """The owner recorded in the directory ``path`` (its :data:`OWNER_FILE`), or None.

  A marker that is not a plain file (a symlink, say) is someone's too: it reads as its
  link text, which names no tenant, so no tenant opens the directory. A directory that
  is gone, or is no directory now (removed or replaced since a walk listed it), has none."""
  return _owner_in(None, path)


def _owner_in(held: int | None, path: str) -> str | None:
  """:func:`owner_of` of the directory ``path``, or of the one open at ``held`` (then
  ``path`` only names it)."""
  try:
    fd = (os.open(OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=held)
          if held is not None else
          os.open(os.path.join(path, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC))
  except (FileNotFoundError, NotADirectoryError):
    return None
  except OSError as e:  # ELOOP: a symlink where the marker goes
    return f"<unreadable owner file: {e.strerror}>"
  try:
    return os.read(fd, _OWNER_MAX).decode("utf-8", "replace").strip()
  finally:
    os.close(fd)


def claim(path: str, owner: str, *, at: dir_fd.DirFd | None = None) -> str:
  """Records ``owner`` in the directory ``path`` unless an owner is recorded there
  already; returns the owner recorded (``owner``, or the one there before). ``at``: the
  directory ``path``, opened (the sidecar's, from its root): the marker is written through
  it, never through the path again.

  The marker appears whole or not at all (written under a name of its own, then linked
  into place, which fails where one is there): two sidecars on one storage claiming the
  same directory at once never read each other's half-written file."""
  held = (os.dup(at.fd) if at is not None else
            os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC))
  staged = f"{OWNER_FILE}.{secrets.token_hex(8)}"
  try:
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644, dir_fd=held)
    try:
      os.write(fd, owner.encode() + b"\n")
      os.fsync(fd)
    finally:
      os.close(fd)
    try:
      os.link(staged, OWNER_FILE, src_dir_fd=held, dst_dir_fd=held)
    except FileExistsError:
      return _owner_in(held, path) or ""
    finally:
      os.unlink(staged, dir_fd=held)
    os.fsync(held)
  finally:
    os.close(held)
  return owner


def foreign_owner(resolved: str, root: str, owner: str,
                  formats: formats_lib.Registry = formats_lib.DEFAULT) -> tuple[str, str] | None:
  """Where another owner than ``owner`` is recorded at, above (up to ``root``) or below
  the directory ``resolved``: ``(directory, its owner)``, or None.

  Below, the walk follows no symlink and enters no save's scratch directory nor committed
  step (no owner is recorded inside one), as ``formats`` know them."""
  scratch = formats.scratch_suffixes()
  up = resolved
  while True:
    found = owner_of(up)
    if found is not None and found != owner:
      return up, found
    if up == root or os.path.dirname(up) == up:
      break
    up = os.path.dirname(up)
  stack = [resolved]
  while stack:
    try:
      entries = os.scandir(stack.pop())
    except OSError:
      continue
    with entries:
      for entry in entries:
        try:
          if not entry.is_dir(follow_symlinks=False) or entry.name.endswith(scratch):
            continue
        except OSError:
          continue
        found = owner_of(entry.path)
        if found is not None and found != owner:
          return entry.path, found
        if not (entry.name.isdigit() and formats.is_checkpoint(pathlib.Path(entry.path))):
          stack.append(entry.path)
  return None


def as_int(value: Any, name: str) -> int:
  """``value`` if it is an int (not a bool), else InvalidArgumentError naming ``name``."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise errors.InvalidArgumentError(f"{name} must be an int, got {value!r:.100}")
  return int(value)


def has_markers(path: pathlib.Path,
                formats: formats_lib.Registry = formats_lib.DEFAULT) -> bool:
  """Whether ``path`` itself is a committed step or item: a format's markers lie in it
  (``Registry.has_markers``)."""
  return formats.has_markers(path)


class Roots:
  """The checkpoint roots of one sidecar (``host_id``, named in its refusals)."""

  def __init__(self, host_id: int, roots: tuple[str, ...] = ()):
    self._host_id = host_id
    self._roots = tuple(os.path.realpath(r) for r in roots)

  def root_of(self, resolved: str) -> str | None:
    """The root ``resolved`` (a resolved path) lies under, or None."""
    return next((r for r in self._roots if paths.inside(resolved, r)), None)

  def resolve(self, path: Any, name: str) -> str:
    """``path`` resolved (symlinks, ``..``), if it lies under a checkpoint root.

    Raises InvalidArgumentError for a non-string and PermissionDeniedError for a path
    outside every root, or for any path where the sidecar has no roots.
    """
    if not isinstance(path, str) or not path or "\0" in path:
      raise errors.InvalidArgumentError(f"{name} must be a directory path, got {path!r:.100}")
    if not self._roots:
      raise errors.PermissionDeniedError(
          f"sidecar host {self._host_id} has no checkpoint root, so it refuses checkpoint "
          f"calls ({name} {path!r:.200}); start it with {ROOTS_FLAG} DIR (repeatable, or "
          f"{ROOTS_ENV}) naming the directory the checkpoints go to")
    try:
      resolved = _realpath(path)
    except OSError as e:  # EINVAL: a symlink on the way was swapped for a directory meanwhile
      raise errors.PermissionDeniedError(
          f"{name} {path!r:.200} changed while sidecar host {self._host_id} resolved it "
          f"({e.strerror or e}): a symlink on the way was swapped in or out; checkpoint "
          "directories hold no symlinks: name the directory by its resolved path") from None
    if self.root_of(resolved) is None:
      raise errors.PermissionDeniedError(
          f"{name} {path!r:.200} (resolved: {resolved!r:.200}) is not under a checkpoint root "
          f"of sidecar host {self._host_id} ({', '.join(self._roots)}); checkpoint there, or "
          f"start the sidecar with {ROOTS_FLAG} naming its directory")
    return resolved

  def open(self, resolved: str, *, make: bool = False) -> dir_fd.DirFd:
    """The directory ``resolved`` (a path :meth:`resolve` answered), opened from the
    checkpoint root it lies under, one component at a time with no symlink followed
    (``DirFd.below``); ``make``: missing components made. A symlink met (swapped in since
    the path was resolved) is a PermissionDeniedError: a step operation acts only on what
    it opened.

    Raises:
      PermissionDeniedError: ``resolved`` lies under no root (a bug of the caller's: it
        resolves first), or a symlink is on the way.
      OSError: a component is missing (``make`` False) or no directory.
    """
    root = self.root_of(resolved)
    if root is None:
      raise errors.PermissionDeniedError(
          f"{resolved!r:.200} is not under a checkpoint root of sidecar host {self._host_id} "
          f"({', '.join(self._roots)})")
    return dir_fd.DirFd.below(root, resolved, make=make)
