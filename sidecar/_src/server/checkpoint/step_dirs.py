"""A checkpoint directory's steps on disk, as a save's calls act on them: an open (made,
probed, swept, listed), a Delete, the directory an Abort or a commit acts in.

Each is one resolution: the path a call was given is resolved once, to be checked
(``roots.py``, within the request's ``one_resolution``), and what it then makes, renames
or removes it reaches through the directory it acts in, opened once from its checkpoint
root with no symlink followed (``Roots.open``, ``ckptfmt/dir_fd.DirFd``); it checks and
acts relative to that descriptor. A tenant who swaps a directory of his for a symlink to
another's between the check and the act (issue 76, attack 1) meets a refusal, or changes
nothing the descriptor reaches:

- an open makes the directory, writes and removes a probe file in it, sweeps what a
  removal cut short and the uncommitted steps no save in flight writes
  (``Format.sweep``), and lists the steps, each asked of the directory it opened;
- a Delete opens the step in it, asks the formats whether that directory is a step, and
  removes that very directory (``DirFd.remove``: renamed away, its device and inode
  checked, then its files), or sets it aside (below);
- an Abort and a commit act in the directory their step's uncommitted directory lies in
  (:meth:`StepDirs.parent`).

A step set aside (``Checkpointer.set_aside(step)``, over the Delete RPC's ``set_aside``):
a trainer that goes on from an older step than the latest (a damaged latest step skipped
by ``restore(fallback=True)``, or an older one it named) saves the later step numbers
anew, and a save never replaces a committed step. So the step's directory is renamed,
whole and in one step, to ``set-aside-<step>`` beside it (``set-aside-<step>-2`` and so on
where that is taken; never over anything, ``RENAME_NOREPLACE``): no listing takes that name
for a step (neither the sidecar's, which lists numbered directories, nor stock Orbax's or
DCP's), no retention deletes it and no sweep removes it, so what was there stays for the
user to look at or remove.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import stat
import uuid
from collections.abc import Callable

from sidecar._src.ckptfmt import records, registry as formats_lib
from sidecar._src.ckptfmt.dir_fd import DirFd
from sidecar._src.ckptfmt.format import Format
from sidecar._src.core import errors
from sidecar._src.server.checkpoint import roots as roots_lib

log = logging.getLogger(__name__)
SET_ASIDE = "set-aside-"  # a step set aside: set-aside-<step>[-n] beside the steps
MAX_TRIES = 1000  # names tried past set-aside-<step> before giving up


class StepDirs:
  """The checkpoint directories of one sidecar (``host_id``) under its ``roots``, in the
  layouts of its ``formats``."""

  def __init__(self, host_id: int, *, roots: roots_lib.Roots, formats: formats_lib.Registry):
    self._host_id = host_id
    self._roots = roots
    self._path = roots.resolve
    self._formats = formats

  def open(self, directory: str, *, sweep: bool, in_flight: Callable[[pathlib.Path], bool]
           ) -> list[int]:
    """Makes ``directory`` where missing and checks it writable; with ``sweep``, removes
    what a removal cut short and each uncommitted step for which ``in_flight`` (its
    directory, resolved) is False; returns the committed steps in it."""
    path = pathlib.Path(self._path(directory, "directory"))
    with self._writable(directory, path) as at:
      if sweep:
        at.sweep_removals()  # what a removal cut short left
        for fmt in self._formats.formats.values():
          for tmp in fmt.sweep(path, at=at):  # (each a directory in it, no symlink)
            if not in_flight(tmp) and at.remove(tmp.name):  # its save crashed uncommitted
              log.warning("removed %s, left by a save that never committed", tmp)
      # Only numbered directories that hold a checkpoint's marker are steps: an empty
      # ``999/`` (or one being made by hand) is neither listed nor ever deleted.
      return sorted(int(n) for n in at.names() if n.isdigit() and self._is_step(at, n))

  def _writable(self, directory: str, path: pathlib.Path) -> DirFd:
    """The checkpoint directory ``path`` (``directory`` resolved), made where missing and
    opened from its root (``Roots.open``), once a file made and removed in it showed it
    writable; InvalidArgumentError saying why not."""
    try:
      at = self._roots.open(str(path), make=True)
    except errors.PermissionDeniedError:
      raise
    except OSError as e:
      raise self._not_writable(directory, path, e) from None
    try:
      probe = f".sidecar-probe-{uuid.uuid4().hex}"
      fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                   0o644, dir_fd=at.fd)
      try:
        os.write(fd, b"ok")
      finally:
        os.close(fd)
      at.unlink(probe)
    except OSError as e:
      at.close()
      raise self._not_writable(directory, path, e) from None
    return at

  def _not_writable(self, directory: str, path: pathlib.Path,
                    e: OSError) -> errors.InvalidArgumentError:
    blocker = _file_in_the_way(path)
    if blocker is not None:  # no write access would help: a file holds the name
      return errors.InvalidArgumentError(
          f"checkpoint directory {directory!r}: {blocker} is a {_kind(blocker)}, not a "
          "directory: a checkpoint directory must be a directory; pick another path")
    return errors.InvalidArgumentError(
        f"checkpoint directory {directory!r} is not writable from sidecar host "
        f"{self._host_id}: {e.strerror or e}; give the sidecar write access (on Kubernetes, "
        "mount the same volume in the sidecar container)")

  def _is_step(self, at: DirFd, name: str) -> bool:
    """Whether the directory ``name`` in ``at`` (no symlink) is a committed checkpoint of a
    format here, asked of the directory opened (a step removed meanwhile is none)."""
    try:
      with at.child(name) as step:
        return formats_lib.is_checkpoint(pathlib.Path(step.proc), self._formats)
    except (FileNotFoundError, NotADirectoryError, errors.PermissionDeniedError):
      return False  # gone, a file, or a symlink: no step

  def delete(self, directory: str, step: int, *, set_aside: bool = False) -> str:
    """Removes a committed step (max_to_keep), or with ``set_aside`` renames it out of the
    directory's steps (returns where it went); the sidecar does the I/O.

    Only a step directory a checkpoint wrote goes (one a registered format says is a
    committed checkpoint of its own); anything else is refused. A step another process
    removes meanwhile (another host's retention) is gone, as asked: no error ("").
    """
    resolved = self._path(directory, "directory")
    step = roots_lib.as_int(step, "step")
    if step < 0:
      raise errors.InvalidArgumentError(f"step must be a non-negative int, got {step}")
    name = str(step)
    with self.parent(os.path.join(resolved, name)) as at:
      if at is None or not at.is_dir(name):
        if at is not None and stat.S_ISLNK(getattr(at.lstat(name), "st_mode", 0)):
          raise errors.PermissionDeniedError(
              f"delete: {at.join(name)!r:.200} is a symlink; delete removes only a step "
              "directory a checkpoint wrote, and follows no symlink: remove it yourself")
        return ""  # gone already (or a file: no step)
      try:
        target = at.child(name)
      except (FileNotFoundError, NotADirectoryError):
        return ""  # removed since the look (another host's retention): gone, as asked
      with target:  # the check and the removal are of this very directory
        if not formats_lib.is_checkpoint(pathlib.Path(target.proc), self._formats):
          if at.lstat(name) is None:
            return ""  # removed since it was opened (another host's retention): gone
          raise errors.InvalidArgumentError(
              f"delete: {at.join(name)} is not a checkpoint step directory (no "
              f"{records.MANIFEST_FILE} nor other mark of a format of {self._formats.names} "
              "in it or its items); delete removes only steps a checkpoint wrote")
        if set_aside:
          return _set_aside(at, name, target.identity())
        # (another host's delete may rename it away first: gone, as asked)
        at.remove(name, expect=target.identity())
        return ""

  def parent(self, path: str) -> contextlib.AbstractContextManager[DirFd | None]:
    """The directory ``path`` (resolved) lies in, opened from the root; None where it is
    gone (or no directory)."""
    try:
      return self._roots.open(os.path.dirname(path))
    except (FileNotFoundError, NotADirectoryError):
      return contextlib.nullcontext()

  def made_here(self, fmt: Format, tmp: pathlib.Path, at: DirFd | None) -> bool:
    """``fmt.made_here`` of the uncommitted directory ``tmp``, in ``at`` where it lies in
    that one (the path aborted is ``tmp`` itself), else in its own directory opened."""
    if at is not None and at.path == str(tmp.parent):
      return fmt.made_here(tmp, at=at)
    with self.parent(str(tmp)) as there:
      return there is None or fmt.made_here(tmp, at=there)


def _set_aside(at: DirFd, name: str, identity: tuple[int, int]) -> str:
  """Renames the committed step ``name`` of ``at`` (the directory with ``identity``, as
  checked) to a free ``set-aside-<step>[-n]`` beside it; returns its new path ("": gone
  meanwhile, or another directory there now, which stays as it is).

  Raises:
    FileExistsError: every name tried is taken.
  """
  for n in range(1, MAX_TRIES + 1):
    dest = f"{SET_ASIDE}{name}" + (f"-{n}" if n > 1 else "")
    st = at.lstat(name)
    if st is None or (st.st_dev, st.st_ino) != identity:
      return ""  # gone meanwhile (another host's retention), or not the step checked
    try:
      at.rename(name, dest)  # never over anything at dest
    except FileExistsError:
      continue
    except FileNotFoundError:
      return ""
    log.warning("step %s of %s set aside as %s: it is no step of the directory any more "
                "(its number is saved anew); remove it once you are done with it",
                name, at.path, at.join(dest))
    return at.join(dest)
  raise FileExistsError(f"no free name to set {at.join(name)} aside as ({SET_ASIDE}{name} "
                        f"and {MAX_TRIES - 1} more are taken)")


def _file_in_the_way(path: pathlib.Path) -> pathlib.Path | None:
  """``path`` or the nearest of its parents that exists, if that is no directory (a
  regular file, a socket): what made ``mkdir`` fail with ``File exists`` or ``Not a
  directory``; None if it is a directory."""
  for p in (path, *path.parents):
    try:
      st = p.stat()
    except (FileNotFoundError, NotADirectoryError):  # not there, or under a file
      continue
    except OSError:
      return None  # no access: what the caller says then is right
    return None if stat.S_ISDIR(st.st_mode) else p
  return None


def _kind(path: pathlib.Path) -> str:
  """What ``path`` (no directory) is, in words."""
  mode = path.stat().st_mode
  return next((name for test, name in ((stat.S_ISREG, "regular file"), (stat.S_ISSOCK, "socket"),
                                      (stat.S_ISFIFO, "named pipe"))
               if test(mode)), "file")
