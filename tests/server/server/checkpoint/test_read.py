"""Tier 2: a RAM-tier copy is checked against its crc32c at every restore (issue 42,
attack 9), not once: a Worker that maps the arena can write it after a restore checked it.

The bytes are zeroed through the trainer's own Worker mapping, in process, as the
attacker's mapping of the whole arena did.
"""

import pathlib

import jax
import numpy as np
import pytest

import sidecar
from sidecar._src.core import errors
from tests.support.procfs import ARENA_FILE, mapping_of

pytestmark = pytest.mark.server

N = 1 << 14


def zero_ram_copy(server, ctl, final_dir: str) -> None:
  """Zeroes every byte of step ``final_dir``'s RAM-tier shards through ``ctl``'s Worker."""
  step = server.checkpoints.tier.find(final_dir)
  base = server.arena.buffer.ctypes.data
  mapped = ctl.worker(0).arena.buffer  # the Worker's own mapping of the whole arena
  for data in step.shards.values():
    offset = data.ctypes.data - base
    mapped[offset:offset + data.nbytes] = 0
    assert not data.any()  # the sidecar's view of the block sees it


@pytest.fixture
def saved(make_server, tmp_path):
  """A server and a Controller whose Worker maps its arena, with step 1 of ``{"w": w}``
  saved and restored once from the RAM tier (which checked the copy)."""
  server = make_server()
  directory = tmp_path / "ck"
  w = np.arange(1, N + 1, dtype=np.float32)
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], timeout=10) as ctl:
    assert ctl.worker(0) is not None
    with ctl.checkpointer(str(directory)) as ckpt:
      assert ckpt.save(1, {"w": w}).durable.result(30) == 1
      first = ckpt.restore(1, target={"w": np.zeros(N, np.float32)})["w"]
      np.testing.assert_array_equal(np.asarray(first), w)
      del first
      yield server, ctl, ckpt, directory, w


def test_a_ram_copy_zeroed_after_a_restore_is_read_from_storage(saved):
  """Before: the second restore returned 65,536 zero bytes, no error."""
  server, ctl, ckpt, directory, w = saved
  final_dir = str(directory / "1" / "default")
  zero_ram_copy(server, ctl, final_dir)
  for _ in range(2):  # each restore checks again, and falls back again
    back = ckpt.restore(1, target={"w": np.zeros(N, np.float32)})["w"]
    np.testing.assert_array_equal(np.asarray(back), w)
    del back
  # The sidecar's own reads: tier "ram" refuses the copy, "any" reads storage instead.
  (record,) = server.checkpoints.info(final_dir).shards  # as the save wrote it
  with pytest.raises(errors.CorruptCheckpointError, match="ram copy on host 0"):
    server.checkpoints.read(final_dir, record, "ram")
  np.testing.assert_array_equal(server.checkpoints.read(final_dir, record, "any"), w)
  # Unchecked (a caller that checks the copy itself): the copy as it is.
  assert not server.checkpoints.read(final_dir, record, "ram", checked=False).any()


def test_a_zeroed_ram_copy_already_on_its_way_to_the_devices_is_put_again_from_storage(saved):
  """The trainer checks the copies its Worker maps while their transfers go on (issue 44):
  a sharded target's leaf put from the zeroed copy is put again from storage."""
  server, ctl, ckpt, directory, w = saved
  zero_ram_copy(server, ctl, str(directory / "1" / "default"))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  back = ckpt.restore(1, target={"w": jax.ShapeDtypeStruct((N,), np.float32,
                                                           sharding=sharding)})["w"]
  assert isinstance(back, jax.Array) and back.sharding == sharding
  np.testing.assert_array_equal(np.asarray(back), w)
  assert ckpt.last_restore_stats().shards == {"storage": 1}


def test_a_ram_copy_zeroed_with_no_valid_stored_copy_fails_the_restore(saved):
  """The stored chunk is zeroed too: no copy is valid, and the restore says so."""
  server, ctl, ckpt, directory, _ = saved
  final_dir = pathlib.Path(directory / "1" / "default")
  zero_ram_copy(server, ctl, str(final_dir))
  chunks = [p for p in (final_dir / "w").rglob("*")
            if p.is_file() and not p.name.startswith(".")]
  assert chunks
  for p in chunks:
    p.write_bytes(bytes(p.stat().st_size))
  with pytest.raises(errors.ShardsLostError, match="crc32c") as info:
    ckpt.restore(1, target={"w": np.zeros(N, np.float32)})
  assert "ram:host0" in str(info.value) and "storage" in str(info.value)


def test_a_restored_array_written_in_place_leaves_the_ram_copy_as_it_was(saved):
  """Before: the restored array was the RAM-tier block itself: writing it (as training
  does to its state) wrote the sidecar's copy, and the next restore found it corrupt."""
  server, ctl, ckpt, directory, w = saved
  got = ckpt.restore(1, target={"w": np.zeros(N, np.float32)})["w"]
  assert ckpt.last_restore_stats().shards == {"ram:host0": 1}
  assert mapping_of(got.ctypes.data) == ("rw-p", ARENA_FILE)  # no copy: copy-on-write
  got[:] = -1  # the caller's own pages from here on
  step = server.checkpoints.tier.find(str(directory / "1" / "default"))
  np.testing.assert_array_equal(next(iter(step.shards.values())).view(np.float32), w)
  back = ckpt.restore(1, target={"w": np.zeros(N, np.float32)})["w"]
  assert ckpt.last_restore_stats().shards == {"ram:host0": 1}
  np.testing.assert_array_equal(back, w)
  assert (got == -1).all()


def test_a_restored_torch_tensor_trained_in_place_leaves_the_ram_copy_as_it_was(
    make_server, tmp_path):
  import torch

  import sidecar.torch
  server = make_server()
  w = torch.arange(1, N + 1, dtype=torch.float32)
  with sidecar.torch.Controller([f"127.0.0.1:{server.port}"], timeout=10) as ctl, \
       ctl.checkpointer(str(tmp_path / "ck")) as ckpt:
    assert ckpt.save(1, {"w": w}).durable.result(30) == 1
    got = ckpt.restore(1, target={"w": torch.zeros(N)})["w"]
    got.mul_(0)  # in place, as an optimizer step changes its parameters
    assert not got.any()
    back = ckpt.restore(1, target={"w": torch.zeros(N)})["w"]
    assert ckpt.last_restore_stats().shards == {"ram:host0": 1}
    assert torch.equal(back, w)
