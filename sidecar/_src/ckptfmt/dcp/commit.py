"""Committing a DCP checkpoint: its uncommitted directory, the checks, one rename or swap.

:func:`create_tmp` makes ``<path>.dcp-checkpoint-tmp`` (``distcp.TMP_SUFFIX``), marked as
made by a save (:data:`MADE_FILE`), after removing a leftover a save made (never anything
else: :func:`remove_ours`); once every rank's file is written there
(``distcp.write_rank_part``), :func:`finalize` checks each file's size, writes the manifest
and ``.metadata`` (the bytes rank 0's trainer pickled), fsyncs and renames the directory
into place: swapped with a committed checkpoint at the path in one step (renameat2's
exchange), or, where the file system has no such swap, in two renames whose cut-short
state (the replaced copy at :func:`old_path`) the next open or save puts back
(:func:`recover`).

Every look, removal and rename is relative to the directory the checkpoint lies in, opened
once (``ckptfmt/dir_fd.py``: the sidecar's, opened from its root with no symlink followed,
or opened here from a path): a directory swapped for a symlink meanwhile never moves them.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Callable, Iterator, Mapping

from sidecar._src.ckptfmt import dir_fd, direct_io, records
from sidecar._src.ckptfmt.dcp.distcp import MANIFEST, METADATA_FILE, TMP_SUFFIX, file_name
from sidecar._src.ckptfmt.dir_fd import DirFd
from sidecar._src.core import errors

OLD_SUFFIX = ".dcp-checkpoint-old"  # a replaced checkpoint, until its removal
MADE_FILE = ".sidecar-made"  # in an uncommitted directory: a save made it (gone once committed)


def tmp_path(path: os.PathLike | str) -> pathlib.Path:
  """Where the checkpoint at ``path`` is written before its commit."""
  path = pathlib.Path(path)
  return path.with_name(path.name + TMP_SUFFIX)


def create_tmp(path: os.PathLike | str, *, at: DirFd | None = None) -> pathlib.Path:
  """Makes the uncommitted directory of the checkpoint at ``path`` (a leftover of an
  attempt that never committed is removed first, if a save made it: :func:`is_ours`) and
  returns it, marked as made by a save (:data:`MADE_FILE`). ``at``: the directory ``path``
  lies in, opened (made here where missing, if None): every look, removal and rename is
  relative to it.

  Raises:
    PermissionDeniedError: something a save did not make is where the directory goes.
  """
  path = pathlib.Path(path)
  tmp = tmp_path(path)
  with dir_fd.held(at, path.parent, make=True) as d:
    recover(path, at=d)  # a complete copy first, where an overwrite was cut short
    remove_ours(tmp, at=d)
    try:
      d.mkdir(tmp.name)
    except FileExistsError as e:
      raise FileExistsError(e.errno, e.strerror, str(tmp)) from None
    with d.child(tmp.name) as made:
      fd = os.open(MADE_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                   | os.O_CLOEXEC, 0o644, dir_fd=made.fd)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)
  return tmp


def is_ours(path: os.PathLike | str, *, at: DirFd | None = None) -> bool:
  """Whether ``path`` is a directory a save made: an uncommitted one (:data:`MADE_FILE`
  in it) or a checkpoint written here (our manifest and DCP's ``.metadata``); never a
  symlink. ``at``: the directory ``path`` lies in, opened."""
  path = pathlib.Path(path)
  try:
    with dir_fd.held(at, path.parent) as d, _opened_child(d, path.name) as c:
      return c is not None and _made_by_a_save(c)
  except FileNotFoundError:
    return False  # (its directory gone: nothing there)


def _made_by_a_save(c: DirFd) -> bool:
  """:func:`is_ours` of the directory ``c``, opened."""
  return c.is_file(MADE_FILE) or (c.is_file(METADATA_FILE) and c.is_file(MANIFEST))


def remove_ours(path: os.PathLike | str, *, at: DirFd | None = None) -> None:
  """Removes the directory ``path`` (a save's ``-tmp`` or ``-old`` sibling) if a save made
  it (:func:`is_ours`); nothing there is fine; anything else is left as it is and refused
  (PermissionDeniedError): a sidecar removes only what it made. ``at``: the directory
  ``path`` lies in, opened; what is removed is the directory found there before the check
  (``DirFd.remove``'s ``expect``), never one swapped in since."""
  path = pathlib.Path(path)
  with dir_fd.held(at, path.parent) as d:
    seen = d.lstat(path.name)
    if not is_ours(path, at=d):
      if d.lstat(path.name) is None:
        return  # nothing there, or removed since the look (another host's abort or open)
      raise errors.PermissionDeniedError(
          f"{path} is in the way of a DCP save and was not made by one (no {MADE_FILE} nor "
          f"{MANIFEST} in it); it is left as it is: move it away, or save the checkpoint "
          "under another name")
    if seen is not None:
      d.remove(path.name, expect=(seen.st_dev, seen.st_ino))


@contextlib.contextmanager
def _opened_child(d: DirFd, name: str) -> Iterator[DirFd | None]:
  """The directory ``name`` in ``d`` opened (no symlink followed), or None where nothing
  is there or it is no directory (a file, a symlink)."""
  try:
    c = d.child(name)
  except (FileNotFoundError, NotADirectoryError, errors.PermissionDeniedError):
    yield None
    return
  with c:
    yield c


def old_path(path: os.PathLike | str) -> pathlib.Path:
  """Where a replaced checkpoint waits for its removal (only where the file system has
  no atomic exchange: :func:`finalize`)."""
  path = pathlib.Path(path)
  return path.with_name(path.name + OLD_SUFFIX)


def recover(path: os.PathLike | str, *, at: DirFd | None = None) -> bool:
  """Puts the replaced copy back at ``path`` if an overwrite was cut short between its two
  renames (nothing at ``path``, a complete copy at :func:`old_path`); whether it did.
  Another process that put it back first (another host's open of the same directory)
  leaves nothing to do here. ``at``: the directory ``path`` lies in, opened."""
  path, old = pathlib.Path(path), old_path(path)
  with dir_fd.held(at, path.parent) as d:
    if d.lstat(path.name) is not None or not _is_checkpoint_in(d, old.name):
      return False
    try:
      d.rename(old.name, path.name)
    except (FileNotFoundError, FileExistsError):
      return False  # put back (or the path made) by another process since the check
    d.fsync()
  return True


def _is_checkpoint_in(d: DirFd, name: str) -> bool:
  """Whether the directory ``name`` in ``d`` (no symlink) is a committed DCP checkpoint."""
  with _opened_child(d, name) as c:
    return c is not None and c.is_file(METADATA_FILE)


def _exchange(d: DirFd, a: str, b: str) -> bool:
  """Swaps the directories ``a`` and ``b`` of ``d`` in one step (``DirFd.exchange``);
  False where the system or the file system has no such swap."""
  return d.exchange(a, b)


def finalize(tmp: os.PathLike | str, *, metadata: bytes, file_sizes: Mapping[int, int],
             manifest: records.Manifest | None = None, replace: bool = True,
             swapping: Callable[[], None] | None = None,
             at: DirFd | None = None) -> pathlib.Path:
  """Commits the checkpoint written into ``tmp``: checks every rank's file, writes the
  manifest and ``.metadata`` (the bytes rank 0's trainer pickled), fsyncs, renames.

  Args:
    tmp: the directory :func:`create_tmp` returned.
    metadata: DCP's ``Metadata``, pickled by the trainer; written as it is.
    file_sizes: every rank's file size (``distcp.layout``), by rank.
    manifest: our manifest of the checkpoint (its plan, checksums), written as its JSON.
    replace: a committed checkpoint already at the path is replaced (as DCP's
      ``overwrite=True``): it stays whole until the rename and is removed after;
      False: FileExistsError.
    at: the directory ``tmp`` lies in, opened: every look, rename and removal of the
      commit is relative to it (None: opened here).

  Returns:
    The committed checkpoint directory.

  Raises:
    InvalidArgumentError: a rank's file is missing or of the wrong size, or
      ``metadata`` is not a pickle.
    FileExistsError: something other than a committed checkpoint is at the path, or
      one is and ``replace`` is False.
  """
  tmp = pathlib.Path(tmp)
  if not tmp.name.endswith(TMP_SUFFIX):
    raise errors.InvalidArgumentError(f"{tmp} is not an uncommitted DCP checkpoint (*{TMP_SUFFIX})")
  final = tmp.with_name(tmp.name.removesuffix(TMP_SUFFIX))
  if not isinstance(metadata, bytes) or not metadata.startswith(b"\x80"):
    raise errors.InvalidArgumentError(
        "metadata must be DCP's Metadata as pickle bytes (rank 0's trainer pickles it), got "
        f"{type(metadata).__name__} {bytes(metadata[:8]) if isinstance(metadata, bytes) else ''!r}")
  for rank, size in sorted(file_sizes.items()):
    path = tmp / file_name(rank)
    got = path.stat().st_size if path.is_file() else None
    if got != size:
      raise errors.InvalidArgumentError(
          f"checkpoint at {final} is incomplete: rank {rank}'s {path.name} is "
          + ("missing" if got is None else f"{got} bytes, expected {size}")
          + "; every rank's part must be written before the commit")
  if manifest is not None:
    direct_io.write_small(tmp / MANIFEST, manifest.to_json().encode())
  direct_io.write_small(tmp / METADATA_FILE, metadata)
  direct_io.fsync_dir(tmp)
  with dir_fd.held(at, tmp.parent) as d:
    return _swap_in(d, tmp, final, replace=replace, swapping=swapping)


def _swap_in(d: DirFd, tmp: pathlib.Path, final: pathlib.Path, *, replace: bool,
             swapping: Callable[[], None] | None) -> pathlib.Path:
  """:func:`finalize`'s renames, in the directory ``d`` both lie in."""
  recover(final, at=d)
  old = None
  if d.lstat(final.name) is not None:
    if not _is_checkpoint_in(d, final.name):
      raise FileExistsError(f"{final} exists and is not a DCP checkpoint; not replacing it")
    if not replace:
      raise FileExistsError(f"a checkpoint is already committed at {final}")
    stale = old_path(final)  # a stale copy (``final`` is whole), or what a save made
    if _is_checkpoint_in(d, stale.name):
      d.rmtree(stale.name)
    else:
      remove_ours(stale, at=d)
    if _exchange(d, tmp.name, final.name):  # one step: the path always holds a whole one
      if swapping is not None:
        swapping()
      d.fsync()
      d.rmtree(tmp.name)  # the replaced copy, now at the tmp name
      _committed(d, final.name)
      return final
    # No atomic swap here: two renames, and recover() puts the old copy back if this
    # process dies between them (the next open or save of the path calls it).
    old = old_path(final)
    d.rename(final.name, old.name)
    if swapping is not None:
      swapping()
  d.rename(tmp.name, final.name)
  d.fsync()
  _committed(d, final.name)
  if old is not None:
    d.rmtree(old.name)
  return final


def _committed(d: DirFd, name: str) -> None:
  """The committed checkpoint ``name`` in ``d`` is no longer a save's own: its
  :data:`MADE_FILE` goes."""
  with _opened_child(d, name) as c:
    if c is not None:
      c.unlink(MADE_FILE)
