"""Each tenant process's private temporary directory, and what it holds.

The sidecar makes one directory for all of them at its start (``sidecar-tenants-*`` in its
own temporary directory, mode 0711, held by an ``flock`` while the sidecar lives), and in it
one per tenant process (0700, the tenant's user's), which the process gets as ``TMPDIR``
(``TMP``, ``TEMP``, ``HOME``): what a library writes there (a TFDS dataset's view, say) is
the tenant's. Each file is bounded by the kernel (``RLIMIT_FSIZE``, ``limits.py``); the
whole, files and directories, by :func:`measure`, which the sidecar runs every
``MEASURE_S``: a tenant on a pod's disk has no file system of its own without privilege, so
its total is counted here, as ``du`` counts it, with each entry at least ``MIN_ENTRY``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
import subprocess
import tempfile

log = logging.getLogger(__name__)

PREFIX = "sidecar-tenants-"
_LOCK = ".lock"
# How often the sidecar measures each tenant process's directory.
MEASURE_S = 0.5
# What an entry costs at least (a directory's block, an inode's worth): a tree of empty
# files or links is counted too.
MIN_ENTRY = 4096
# A tree deeper than this is past its bound, whatever it holds: the walk holds one
# descriptor per level.
MAX_DEPTH = 64


class TmpBase:
  """The sidecar's directory of its tenants' temporary directories; a context manager.

  Args:
    parent: where to make it (the sidecar's temporary directory by default).
  """

  def __init__(self, parent: str | None = None):
    parent = parent or tempfile.gettempdir()
    sweep(parent)
    self.path = tempfile.mkdtemp(prefix=PREFIX, dir=parent)
    os.chmod(self.path, 0o711)  # its tenants reach their own directories, list none
    self._lock = os.open(os.path.join(self.path, _LOCK),
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(self._lock, fcntl.LOCK_EX)  # held while this sidecar lives
    self._made = 0

  def make(self, tenant: str, uid: int | None, gid: int | None) -> str:
    """A new, empty directory of ``tenant``'s (mode 0700; its user's, where it has one)."""
    self._made += 1
    path = os.path.join(self.path, f"{tenant}-{self._made}")
    os.mkdir(path, 0o700)
    if uid is not None:
      os.chown(path, uid, gid if gid is not None else -1)
    return path

  def remove(self, path: str, uid: int | None) -> None:
    """Removes tenant directory ``path`` and all it holds; as its user where it has one,
    so nothing its user could not remove is removed, and no link is followed."""
    clear(path, uid)
    with contextlib.suppress(OSError):
      os.rmdir(path)

  def close(self) -> None:
    """Removes the directory and every tenant's in it; idempotent."""
    if self._lock < 0:
      return
    shutil.rmtree(self.path, ignore_errors=True)
    os.close(self._lock)
    self._lock = -1

  def __enter__(self) -> TmpBase:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


def sweep(parent: str) -> None:
  """Removes the directories in ``parent`` that sidecars now gone left (their lock free)."""
  try:
    names = [n for n in os.listdir(parent) if n.startswith(PREFIX)]
  except OSError:
    return
  for name in names:
    path = os.path.join(parent, name)
    try:
      fd = os.open(os.path.join(path, _LOCK), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
      continue  # not one of ours, or being made
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      os.close(fd)
      continue  # its sidecar lives
    try:
      log.info("removing %s, the tenants' temporary directories of a sidecar that is gone",
               path)
      for entry in os.listdir(path):
        if entry != _LOCK:
          clear_and_remove(os.path.join(path, entry))
      shutil.rmtree(path, ignore_errors=True)
    finally:
      os.close(fd)


def clear_and_remove(path: str) -> None:
  """Removes ``path`` (a tenant's directory), whoever owns what is in it."""
  clear(path, None)
  with contextlib.suppress(OSError):
    os.rmdir(path)


def clear(path: str, uid: int | None) -> None:
  """Removes everything in ``path``, leaving it empty: ``rm -rf`` (no link followed, any
  depth), as user ``uid`` where given."""
  try:
    names = os.listdir(path)
  except OSError:
    return
  if not names:
    return
  subprocess.run(["rm", "-rf", "--one-file-system", "--", *(os.path.join(path, n)
                                                           for n in names)],
                 user=uid, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL, check=False, timeout=60)


def measure(path: str, most: int) -> int:
  """The bytes the tree at ``path`` holds, files, links and directories (each entry its
  blocks or its size, and at least ``MIN_ENTRY``); the walk stops once past ``most`` (and
  answers more than ``most``), and a tree deeper than ``MAX_DEPTH`` is past it.

  No link is followed, and the walk holds one descriptor per level: a tree its tenant
  changes meanwhile is counted as found.
  """
  try:
    top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
  except OSError:
    return 0
  try:
    return _walk(top, 0, 0, most)
  finally:
    os.close(top)


def _walk(fd: int, depth: int, total: int, most: int) -> int:
  """``total`` plus what the directory open at ``fd`` holds (see :func:`measure`)."""
  if depth > MAX_DEPTH:
    return most + 1
  subdirs = []
  try:
    with os.scandir(fd) as entries:
      for entry in entries:
        try:
          st = entry.stat(follow_symlinks=False)
        except OSError:
          continue  # gone meanwhile
        total += max(st.st_blocks * 512, st.st_size, MIN_ENTRY)
        if total > most:
          return total
        if stat.S_ISDIR(st.st_mode):
          subdirs.append(entry.name)
  except OSError:
    return total
  for name in subdirs:
    try:
      sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                    dir_fd=fd)
    except OSError:
      continue
    try:
      total = _walk(sub, depth + 1, total, most)
    finally:
      os.close(sub)
    if total > most:
      return total
  return total
