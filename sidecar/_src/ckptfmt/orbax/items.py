"""Committed items opened for reading: pinned, with their ``_METADATA`` and one TensorStore
context each, cached while a restore reads their leaves.

A restore reads each leaf apart, and a context per leaf would parse the metadata and
read an OCDBT step's manifest and b-tree again for every one; a walk of the item's
tree (``pinned.check_tree``) per leaf would cost as much. So each item is opened once
(:func:`opened`) and kept, with its descriptor, for the next reads.

The cache is keyed by what was checked: the directory's identity ``(st_dev, st_ino)``
and its ``_METADATA``'s (inode, mtime, size). An entry holds its directory's descriptor
open, so no other directory can have that identity while it is cached: a step deleted
and written again, or one swapped for another, is a new entry, walked again. Its
context only ever sees paths through its own descriptor (``/proc/self/fd/N``), and is
dropped with it: a descriptor number reused by another directory never reaches it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import pathlib
import stat
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sidecar._src.ckptfmt import names, pinned as pinned_lib
from sidecar._src.ckptfmt.orbax import libs
from sidecar._src.ckptfmt.spec import METADATA_FILE
from sidecar._src.core import errors

if TYPE_CHECKING:
  import tensorstore as ts

_MAX_ITEMS = 4  # the steps being restored; each context caches <= 100 MB of OCDBT nodes
MAX_SMALL_FILE = 64 << 20  # bytes of a metadata file read (_METADATA, .zarray)


@dataclasses.dataclass(eq=False)
class Item:
  """A committed item opened for reading (see the module's docstring)."""

  pinned: pinned_lib.Pinned
  meta: dict[str, Any]
  context: ts.Context | None  # where the tree is trusted (TensorStore may open in it)
  refs: int = 0  # reads in flight; guarded by _lock
  evicted: bool = False


_lock = threading.Lock()
_items: collections.OrderedDict[tuple[int, ...], Item] = collections.OrderedDict()


@contextlib.contextmanager
def opened(item_dir: pathlib.Path) -> Iterator[Item]:
  """The item at ``item_dir`` (an absolute path), from the cache or opened now; its
  descriptor stays open until the block ends (and while it is cached).

  Raises:
    FileNotFoundError: no item there (no ``_METADATA``).
    PermissionDeniedError: an untrusted symlink on the way to it (``names.open_dir``).
  """
  try:
    fd = names.open_dir(item_dir)
  except (FileNotFoundError, NotADirectoryError):
    raise FileNotFoundError(
        f"no checkpoint item at {item_dir} ({METADATA_FILE} is missing)") from None
  owned = False  # whether the pinned directory owns fd (else it is closed here)
  try:
    identity = os.fstat(fd)
    try:
      meta_stat = os.stat(METADATA_FILE, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
      raise FileNotFoundError(
          f"no checkpoint item at {item_dir} ({METADATA_FILE} is missing)") from None
    key = (identity.st_dev, identity.st_ino, meta_stat.st_ino, meta_stat.st_mtime_ns,
           meta_stat.st_size)
    leased = _lease(key)
    if leased is None:
      pinned = pinned_lib.Pinned(fd, str(item_dir), pinned_lib.check_tree(fd, str(item_dir)))
      owned = True
      leased = _lease(key, _new(pinned))
  finally:
    if not owned:
      os.close(fd)
  assert leased is not None  # _lease with an item always leases one
  item: Item = leased
  try:
    yield item
  finally:
    with _lock:
      item.refs -= 1
      if item.evicted and not item.refs:
        item.pinned.close()


def _new(pinned: pinned_lib.Pinned) -> Item:
  try:
    meta = json.loads(read_small(pinned, METADATA_FILE))
    context = None
    if pinned.untrusted is None:
      libs.load()  # once, for the process: never raced
      from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
      context = ts_utils.get_ts_context(use_ocdbt=True)
    return Item(pinned, meta, context)
  except BaseException:
    pinned.close()
    raise


def _lease(key: tuple[int, ...], new: Item | None = None) -> Item | None:
  """The cached item at ``key`` with one more read in flight; else ``new`` cached (the
  oldest evicted past the bound) and leased, or None."""
  with _lock:
    item = _items.get(key)
    if item is not None:
      _items.move_to_end(key)
      if new is not None:  # another read opened it meanwhile
        new.pinned.close()
    elif new is not None:
      item = _items[key] = new
      while len(_items) > _MAX_ITEMS:
        _, old = _items.popitem(last=False)
        old.evicted = True
        if not old.refs:
          old.pinned.close()
    if item is not None:
      item.refs += 1
    return item


def read_small(pinned: pinned_lib.Pinned, name: str) -> bytes:
  """The bytes of the plain file ``name`` beneath the pinned directory (no symlink
  followed; a FIFO or device is refused, never waited on).

  Raises:
    FileNotFoundError: no such file.
    CorruptCheckpointError: not a plain file, or larger than ``MAX_SMALL_FILE``.
  """
  fd = pinned.open(name, os.O_RDONLY | os.O_NONBLOCK)
  try:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SMALL_FILE:
      raise errors.CorruptCheckpointError(
          f"{os.path.join(pinned.path, name)!r:.300} is not a plain file of at most "
          f"{MAX_SMALL_FILE} bytes (mode {stat.filemode(st.st_mode)}, {st.st_size} bytes)")
    chunks = []
    while piece := os.read(fd, 1 << 20):
      chunks.append(piece)
    return b"".join(chunks)
  finally:
    os.close(fd)


def clear() -> None:
  """Drops every cached item (their descriptors close once no read holds them)."""
  with _lock:
    for item in _items.values():
      item.evicted = True
      if not item.refs:
        item.pinned.close()
    _items.clear()
