"""File writes (durable) and reads straight from memory, bypassing the page cache where it can.

A buffered write copies every byte into the page cache, and ``fsync`` then waits
for the kernel to write it back: for a 1 GiB checkpoint that is a second or more
of CPU on the host that also runs the training step, and the disk starts late.
With ``O_DIRECT`` the disk reads the caller's pages itself (no copy, ~0 CPU) as
soon as the write is issued. It needs the memory, length and file offset aligned
to the device's block size; arena blocks start on page boundaries, so all but a
tail of under a page goes direct, and the tail goes buffered. A file system that
refuses ``O_DIRECT`` (tmpfs, some network file systems) gets buffered writes.
Reads mirror it: the disk fills the caller's pages (an arena block) directly.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Callable

import numpy as np

from sidecar._src.ckptfmt import names, pinned

ALIGN = 4096  # covers 512-byte and 4 KiB logical blocks
CHUNK = 64 << 20  # bytes per call: large enough to keep the device busy
# A turn at the storage's write bandwidth for ``nbytes``, held while they are written:
# a pool's tenants share the storage by turns (server/shares.py). ``no_turn``: no sharing.
Turn = Callable[[int], contextlib.AbstractContextManager[None]]
TURN_BYTES = 16 << 20  # bytes written in one turn: a fair share is that fine-grained


def no_turn(nbytes: int) -> contextlib.AbstractContextManager[None]:
  del nbytes
  return contextlib.nullcontext()


def write_file(path: os.PathLike | str, data: np.ndarray, turn: Turn = no_turn, *,
               beneath: os.PathLike | str | pinned.Pinned | None = None) -> int:
  """Writes the C-order bytes of ``data`` to a new file at ``path`` and fsyncs it.

  ``data`` must stay unchanged until this returns. Returns how many bytes went
  direct (the rest went through the page cache). With a ``turn``, each ``TURN_BYTES``
  are written in a turn of their own. ``beneath``: ``path`` is a name relative to that
  directory (or a directory pinned by its descriptor, ``pinned.py``), opened beneath its
  descriptor with no symlink followed (``names.py``), its directories made where missing.

  Raises:
    OSError: the file could not be written.
  """
  data = np.ascontiguousarray(data)
  # memoryview takes any ndarray; numpy declares __buffer__ only from Python 3.12 on.
  buf = memoryview(data.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
  n = len(buf)
  flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
  if beneath is None:
    fd = os.open(path, flags, 0o644)
  elif isinstance(beneath, pinned.Pinned):
    fd = beneath.open(os.fspath(path), flags, make_dirs=True)
    path = os.path.join(beneath.path, path)
  else:
    fd = names.open_beneath(beneath, os.fspath(path), flags, make_dirs=True)
    path = os.path.join(beneath, path)
  try:
    direct = 0
    if n >= ALIGN and data.ctypes.data % ALIGN == 0:
      direct = _direct(fd, buf, n - n % ALIGN, lambda piece, at: os.pwrite(fd, piece, at),
                       turn)
    _buffered(buf, direct, lambda piece, at: os.pwrite(fd, piece, at), turn)
    os.fsync(fd)
  except OSError as e:  # pwrite and fsync name no file: the error says which (ENOSPC, EIO)
    if e.filename is not None:
      raise
    raise OSError(e.errno, e.strerror, os.fspath(path)) from None
  finally:
    os.close(fd)
  return direct


def read_file(path: os.PathLike | str, out: np.ndarray, *,
              beneath: os.PathLike | str | None = None) -> int:
  """Reads the file at ``path`` into the C-contiguous array ``out``; returns bytes read.
  ``beneath``: ``path`` is a name relative to that directory, opened as
  :func:`write_file` opens it.

  Reads at most ``out.nbytes``; fewer means the file is shorter (and the rest of
  ``out`` holds anything). A page-aligned ``out`` is read with ``O_DIRECT`` but for a tail
  under a page, as :func:`write_file` writes.

  Raises:
    OSError: the file could not be read.
  """
  if not out.flags.c_contiguous:
    raise ValueError("out must be C-contiguous")
  # memoryview takes any ndarray; numpy declares __buffer__ only from Python 3.12 on.
  buf = memoryview(out.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
  n = len(buf)
  fd = (os.open(path, os.O_RDONLY | os.O_CLOEXEC) if beneath is None
        else names.open_beneath(beneath, os.fspath(path), os.O_RDONLY))
  try:
    done = 0
    if n >= ALIGN and out.ctypes.data % ALIGN == 0:
      done = _direct(fd, buf, n - n % ALIGN, lambda piece, at: os.preadv(fd, [piece], at))
    while done < n:
      got = os.preadv(fd, [buf[done:]], done)
      if not got:
        break  # end of file
      done += got
  finally:
    os.close(fd)
  return done


def write_at(fd: int, data: np.ndarray, offset: int, turn: Turn = no_turn) -> int:
  """Writes the C-order bytes of ``data`` at ``offset`` of the open file ``fd``; no fsync.

  Page-aligned memory at a page-aligned offset goes direct but for a tail under a page,
  as :func:`write_file` (and in turns as it). It sets ``O_DIRECT`` on ``fd`` for the
  while: give each thread its own descriptor. Returns how many bytes went direct.
  """
  data = np.ascontiguousarray(data)
  buf = memoryview(data.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
  n = len(buf)
  direct = 0
  if n >= ALIGN and data.ctypes.data % ALIGN == 0 and offset % ALIGN == 0:
    direct = _direct(fd, buf, n - n % ALIGN,
                     lambda piece, at: os.pwrite(fd, piece, offset + at), turn)
  _buffered(buf, direct, lambda piece, at: os.pwrite(fd, piece, offset + at), turn)
  return direct


def read_at(fd: int, out: np.ndarray, offset: int) -> int:
  """Reads into the C-contiguous ``out`` from ``offset`` of the open file ``fd``; returns
  the bytes read (fewer at the end of the file). Direct where :func:`write_at` would be."""
  if not out.flags.c_contiguous:
    raise ValueError("out must be C-contiguous")
  buf = memoryview(out.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
  n = len(buf)
  done = 0
  if n >= ALIGN and out.ctypes.data % ALIGN == 0 and offset % ALIGN == 0:
    done = _direct(fd, buf, n - n % ALIGN,
                   lambda piece, at: os.preadv(fd, [piece], offset + at))
  while done < n:
    got = os.preadv(fd, [buf[done:]], offset + done)
    if not got:
      break  # end of file
    done += got
  return done


def background_thread() -> None:
  """Puts the calling thread in Linux's idle scheduling class (``SCHED_IDLE``).

  A save persists while the training step runs on the same cores: its writes and
  checksums run only on a core nothing else wants, and a waking training thread
  preempts them at once (a niced thread may finish its time slice first). Threads a
  ``SCHED_IDLE`` thread starts inherit the class.
  """
  try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
  except (AttributeError, OSError):  # not Linux: the ordinary priority
    pass


def write_small(path: os.PathLike | str, data: bytes) -> None:
  """Writes a small file durably (buffered, fsynced); sync its directory before a commit.
  The file is opened in its directory without following a symlink (``names.py``)."""
  path = os.fspath(path)
  fd = names.open_beneath(os.path.dirname(path) or ".", os.path.basename(path),
                          os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
  with os.fdopen(fd, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())


def fsync_dir(path: os.PathLike | str) -> None:
  """Makes a directory's entries durable (files created or renamed in it)."""
  fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _buffered(buf: memoryview, done: int, transfer: Callable[[memoryview, int], int],
              turn: Turn) -> None:
  """``transfer(piece, offset)`` over ``buf[done:]`` through the page cache (where direct
  I/O stopped or never started), each piece of at most ``TURN_BYTES`` in a turn where
  there are turns."""
  piece = len(buf) if turn is no_turn else TURN_BYTES
  while done < len(buf):
    size = min(len(buf) - done, piece)
    with turn(size):
      end = done + size
      while done < end:
        done += transfer(buf[done:end], done)


def _direct(fd: int, buf: memoryview, end: int, transfer: Callable[[memoryview, int], int],
            turn: Turn = no_turn) -> int:
  """``transfer(piece, offset)`` over ``buf[:end]`` with O_DIRECT, as far as the file
  system allows; returns the bytes done (the caller does the rest buffered). With a
  ``turn``, each piece (``TURN_BYTES``) is transferred in a turn."""
  flags = fcntl.fcntl(fd, fcntl.F_GETFL)
  try:
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
  except OSError as e:
    if e.errno == errno.EINVAL:
      return 0  # No direct I/O here.
    raise
  done = 0
  piece = CHUNK if turn is no_turn else TURN_BYTES
  try:
    while done < end:
      size = min(end, done + piece) - done
      with turn(size):
        n = transfer(buf[done:done + size], done)
      done += n
      if not n or done % ALIGN:
        break  # The end of the file, or a short transfer left the offset unaligned.
  except OSError as e:
    if e.errno != errno.EINVAL:
      raise  # EINVAL: alignment this device refuses; the rest goes buffered.
  finally:
    fcntl.fcntl(fd, fcntl.F_SETFL, flags)
  return done
