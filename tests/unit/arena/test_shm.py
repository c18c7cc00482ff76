import concurrent.futures
import os
import threading
import time

import numpy as np
import pytest

from sidecar._src.arena import shm
from sidecar._src.core import errors
from tests.support.leaks import shm_entries

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("text,expected", [
    ("512MiB", 512 << 20), ("4GiB", 4 << 30), ("1G", 10**9), ("1073741824", 1 << 30),
    ("1.5KiB", 1536), (2048, 2048)], ids=str)
def test_parse_size(text, expected):
  assert shm.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "12 parsecs", "-3MiB", "GiB"])
def test_parse_size_rejects(text):
  with pytest.raises(ValueError, match="cannot parse size"):
    shm.parse_size(text)


def test_capacity_check_names_sizes_and_fix():
  with pytest.raises(errors.ArenaCapacityError,
                     match=r"needs .* but only .* available .*--shm-size"):
    shm.check_capacity(1 << 50)
  with pytest.raises(errors.ArenaCapacityError, match="at least"):
    shm.check_capacity(4096)


def test_arena_is_a_memfd_not_a_dev_shm_file():
  before = shm_entries()
  arena = shm.Arena.create(4 << 20)
  try:
    assert shm_entries() == before
    assert os.readlink(f"/proc/self/fd/{arena.fd}").startswith("/memfd:sidecar-arena")
    arena.buffer[:3] = [1, 2, 3]
    other = shm.Arena.attach(os.dup(arena.fd), arena.size)
    assert other.buffer[:3].tolist() == [1, 2, 3]  # same memory through another mapping
    other.close()
  finally:
    arena.close()
  arena.close()  # idempotent


def test_lease_releases_when_last_view_dies():
  arena = shm.Arena.create(2 << 20)
  released = []
  holder = arena.lease(4096, 4096, lambda: released.append(True))
  view = holder.view(np.float32).reshape(32, 32)[1:]
  del holder
  assert released == []
  del view
  assert released == [True]
  arena.close()


def test_allocator_aligns_and_coalesces():
  a = shm.Allocator(16 * shm.ALIGN)
  b1 = a.alloc(1)
  b2 = a.alloc(shm.ALIGN + 1)
  b3 = a.alloc(shm.ALIGN)
  assert [b.offset for b in (b1, b2, b3)] == [0, shm.ALIGN, 3 * shm.ALIGN]
  assert b2.nbytes == 2 * shm.ALIGN
  a.free(b2.offset, b2.generation)
  a.free(b1.offset, b1.generation)
  a.free(b3.offset, b3.generation)
  assert a.used_bytes == 0 and a.num_blocks == 0
  whole = a.alloc(16 * shm.ALIGN)  # coalesced back into one range
  assert whole.offset == 0


def test_allocator_generations_detect_stale_descriptors():
  a = shm.Allocator(4 * shm.ALIGN)
  b = a.alloc(10)
  a.free(b.offset, b.generation)
  again = a.alloc(10)
  assert again.offset == b.offset and again.generation != b.generation
  with pytest.raises(errors.StaleDescriptorError, match="no longer allocated"):
    a.check(b.offset, b.generation)
  with pytest.raises(errors.StaleDescriptorError, match="already freed"):
    a.free(b.offset, b.generation)
  assert a.check(again.offset, again.generation) == again


def test_allocator_generations_cannot_be_guessed():
  a = shm.Allocator(4 * shm.ALIGN)
  generations = []
  for _ in range(50):  # the same offset each time: only the generation tells them apart
    b = a.alloc(10)
    generations.append(b.generation)
    a.free(b.offset, b.generation)
  assert len(set(generations)) == 50 and all(0 < g < 1 << 63 for g in generations)
  steps = {y - x for x, y in zip(generations, generations[1:])}
  assert len(steps) > 1 and max(generations) > 1 << 40  # no counter to step through


def test_allocator_too_big_fails_at_once_with_sizes():
  a = shm.Allocator(4 * shm.ALIGN)
  with pytest.raises(errors.ResourceExhaustedError, match=r"cannot fit an arena of .*--shm-size"):
    a.alloc(5 * shm.ALIGN, timeout=None)


def test_allocator_full_waits_then_errors():
  import threading
  import time
  a = shm.Allocator(2 * shm.ALIGN)
  b = a.alloc(2 * shm.ALIGN)
  t0 = time.monotonic()
  with pytest.raises(errors.ResourceExhaustedError, match="arena is full.*after waiting"):
    a.alloc(shm.ALIGN, timeout=0.2)
  assert time.monotonic() - t0 >= 0.2
  threading.Timer(0.1, a.free, (b.offset, b.generation)).start()
  assert a.alloc(shm.ALIGN, timeout=5).offset == 0  # woken by the free


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_copy_in_pieces_is_exact(monkeypatch, threads):
  monkeypatch.setattr(shm, "COPY_PIECE", 4096)
  monkeypatch.setattr(shm, "COPY_THREADS", threads)
  monkeypatch.setattr(shm, "_copy_threads", None)
  # 36 pieces + a tail
  src = np.random.default_rng(0).standard_normal((37, 1000)).astype(np.float32)
  dst = np.zeros_like(src)
  shm.copy(dst, src)
  np.testing.assert_array_equal(dst, src)


def test_copy_leaves_a_held_back_thread_s_share_to_the_others(monkeypatch):
  # The pool's one thread is busy elsewhere (as when another process has its core): the
  # caller's thread takes every piece instead of waiting for that thread's half.
  monkeypatch.setattr(shm, "COPY_PIECE", 4096)
  monkeypatch.setattr(shm, "COPY_THREADS", 2)
  pool = concurrent.futures.ThreadPoolExecutor(1, "test-copy")
  monkeypatch.setattr(shm, "_copy_threads", pool)
  src = np.random.default_rng(1).standard_normal((40, 1000)).astype(np.float32)
  dst = np.zeros_like(src)
  started = threading.Event()

  def busy() -> bool:  # holds the pool's thread until the copy is whole, or 5 s
    started.set()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
      if np.array_equal(dst, src):
        return True
      time.sleep(0.01)
    return False

  held = pool.submit(busy)
  started.wait(5)
  shm.copy(dst, src)
  try:
    assert held.result(), "the caller left the held-back thread's pieces undone"
    np.testing.assert_array_equal(dst, src)
  finally:
    pool.shutdown()


def test_copy_with_one_thread_asked_uses_the_callers_only(monkeypatch):
  class NoPool:
    def submit(self, *args):
      raise AssertionError("a copy asked to use one thread used the pool")
  monkeypatch.setattr(shm, "COPY_PIECE", 4096)
  monkeypatch.setattr(shm, "COPY_THREADS", 4)
  monkeypatch.setattr(shm, "_copy_threads", NoPool())
  src = np.random.default_rng(2).standard_normal((40, 1000)).astype(np.float32)
  dst = np.zeros_like(src)
  shm.copy(dst, src, threads=1)
  np.testing.assert_array_equal(dst, src)
  with pytest.raises(AssertionError, match="used the pool"):
    shm.copy(dst, src, threads=2)


def test_copy_of_strided_or_other_dtype_copies_as_copyto(monkeypatch):
  monkeypatch.setattr(shm, "COPY_PIECE", 4096)
  monkeypatch.setattr(shm, "COPY_THREADS", 2)
  src = np.arange(40000, dtype=np.int64).reshape(200, 200)
  dst = np.zeros((200, 200), np.float32)
  shm.copy(dst, src.T)  # neither C-contiguous nor of dst's dtype: np.copyto's rules
  np.testing.assert_array_equal(dst, src.T.astype(np.float32))
  with pytest.raises(ValueError):
    shm.copy(np.zeros((3, 3)), np.zeros((2, 2)))


@pytest.mark.parametrize("version,limit_file,used_file", [
    ("v2", "memory.max", "memory.current"),
    ("v1", "memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")], ids=str)
def test_a_container_memory_limit_below_the_arena_names_it(tmp_path, monkeypatch, version,
                                                           limit_file, used_file):
  # A fake cgroup file system, as a container with a 64 MiB memory limit sees it.
  (tmp_path / "memory").mkdir()
  (tmp_path / limit_file).write_text(f"{64 << 20}\n")
  (tmp_path / used_file).write_text(f"{16 << 20}\n")
  tables = {"v2": (tmp_path / "memory.max", tmp_path / "memory.current"),
            "v1": (tmp_path / "memory/memory.limit_in_bytes",
                   tmp_path / "memory/memory.usage_in_bytes")}
  monkeypatch.setattr(shm, "_CGROUP_MEMORY", (tuple(map(str, tables[version])),))
  assert shm.available_memory()[0] == 48 << 20
  with pytest.raises(errors.ArenaCapacityError,
                     match=rf"needs 128.0 MiB .* only 48.0 MiB is available \(cgroup "
                           rf"{os.path.basename(limit_file)} 64.0 MiB with 16.0 MiB in use\); "
                           r"lower --shm-size"):
    shm.check_capacity(128 << 20)


@pytest.mark.parametrize("reserve", [True, False], ids=["reserved", "pool-tenant"])
def test_an_arena_is_sealed_against_resizing(reserve):
  arena = shm.Arena.create(2 << 20, reserve=reserve)
  try:
    assert arena.sealed
    shm.check_sealed(arena.fd)  # what may leave the sidecar
    with pytest.raises(PermissionError):
      os.ftruncate(arena.fd, 0)
  finally:
    arena.close()


def test_an_unsealed_memfd_is_never_handed_out():
  fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
  try:
    with pytest.raises(errors.PermissionDeniedError, match="could not be sealed against resizing"):
      shm.check_sealed(fd)
  finally:
    os.close(fd)
