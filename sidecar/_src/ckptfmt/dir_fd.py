"""A checkpoint's directory opened once, and the step operations that act relative to it.

A step operation that checks a path and then acts on the path string acts on whatever the
kernel resolves the second time: a tenant who owns a directory on the way swaps it for a
symlink to another's between the two, and the check passes on his while the rename or
removal lands on hers (issue 76, attack 1). So every step operation (a Delete, an Abort,
an open's sweep, a Begin's removal of a leftover, a commit's renames) opens the directory
it acts in once, as a :class:`DirFd`, and then checks and acts only relative to that
descriptor (``os.rename``, ``os.stat``, ``shutil.rmtree`` with ``dir_fd=``), on names
that are one component each:

- the sidecar's own step operations reach it from their checkpoint root
  (:meth:`DirFd.below`, ``server/checkpoint/roots.Roots.open``): the root by its path
  (``core/beneath.open_dir``: a symlink on the way only where nobody but the sidecar's user
  or root could have put it), then each component below it with ``O_NOFOLLOW``: no symlink
  at all. A path was resolved (``realpath``) before its checks, so a symlink met now was
  swapped in since: refused (``PermissionDeniedError``), never followed;
- a library call of a format's functions with a path alone (a test, a tool) reaches it
  from ``/`` the same way as the root (:meth:`DirFd.at`).

Once opened, a rename of the directory or of any directory above it changes nothing the
descriptor reaches; what lies beneath it a tenant could change is only his own, since
nobody can move another's directory into his (that needs write access to hers) nor link
one (no hard links of directories). A removal renames the directory away first
(:data:`DELETING`: nobody finds it half removed), then checks that what it renamed is the
directory it looked at (device and inode) before removing its files.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import shutil
import stat
import uuid
from collections.abc import Iterator

from sidecar._src.core import beneath, errors

# A directory being removed (a step deleted, an uncommitted one aborted or swept):
# ``.<name>.sidecar-deleting-<id>``, swept by the next open where a removal was cut short.
DELETING = ".sidecar-deleting-"
_AT_FDCWD = -100
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2  # <linux/fs.h>
_NO_FLAGS = (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP)  # renameat2 flags not supported


class DirFd:
  """A directory held open by its descriptor (``fd``) until :meth:`close`; ``path`` is
  where it was opened, for messages and for the paths an operation answers with. Every
  name given to a method is one component (no ``/``), looked up in this directory with
  no symlink followed."""

  __slots__ = ("fd", "path", "__weakref__")

  def __init__(self, fd: int, path: str):
    self.fd = fd
    self.path = path

  # ---- opening --------------------------------------------------------------------

  @classmethod
  def at(cls, path: os.PathLike | str, *, make: bool = False) -> DirFd:
    """The directory ``path``, reached from ``/`` (``core/beneath.open_dir``: a symlink
    on the way only where nobody but this user or root could have put it). ``make``: the
    missing directories at the end of ``path`` made (0o755), each opened with no symlink
    followed."""
    path = os.path.abspath(os.fspath(path))
    if not make:
      return cls(beneath.open_dir(path), path)
    missing: list[str] = []
    top = path
    while True:
      try:
        fd = beneath.open_dir(top)
        break
      except FileNotFoundError:
        if os.path.dirname(top) == top:
          raise
        top, name = os.path.split(top)
        missing.insert(0, name)
    return cls(_walk(fd, missing, path, make=True), path)

  @classmethod
  def below(cls, top: str, path: str, *, make: bool = False) -> DirFd:
    """The directory ``path`` (absolute and resolved, ``top`` itself or a path under it),
    reached from the directory ``top`` (as :meth:`at` reaches it) one component at a time
    with no symlink followed: one met is a PermissionDeniedError (the path changed since
    it was resolved). ``make``: missing components made (0o755), ``top``'s too (as
    :meth:`at` makes them: a checkpoint root named before its first save).

    Raises:
      ValueError: ``path`` is not ``top`` nor under it (a bug of the caller's).
      OSError: a component is missing (``make`` False) or no directory, naming ``path``.
    """
    rest = os.path.relpath(path, top)
    parts = [] if rest == "." else rest.split("/")
    if any(p in ("", ".", "..") for p in parts) or os.path.isabs(rest):
      raise ValueError(f"{path!r} is not under {top!r}")
    try:
      fd = beneath.open_dir(top)
    except FileNotFoundError:
      if not make:
        raise
      with cls.at(top, make=True) as made:
        fd = os.dup(made.fd)
    if parts:  # one call where the kernel resolves beneath itself (openat2)
      try:
        fast = beneath.openat2(fd, rest, beneath.DIR_FLAGS, 0,
                               beneath.RESOLVE_BENEATH | beneath.RESOLVE_NO_SYMLINKS, path,
                               quiet=True)
      except BaseException:
        os.close(fd)
        raise
      if fast is not None:
        os.close(fd)
        return cls(fast, path)
    # Else (no openat2, or it refused: a symlink, a missing component) one at a time.
    return cls(_walk(fd, parts, path, make=make), path)

  def child(self, name: str, *, make: bool = False) -> DirFd:
    """The directory ``name`` in this one, opened with no symlink followed (``make``: made
    first where missing); a symlink there is a PermissionDeniedError."""
    return DirFd(_walk(os.dup(self.fd), [_one(name)], self.join(name), make=make),
                 self.join(name))

  # ---- looking --------------------------------------------------------------------

  def join(self, name: str) -> str:
    """The path of ``name`` in this directory (as it was opened), for messages and answers."""
    return os.path.join(self.path, name)

  @property
  def proc(self) -> str:
    """This directory's path through its descriptor (``/proc/self/fd/N``), for a check
    that takes a path (a format's ``is_checkpoint``): whatever is renamed meanwhile, the
    kernel reaches the directory opened. Only entries below it are looked up by name."""
    return f"/proc/self/fd/{self.fd}"

  def lstat(self, name: str) -> os.stat_result | None:
    """``name``'s own stat (a symlink's, not its target's), or None where nothing is there."""
    try:
      return os.stat(_one(name), dir_fd=self.fd, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
      return None

  def is_dir(self, name: str) -> bool:
    """Whether ``name`` is a directory (a symlink to one is not)."""
    st = self.lstat(name)
    return st is not None and stat.S_ISDIR(st.st_mode)

  def is_file(self, name: str) -> bool:
    """Whether ``name`` is a regular file (a symlink to one is not)."""
    st = self.lstat(name)
    return st is not None and stat.S_ISREG(st.st_mode)

  def names(self) -> list[str]:
    """The names in this directory, sorted."""
    return sorted(os.listdir(self.fd))

  def identity(self) -> tuple[int, int]:
    """This directory's device and inode: what names it while the descriptor is open."""
    st = os.fstat(self.fd)
    return st.st_dev, st.st_ino

  # ---- acting ---------------------------------------------------------------------

  def mkdir(self, name: str, mode: int = 0o755) -> None:
    """Makes the directory ``name`` (FileExistsError where anything is there)."""
    os.mkdir(_one(name), mode, dir_fd=self.fd)

  def rename(self, src: str, dst: str) -> None:
    """Renames ``src`` to ``dst``, both in this directory, never over anything at ``dst``
    (FileExistsError naming it): one step where the kernel has ``RENAME_NOREPLACE``, else
    a look, then the rename."""
    src, dst = _one(src), _one(dst)
    if self._renameat2(src, dst, _RENAME_NOREPLACE):
      return
    if self.lstat(dst) is not None:
      raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), self.join(dst))
    try:
      os.rename(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)
    except OSError as e:
      raise OSError(e.errno, e.strerror, self.join(src), None, self.join(dst)) from None

  def exchange(self, a: str, b: str) -> bool:
    """Swaps the entries ``a`` and ``b`` of this directory in one step (``renameat2``'s
    ``RENAME_EXCHANGE``); False where the system or its file system has no such swap."""
    return self._renameat2(_one(a), _one(b), _RENAME_EXCHANGE)

  def _renameat2(self, src: str, dst: str, flags: int) -> bool:
    """``renameat2`` of ``src`` to ``dst`` in this directory with ``flags``; False where
    the kernel, its file system or the C library has no such flag, else an OSError naming
    both (FileExistsError where ``dst`` is there, with ``RENAME_NOREPLACE``)."""
    libc = _libc()
    fn = getattr(libc, "renameat2", None) if libc is not None else None
    if fn is None:
      return False
    if fn(self.fd, os.fsencode(src), self.fd, os.fsencode(dst), flags) == 0:
      return True
    err = ctypes.get_errno()
    if err in _NO_FLAGS:
      return False
    raise OSError(err, os.strerror(err), self.join(src), None, self.join(dst))

  def unlink(self, name: str) -> None:
    """Removes the file ``name`` (a symlink itself, never its target); gone already is fine."""
    with contextlib.suppress(FileNotFoundError):
      os.unlink(_one(name), dir_fd=self.fd)

  def rmtree(self, name: str) -> None:
    """Removes ``name`` and what lies in it, relative to this descriptor (``shutil.rmtree``
    with ``dir_fd``: it follows no symlink, and removes nothing through one); what cannot
    be removed stays."""
    shutil.rmtree(_one(name), ignore_errors=True, dir_fd=self.fd)

  def remove(self, name: str, *, expect: tuple[int, int] | None = None) -> bool:
    """Removes the directory ``name`` in one step for whoever looks meanwhile: renamed
    away first (:data:`DELETING`), then its files (:meth:`rmtree`). A symlink or a file
    there is left as it is; with ``expect`` (a device and inode: :meth:`identity` of the
    directory the caller opened and checked), so is any other directory. What is renamed
    away is removed only if it is the directory looked at: one swapped in between the look
    and the rename is put back. Returns whether it removed it (gone already: False)."""
    st = self.lstat(name)
    if st is None or not stat.S_ISDIR(st.st_mode) or (
        expect is not None and (st.st_dev, st.st_ino) != expect):
      return False
    gone = f".{name}{DELETING}{uuid.uuid4().hex[:8]}"
    try:
      os.rename(name, gone, src_dir_fd=self.fd, dst_dir_fd=self.fd)
    except (FileNotFoundError, NotADirectoryError):
      return False  # taken by another process's removal meanwhile: gone, as asked
    moved = self.lstat(gone)
    if moved is None or (moved.st_dev, moved.st_ino) != (st.st_dev, st.st_ino):
      with contextlib.suppress(OSError):  # (a new one there: it stays, swept as cut short)
        self.rename(gone, name)
      return False
    self.rmtree(gone)
    return True

  def sweep_removals(self) -> None:
    """Removes what a removal cut short left here (:data:`DELETING` names)."""
    for name in self.names():
      if name.startswith(".") and DELETING in name:
        self.rmtree(name)

  def fsync(self) -> None:
    """Makes this directory's entries durable (files made or renamed in it)."""
    os.fsync(self.fd)

  # ---- lifetime -------------------------------------------------------------------

  def close(self) -> None:
    """Closes the descriptor; idempotent."""
    fd, self.fd = self.fd, -1
    if fd >= 0:
      os.close(fd)

  def __enter__(self) -> DirFd:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()

  def __del__(self) -> None:  # a safety net: whoever opens, closes
    with contextlib.suppress(Exception):
      self.close()

  def __repr__(self) -> str:
    return f"DirFd({self.path!r}, fd={self.fd})"


@contextlib.contextmanager
def held(at: DirFd | None, path: os.PathLike | str, *, make: bool = False
         ) -> Iterator[DirFd]:
  """``at`` (the caller's, left open), or, where it is None, the directory ``path``
  opened here (:meth:`DirFd.at`) and closed after: a format's function acts relative to
  the descriptor the sidecar opened from its root, or, called with a path alone, to one it
  opens itself. ``at`` must be the directory ``path`` (ValueError: a bug of the caller's)."""
  path = os.path.abspath(os.fspath(path))
  if at is not None:
    if os.path.normpath(at.path) != path:
      raise ValueError(f"{at!r} is not the directory {path!r}")
    yield at
    return
  with DirFd.at(path, make=make) as opened:
    yield opened


def _one(name: str) -> str:
  """``name`` if it is one component (no ``/``, not ``.``/``..``), else ValueError."""
  if not name or "/" in name or name in (".", "..") or "\0" in name:
    raise ValueError(f"{name!r} is not one name in a directory")
  return name


def _walk(fd: int, parts: list[str], path: str, *, make: bool) -> int:
  """The directory ``parts`` below the descriptor ``fd`` (which this closes), each opened
  with ``O_NOFOLLOW``; ``make``: each made first where missing. A symlink met is a
  PermissionDeniedError naming ``path``; another error an OSError naming it."""
  try:
    for part in parts:
      if make:
        with contextlib.suppress(FileExistsError):
          os.mkdir(part, 0o755, dir_fd=fd)
      try:
        nxt = os.open(part, beneath.DIR_FLAGS, dir_fd=fd)
      except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(fd, part):
          raise _swapped(path) from None
        raise OSError(e.errno, e.strerror, path) from None
      os.close(fd)
      fd = nxt
    return fd
  except BaseException:
    os.close(fd)
    raise


def _is_link(dir_fd: int, name: str) -> bool:
  try:
    return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
  except OSError:
    return False


def _swapped(path: str) -> errors.PermissionDeniedError:
  return errors.PermissionDeniedError(
      f"{path!r:.300}: a symlink is on the way, where the sidecar found a directory when it "
      "checked the path (or one is there now): a step operation follows no symlink below its "
      "checkpoint root, and acts only on the directory it opened; checkpoint directories "
      "hold no symlinks: remove it (name the directory by its resolved path)")


@functools.cache
def _libc() -> ctypes.CDLL | None:
  try:
    return ctypes.CDLL(None, use_errno=True)
  except OSError:
    return None

