"""Tier 1: durable file writes, direct from page-aligned memory, buffered otherwise."""

import contextlib
import mmap
import os

import ml_dtypes
import numpy as np
import pytest

from sidecar._src.ckptfmt import direct_io

pytestmark = pytest.mark.unit


def aligned(nbytes):
  """Page-aligned memory, as an arena block is."""
  return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), np.uint8, count=nbytes)


@pytest.mark.parametrize("nbytes", [direct_io.ALIGN, 3 * direct_io.ALIGN + 100, (5 << 20) + 7])
def test_page_aligned_data_goes_direct_and_the_tail_buffered(tmp_path, nbytes):
  data = aligned(nbytes)
  data[:] = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
  path = tmp_path / "chunk"
  direct = direct_io.write_file(path, data)
  assert path.read_bytes() == data.tobytes()
  # This checkout's disk (ext4) takes O_DIRECT; the tail under a page never can.
  assert direct == nbytes - nbytes % direct_io.ALIGN


@pytest.mark.parametrize("data", [
    np.arange(1000, dtype=np.float32),  # heap memory: not page-aligned
    np.arange(100, dtype=np.int64).reshape(10, 10)[:, ::2],  # not contiguous
    np.ones((3, 3), ml_dtypes.bfloat16),
    np.zeros((0,), np.uint8),
    np.array(2.5),
])
def test_any_array_is_written_as_its_c_order_bytes(tmp_path, data):
  path = tmp_path / "chunk"
  direct_io.write_file(path, data)
  assert path.read_bytes() == np.ascontiguousarray(data).tobytes()


@pytest.mark.parametrize("offset", [0, 1], ids=["direct", "buffered"])
def test_with_turns_each_piece_is_written_in_a_turn(tmp_path, offset):
  """A pool tenant's write takes a turn per TURN_BYTES, direct or buffered (memory that is
  not page-aligned, or a file system without direct I/O), and the tail under a page."""
  n = direct_io.TURN_BYTES + (4 << 20) + 100
  data = aligned(n + offset)[offset:]
  data[:] = 3
  turns = []

  def turn(nbytes):
    turns.append(nbytes)
    return contextlib.nullcontext()

  direct_io.write_file(tmp_path / "chunk", data, turn)
  assert (tmp_path / "chunk").read_bytes() == data.tobytes()
  assert sum(turns) == n and max(turns) == direct_io.TURN_BYTES
  assert turns[-1] == (100 if offset == 0 else (4 << 20) + 100)


def test_a_file_system_without_direct_io_gets_buffered_writes():
  if not os.path.isdir("/dev/shm"):
    pytest.fail("this test needs /dev/shm (tmpfs)")
  data = aligned(1 << 20)
  data[:] = 7
  path = f"/dev/shm/sidecar-direct-io-test-{os.getpid()}"
  try:
    direct_io.write_file(path, data)  # tmpfs refuses O_DIRECT on older kernels
    with open(path, "rb") as f:
      assert f.read() == data.tobytes()
  finally:
    os.unlink(path)


def test_an_existing_file_is_replaced_and_errors_are_raised(tmp_path):
  path = tmp_path / "chunk"
  path.write_bytes(b"x" * 10_000)
  direct_io.write_file(path, aligned(direct_io.ALIGN))
  assert path.read_bytes() == bytes(direct_io.ALIGN)
  with pytest.raises(FileNotFoundError):
    direct_io.write_file(tmp_path / "missing" / "chunk", np.ones(4))


@pytest.mark.parametrize("nbytes", [100, direct_io.ALIGN, 3 * direct_io.ALIGN + 100, (5 << 20) + 7])
@pytest.mark.parametrize("memory", ["aligned", "heap"])
def test_read_file_fills_the_array_with_the_file(tmp_path, nbytes, memory):
  data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
  path = tmp_path / "chunk"
  path.write_bytes(data.tobytes())
  out = aligned(nbytes) if memory == "aligned" else np.empty(nbytes + 1, np.uint8)[1:]
  assert direct_io.read_file(path, out) == nbytes
  assert out.tobytes() == data.tobytes()


def test_read_file_reports_a_short_file_and_reads_no_more_than_asked(tmp_path):
  path = tmp_path / "chunk"
  path.write_bytes(bytes(range(256)) * 40)  # 10240 bytes: 2.5 pages
  out = aligned(4 * direct_io.ALIGN)
  assert direct_io.read_file(path, out) == 10240
  assert out[:10240].tobytes() == path.read_bytes()
  small = aligned(direct_io.ALIGN)
  assert direct_io.read_file(path, small) == direct_io.ALIGN
  assert small.tobytes() == path.read_bytes()[:direct_io.ALIGN]
  with pytest.raises(ValueError, match="C-contiguous"):
    direct_io.read_file(path, np.zeros((4, 4), np.uint8)[:, ::2])
  with pytest.raises(FileNotFoundError):
    direct_io.read_file(tmp_path / "missing", small)


def test_a_write_that_fails_names_its_file_and_errno(tmp_path):
  """pwrite and fsync name no file; the error of a chunk written to a full disk does."""
  import errno
  path = tmp_path / "0.0"
  path.symlink_to("/dev/full")  # every write fails with ENOSPC
  with pytest.raises(OSError) as raised:
    direct_io.write_file(path, np.ones(4096, np.uint8))
  assert (raised.value.errno, raised.value.filename) == (errno.ENOSPC, str(path))
