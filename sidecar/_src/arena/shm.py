"""The shared-memory arena: a memfd carved into generation-tagged blocks.

Ownership: the sidecar creates an arena (:meth:`Arena.create`) and owns its
allocator; workers map the same memfd (:meth:`Arena.attach`) after receiving its
file descriptor over a Unix socket. A memfd has no name, so nothing is ever left
in ``/dev/shm``: the memory goes back to the kernel when the last process that
maps it exits, however it exits. A sidecar has one arena, pre-faulted at start, or
with a pool file one per tenant (``server/arenas/arenas.py``), whose pages are made as they
are written (``reserve=False``), all of them within one :class:`Budget`.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import fcntl
import mmap
import os
import re
import secrets
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np

from sidecar._src.core import errors

PAGE = mmap.PAGESIZE
ALIGN = PAGE  # Blocks start on page boundaries: what jax's zero-copy path needs.
MIN_SIZE = 1 << 20
# copy() splits a copy into pieces of this size, dealt round-robin to its threads:
# one thread does not reach the memory bandwidth that two or more do (1 GiB here:
# 0.13-0.15 s with one, 0.08-0.10 s with two threads on 2 cores).
COPY_PIECE = 4 << 20
COPY_THREADS = min(4, len(os.sched_getaffinity(0)))
# What every arena's memfd is sealed with before its fd leaves the sidecar: no process that
# holds the fd (a tenant's worker) can shrink it under the sidecar's mapping (a SIGBUS in
# the sidecar at its next touch of the lost pages) or grow it past its ceiling (memory no
# quota counts), and no one can lift the seals.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
          "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
          "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20,
          "gi": 1 << 30, "gib": 1 << 30, "ti": 1 << 40, "tib": 1 << 40}


def parse_size(text: str | int) -> int:
  """Parses ``"512MiB"``, ``"4G"``, ``"1073741824"`` into bytes."""
  if isinstance(text, int) and not isinstance(text, bool):
    return text
  m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
  if not m or m.group(2).lower() not in _UNITS:
    raise ValueError(f"cannot parse size {text!r}; write e.g. 512MiB, 4GiB or 1073741824")
  return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  raise AssertionError


def shm_size_of(nbytes: float) -> str:
  """``nbytes`` rounded up to whole MiB, as --shm-size (and LocalCluster's shm_size=)
  takes it: ``"41MiB"``."""
  return f"{-(-int(nbytes) // (1 << 20))}MiB"


def _read_int(path: str) -> int | None:
  try:
    with open(path) as f:
      text = f.read().strip()
  except OSError:
    return None
  return None if text == "max" else int(text)


# A container's memory limit and use: cgroup v2, else v1 (whose "no limit" is a huge number).
_CGROUP_MEMORY = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def available_memory() -> tuple[int, str]:
  """Bytes this process can still take, and how that figure was found."""
  meminfo = {}
  with open("/proc/meminfo") as f:
    for line in f:
      key, value = line.split(":", 1)
      meminfo[key] = int(value.split()[0]) * 1024
  avail = meminfo.get("MemAvailable", meminfo["MemFree"])
  how = f"MemAvailable {format_size(avail)}"
  for limit_file, used_file in _CGROUP_MEMORY:
    limit = _read_int(limit_file)
    if limit is not None:
      used = _read_int(used_file) or 0
      if limit - used < avail:
        avail = limit - used
        how = (f"cgroup {os.path.basename(limit_file)} {format_size(limit)} with "
               f"{format_size(used)} in use")
      break
  return max(avail, 0), how


def check_capacity(size: int) -> None:
  """Raises ArenaCapacityError unless the machine can give ``size`` bytes now."""
  if size < MIN_SIZE:
    raise errors.ArenaCapacityError(
        f"shm_size must be at least {format_size(MIN_SIZE)}, got {size!r} bytes")
  avail, how = available_memory()
  if size > avail:
    raise errors.ArenaCapacityError(
        f"the arena needs {format_size(size)} ({size} bytes) but only {format_size(avail)} "
        f"is available ({how}); lower --shm-size or give the sidecar more memory "
        "(on Kubernetes: raise the sidecar container's memory limit above the arena size)")


def boot_id() -> str:
  """Names this kernel: processes that share it can share a memfd."""
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      return f.read().strip()
  except OSError:
    return ""


def _seal(fd: int) -> None:
  """Seals ``fd``'s size for good (:data:`SEALS`); a kernel that cannot seal leaves it
  unsealed, and :func:`check_sealed` then refuses to hand it out."""
  try:
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
  except OSError:
    pass


def sealed(fd: int) -> bool:
  """Whether ``fd`` carries every seal of :data:`SEALS`."""
  try:
    return fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
  except OSError:
    return False


def check_sealed(fd: int) -> None:
  """Raises PermissionDeniedError unless ``fd`` is sealed: an arena whose size a client
  could change is never handed to one."""
  if not sealed(fd):
    raise errors.PermissionDeniedError(
        "this sidecar's arena could not be sealed against resizing (memfd sealing, "
        "F_ADD_SEALS, is missing from this kernel or sandbox), so its file descriptor is "
        "not handed to workers: a worker that resized it could crash the sidecar. Run the "
        "sidecar on Linux 3.17 or later with memfd sealing allowed")


class Arena:
  """A mapped memfd. ``create`` in the sidecar, ``attach`` in a worker.

  ``reserved``: every page was made at creation (mapping it populated costs nothing
  more); an arena made with ``reserve=False`` gets its pages as they are written, and
  a mapping that populated it would make them all.
  """

  def __init__(self, fd: int, size: int, *, populate: bool, reserved: bool = True):
    self.fd = fd
    self.size = size
    self.reserved = reserved
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    self._mmap = mmap.mmap(fd, size, flags=flags)
    self.buffer = np.frombuffer(self._mmap, dtype=np.uint8)
    self._closed = False

  @classmethod
  def create(cls, size: int, *, name: str = "sidecar-arena", reserve: bool = True) -> Arena:
    """Creates and pre-faults an arena, or raises ArenaCapacityError saying why not.

    ``reserve=False``: no page is made now (a pool tenant's arena, sized by its ceiling:
    the bytes its blocks take are counted, and kept within the sidecar's, by
    ``server/arenas/arenas.py``).
    """
    size = -(-size // PAGE) * PAGE
    if reserve:
      check_capacity(size)
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
      os.ftruncate(fd, size)
      if reserve:
        try:  # Reserve every page now: an error here, never a SIGBUS later.
          os.posix_fallocate(fd, 0, size)
        except OSError as e:
          raise errors.ArenaCapacityError(
              f"could not reserve {format_size(size)} of shared memory ({e.strerror}); "
              "lower --shm-size or give the sidecar more memory") from e
      _seal(fd)
      return cls(fd, size, populate=reserve, reserved=reserve)
    except BaseException:
      os.close(fd)
      raise

  @classmethod
  def attach(cls, fd: int, size: int, *, populate: bool = True) -> Arena:
    """Maps an arena whose fd came over a Unix socket; takes ownership of ``fd``.

    ``populate``: map every page now (an arena the sidecar reserved whole); False for
    one whose pages come as they are written (a pool tenant's)."""
    return cls(fd, size, populate=populate, reserved=populate)

  @property
  def sealed(self) -> bool:
    """Whether its memfd can no longer change size, whoever holds the fd: the only kind
    of arena whose fd may leave the sidecar (:func:`check_sealed`)."""
    return sealed(self.fd)

  def resident_bytes(self) -> int:
    """The bytes of memory its pages hold now (written, reserved, not punched out)."""
    return os.fstat(self.fd).st_blocks * 512

  def punch(self, offset: int, nbytes: int) -> None:
    """Gives the pages of ``[offset, offset + nbytes)`` back to the kernel (a hole in the
    memfd, in every process that maps it): the next write there makes them anew, zeroed."""
    if nbytes > 0 and not self._closed:
      self._mmap.madvise(mmap.MADV_REMOVE, offset, nbytes)

  def view(self, offset: int, nbytes: int) -> np.ndarray:
    """A uint8 view of ``[offset, offset + nbytes)``; no copy."""
    if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
      raise errors.InvalidArgumentError(
          f"block [{offset}, {offset + nbytes}) lies outside the arena of {self.size} bytes")
    return self.buffer[offset:offset + nbytes]

  def lease(self, offset: int, nbytes: int, release: Callable[[], None], *,
            private: bool = False) -> np.ndarray:
    """Like :meth:`view`, but calls ``release`` once no array uses the bytes any more.

    Every array derived from the result (views, reshapes, and on the CPU backend
    ``jax.device_put`` of it, which aliases the memory) keeps it alive, so the
    block cannot be reused under a live array.

    ``private``: the bytes through a copy-on-write mapping of their own: reads share the
    block's pages, a write copies the page it touches and never reaches the block (a
    restore's RAM-tier copy, which the sidecar keeps and writes to storage, stays as it
    was however the caller uses what it was given).
    """
    if offset < 0 or nbytes <= 0 or offset + nbytes > self.size:
      raise errors.InvalidArgumentError(
          f"block [{offset}, {offset + nbytes}) lies outside the arena of {self.size} bytes")
    if private:
      start = offset - offset % mmap.ALLOCATIONGRANULARITY
      # Not populated: populating a private writable mapping copies every page.
      mapping = mmap.mmap(self.fd, offset + nbytes - start, flags=mmap.MAP_PRIVATE,
                          offset=start)
      holder = np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=offset - start)
    else:
      holder = np.frombuffer(self._mmap, dtype=np.uint8, count=nbytes, offset=offset)
    weakref.finalize(holder, release)
    return holder

  def contains(self, array: np.ndarray) -> int | None:
    """The offset of ``array``'s data in this arena, or None if it lies elsewhere."""
    start = self.buffer.ctypes.data
    addr = array.__array_interface__["data"][0]
    if start <= addr and addr + array.nbytes <= start + self.size:
      return addr - start
    return None

  def close(self) -> None:
    """Unmaps and closes; idempotent. Views still alive keep the mapping."""
    if self._closed:
      return
    self._closed = True
    self.buffer = None  # type: ignore[assignment]  # a use after close fails loudly
    try:
      self._mmap.close()
    except BufferError:
      pass  # Live views still export the buffer; the mapping goes with them.
    os.close(self.fd)


_copy_threads: concurrent.futures.ThreadPoolExecutor | None = None
_copy_threads_lock = threading.Lock()


def copy(dst: np.ndarray, src: np.ndarray, *, threads: int | None = None) -> None:
  """``np.copyto(dst, src)``, with up to ``COPY_THREADS`` threads (fewer if ``threads``
  says so) when both are C-contiguous, alike and large: the copy into the arena is what a
  caller waits for, and the threads work only while it waits."""
  src = np.asarray(src)
  n = COPY_THREADS if threads is None else max(1, min(threads, COPY_THREADS))
  if (n < 2 or src.nbytes < 2 * COPY_PIECE or dst.shape != src.shape
      or dst.dtype != src.dtype or src.dtype.hasobject
      or not (dst.flags.c_contiguous and src.flags.c_contiguous)):
    np.copyto(dst, src)
    return
  d, s = dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)
  # One iterator for all threads: each takes the next piece, so a thread the scheduler
  # holds back (another process on the core) leaves its share to the others.
  starts = iter(range(0, src.nbytes, COPY_PIECE))

  def pieces() -> None:
    for i in starts:
      np.copyto(d[i:i + COPY_PIECE], s[i:i + COPY_PIECE])

  global _copy_threads
  with _copy_threads_lock:
    if _copy_threads is None:
      _copy_threads = concurrent.futures.ThreadPoolExecutor(COPY_THREADS - 1, "sidecar-copy")
    others = [_copy_threads.submit(pieces) for _ in range(1, n)]
  try:
    pieces()  # the caller's thread takes a share too
  finally:
    for f in others:
      f.result()


def new_generation() -> int:
  """A random 63-bit generation: detects stale references, and cannot be guessed.

  Sequential generations let a client that may name blocks find live ones by trying
  a few dozen numbers; a random one fits the wire's uint64 and JSON alike.
  """
  return secrets.randbits(63) or 1  # 0 never names a block


@dataclasses.dataclass(frozen=True, slots=True)
class Block:
  """An allocated range of an arena; ``generation`` detects stale references.

  ``arena`` names the arena among a sidecar's (``server/arenas/arenas.py``; 0: its only one):
  an offset means nothing without it."""
  offset: int
  nbytes: int
  generation: int
  arena: int = 0


class Budget:
  """The bytes several allocators (a pool's arenas, one per tenant) may hand out together.

  Its condition is theirs: a block freed in one wakes a request waiting in another.
  """

  def __init__(self, size: int):
    self.size = size
    self.used = 0
    self.cond = threading.Condition()


def arena_full(nbytes: int, *, free: int, size: int, waited: float, blocks: int | None = None,
               holds: str = "", advice: str = "release arrays sooner, lower prefetch"
               ) -> errors.ResourceExhaustedError:
  """The error of a request for ``nbytes`` that found no room in the arena within
  ``waited`` s: ``free`` of ``size`` bytes free, in ``blocks`` blocks; ``holds``: what holds
  the rest; ``advice``: what frees it (then: or raise --shm-size)."""
  return errors.ResourceExhaustedError(
      f"the arena is full: {format_size(nbytes)} asked, {format_size(free)} free of "
      f"{format_size(size)}" + (f" in {blocks} blocks" if blocks is not None else "")
      + f" after waiting {waited:.3g} s" + (f"; {holds}" if holds else "")
      + f"; {advice}, or raise --shm-size")


class Allocator:
  """First-fit allocator over ``[0, size)`` with coalescing; waits when full.

  ``budget``: shared with other allocators, whose blocks together stay within its size;
  None: its own, of ``size``. ``arena``: the id its blocks carry.
  """

  def __init__(self, size: int, *, align: int = ALIGN, budget: Budget | None = None,
               arena: int = 0):
    self.size = size
    self._align = align
    self.arena = arena
    self.budget = budget if budget is not None else Budget(size)
    self._cond = self.budget.cond
    self._free_starts: list[int] = [0]   # sorted
    self._free_len: dict[int, int] = {0: size}
    self._used: dict[int, Block] = {}
    self.used_bytes = 0

  def fits(self, nbytes: int) -> bool:
    """Whether a block of ``nbytes`` could ever fit (in an empty arena)."""
    return -(-nbytes // self._align) * self._align <= self.size

  def alloc(self, nbytes: int, *, timeout: float | None = 0.0) -> Block:
    """Allocates ``nbytes`` (rounded up to the alignment).

    Waits up to ``timeout`` seconds (None: forever) for space, then raises
    ResourceExhaustedError. A request larger than the arena fails at once.
    """
    if nbytes <= 0:
      raise errors.InvalidArgumentError(f"nbytes must be positive, got {nbytes!r}")
    need = -(-nbytes // self._align) * self._align
    if not self.fits(nbytes):
      raise errors.ResourceExhaustedError(
          f"a block of {format_size(nbytes)} ({nbytes} bytes) cannot fit an arena of "
          f"{format_size(self.size)}; raise --shm-size")
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._cond:
      while True:
        block = self._take(need)
        if block is not None:
          return block
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
          raise arena_full(nbytes, free=min(self.size - self.used_bytes,
                                            self.budget.size - self.budget.used),
                           size=self.size, waited=timeout or 0.0, blocks=len(self._used))
        self._cond.wait(left)

  def _take(self, need: int) -> Block | None:
    if self.budget.used + need > self.budget.size:
      return None  # the other arenas of the budget hold the rest
    for i, start in enumerate(self._free_starts):
      length = self._free_len[start]
      if length >= need:
        del self._free_starts[i]
        del self._free_len[start]
        if length > need:
          self._free_starts.insert(i, start + need)
          self._free_len[start + need] = length - need
        block = Block(start, need, new_generation(), self.arena)
        self._used[start] = block
        self.used_bytes += need
        self.budget.used += need
        return block
    return None

  def check(self, offset: int, generation: int) -> Block:
    """The live block at ``offset`` if its generation matches, else StaleDescriptorError."""
    with self._cond:
      block = self._used.get(offset)
    if block is None or block.generation != generation:
      raise errors.StaleDescriptorError(
          f"arena block at offset {offset} generation {generation} is no longer allocated; "
          "a descriptor was used after its block was released")
    return block

  def free(self, offset: int, generation: int) -> None:
    with self._cond:
      block = self._used.get(offset)
      if block is None or block.generation != generation:
        raise errors.StaleDescriptorError(
            f"arena block at offset {offset} generation {generation} was already freed")
      del self._used[offset]
      self.used_bytes -= block.nbytes
      self.budget.used -= block.nbytes
      start, length = offset, block.nbytes
      i = bisect.bisect_left(self._free_starts, start)
      if i < len(self._free_starts) and start + length == self._free_starts[i]:
        length += self._free_len.pop(self._free_starts.pop(i))
      if i > 0:
        prev = self._free_starts[i - 1]
        if prev + self._free_len[prev] == start:
          self._free_len[prev] += length
          self._cond.notify_all()
          return
      self._free_starts.insert(i, start)
      self._free_len[start] = length
      self._cond.notify_all()

  def punch_free(self, punch: Callable[[int, int], None]) -> int:
    """Calls ``punch(offset, nbytes)`` on each free range, holding the lock (no block is
    taken from a range while its pages go); returns the bytes free."""
    with self._cond:
      for start in self._free_starts:
        punch(start, self._free_len[start])
      return self.size - self.used_bytes

  @property
  def num_blocks(self) -> int:
    return len(self._used)

  @property
  def top(self) -> int:
    """The end of its highest block (0: none): no block was made above it since."""
    with self._cond:
      last = self._free_starts[-1] if self._free_starts else None
      if last is not None and last + self._free_len[last] == self.size:
        return last
      return self.size
