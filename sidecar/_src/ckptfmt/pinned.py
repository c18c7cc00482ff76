"""A checkpoint item's directory held open by its descriptor, and whether a library may
open files in it by path.

TensorStore opens a leaf's files by path and follows symlinks. A check of those paths
before its open leaves a window: a tenant who can write a directory on the way (his own
checkpoint directory on shared storage, say) swaps a step or flips a chunk file into a
symlink to another's file between the check and the open, and the sidecar reads that
file for him (issue 54, attack 4). So nothing is handed to TensorStore by a name a
tenant can change:

- the item directory is opened once (:func:`pin`, reached from ``/`` by
  ``names.open_dir``) and TensorStore is given paths through its descriptor,
  ``/proc/self/fd/N/<leaf>``, held open until its reads or writes are done: a rename of
  the step or of any directory above it changes nothing the descriptor reaches;
- below it, TensorStore is used only where every directory and file is a plain one,
  owned by this process's user or root and writable by neither group nor others
  (:func:`check_tree`, one walk from the descriptor): nobody else can add, swap or
  replace anything there after the walk.

Where the tree fails that rule (:attr:`Pinned.untrusted` says where and why), the
caller reads and writes only through no-symlink opens beneath the descriptor
(:meth:`Pinned.open`), or refuses (:meth:`Pinned.refusal`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import pwd
import stat

from sidecar._src.ckptfmt import names
from sidecar._src.core import errors

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


@dataclasses.dataclass(frozen=True, slots=True)
class Untrusted:
  """Where a pinned tree fails the ownership rule: the entry, its owner and mode, why."""

  path: str
  uid: int
  mode: int
  why: str

  def describe(self) -> str:
    return (f"{self.path!r:.300} belongs to {_user(self.uid)} with mode "
            f"{stat.filemode(self.mode)} ({self.why})")


def _user(uid: int) -> str:
  try:
    return f"user {pwd.getpwuid(uid).pw_name!r} (uid {uid})"
  except KeyError:
    return f"uid {uid}"


def _why_not(st: os.stat_result) -> str | None:
  """Why an entry's (l)stat fails the ownership rule, or None."""
  if stat.S_ISLNK(st.st_mode):
    return "a symlink"
  if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
    return "neither a plain file nor a directory"
  if st.st_uid not in (0, os.geteuid()):
    return f"not this sidecar's user (uid {os.geteuid()}) nor root"
  if st.st_mode & _OTHERS_WRITE:
    return "writable by its group or others"
  return None


def check_tree(dir_fd: int, path: str) -> Untrusted | None:
  """The first entry of the tree at the directory ``dir_fd`` (itself included; ``path``
  names it in the answer) that fails the ownership rule (see the module's docstring),
  or None where all pass. Walks from the descriptor: no name above it is resolved."""
  st = os.fstat(dir_fd)
  why = _why_not(st)
  if why is not None:
    return Untrusted(path, st.st_uid, st.st_mode, why)
  todo: list[tuple[int, str]] = [(os.dup(dir_fd), path)]
  try:
    while todo:
      fd, where = todo.pop()
      try:
        with os.scandir(fd) as entries:
          for e in entries:
            full = os.path.join(where, e.name)
            try:  # gone meanwhile (another host's write renamed its file into place)
              st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
              continue
            why = _why_not(st)
            if why is not None:
              return Untrusted(full, st.st_uid, st.st_mode, why)
            if stat.S_ISDIR(st.st_mode):
              # Its parent passed, so nobody else could have swapped it since the stat.
              with contextlib.suppress(FileNotFoundError):
                todo.append((os.open(e.name, _DIR_FLAGS, dir_fd=fd), full))
      finally:
        os.close(fd)
  finally:
    for fd, _ in todo:
      os.close(fd)
  return None


class Pinned:
  """An opened directory (its descriptor held until :meth:`close`) and its verdict.

  ``untrusted`` is None where the tree below passed :func:`check_tree` when pinned (it
  cannot fail it later but by this user's or root's hand): TensorStore may then open
  files at :attr:`proc`. Else it says where the tree failed.
  """

  def __init__(self, fd: int, path: str, untrusted: Untrusted | None):
    self.fd: int | None = fd
    self.path = path
    st = os.fstat(fd)
    self.identity = (st.st_dev, st.st_ino)  # unique while the descriptor is open
    self.untrusted = untrusted

  @property
  def proc(self) -> str:
    """The directory's path through its descriptor, for a library that opens by path."""
    return f"/proc/self/fd/{self._fd()}"

  def _fd(self) -> int:
    if self.fd is None:
      raise ValueError(f"the pinned directory {self.path!r} is closed")
    return self.fd

  def open(self, name: str, flags: int, mode: int = 0o644, *, make_dirs: bool = False,
           field: str = "name") -> int:
    """A descriptor of ``name`` beneath the directory, no symlink followed
    (``names.open_at``); a symlink met is a PermissionDeniedError naming the path."""
    try:
      return names.open_at(self._fd(), name, flags, mode, make_dirs=make_dirs, field=field,
                           shown=self.path)
    except OSError as e:
      if e.errno != errno.ELOOP:
        raise
      raise errors.PermissionDeniedError(
          f"{os.path.join(self.path, name)!r:.300} is a symlink (or one is on its way), in "
          "checkpoint files the sidecar opens without following any; a checkpoint holds no "
          "symlinks: remove it") from None

  def refusal(self, what: str) -> errors.PermissionDeniedError:
    """The PermissionDeniedError for ``what`` (a read or write that needs TensorStore)
    in an untrusted tree: the entry, its owner, its mode and the fix."""
    bad = self.untrusted
    assert bad is not None
    if stat.S_ISLNK(bad.mode) or not (stat.S_ISDIR(bad.mode) or stat.S_ISREG(bad.mode)):
      return errors.PermissionDeniedError(
          f"refusing {what}: {bad.path!r:.300} is {bad.why} ({stat.filemode(bad.mode)}), in "
          "the checkpoint files TensorStore opens by path (it would follow a symlink, "
          "perhaps out of the checkpoint directory); a checkpoint holds no symlinks: remove "
          "it")
    return errors.PermissionDeniedError(
        f"refusing {what} through TensorStore, which opens files by path: "
        f"{bad.describe()}, so someone other than this sidecar's user or root could swap "
        f"files in {self.path!r:.300} for symlinks while it reads or writes; keep a "
        "checkpoint's step directories as the sidecar wrote them (owned by its user, not "
        "writable by group or others: umask 022), or read whole chunks of an uncompressed "
        "Zarr v2 array, which need no such rule")

  def close(self) -> None:
    """Closes the descriptor; idempotent."""
    fd, self.fd = self.fd, None
    if fd is not None:
      os.close(fd)

  def __enter__(self) -> Pinned:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()

  def __del__(self) -> None:  # a safety net: whoever pins, closes
    with contextlib.suppress(Exception):
      self.close()


def pin(path: os.PathLike | str, *, make: bool = False) -> Pinned:
  """The directory ``path`` pinned (see :class:`Pinned`), reached from ``/`` with no
  untrusted symlink followed (``names.open_dir``); ``make``: made (0o755) in its parent
  first where missing, with its parent reached so too.

  Raises:
    OSError: it (or, ``make``, its parent) is missing or no directory.
    PermissionDeniedError: an untrusted symlink on the way (``names.open_dir``).
  """
  path = os.path.abspath(os.fspath(path))
  if make:
    parent = names.open_dir(os.path.dirname(path))
    try:
      with contextlib.suppress(FileExistsError):
        os.mkdir(os.path.basename(path), 0o755, dir_fd=parent)
      try:
        fd = os.open(os.path.basename(path), _DIR_FLAGS, dir_fd=parent)
      except OSError as e:
        raise OSError(e.errno, e.strerror, path) from None
    finally:
      os.close(parent)
  else:
    fd = names.open_dir(path)
  try:
    untrusted = check_tree(fd, path)
  except BaseException:
    os.close(fd)
    raise
  return Pinned(fd, path, untrusted)
