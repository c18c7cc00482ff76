"""Tier 1: host arrays onto devices, the fast path against jax.device_put."""

import mmap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sidecar._src.jax import transfer

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("x", [
    np.arange(24, dtype=np.float32).reshape(2, 3, 4),
    np.arange(5, dtype=np.int64),  # canonicalised like device_put (int32 without x64)
    np.array([True, False]),
    np.ones((3,), ml_dtypes.bfloat16),
    np.zeros((0, 4), np.uint8),
    np.arange(10, dtype=np.int16)[::2],  # not contiguous
    np.float32(2.5),  # a numpy scalar takes the public path
])
def test_put_is_device_put(x):
  device = jax.devices()[2]
  got, want = transfer.put(x, device), jax.device_put(x, device)
  assert isinstance(got, jax.Array)
  assert (got.shape, got.dtype, got.devices(), got.committed) == (
      want.shape, want.dtype, want.devices(), want.committed)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_put_of_a_page_aligned_array_aliases_it_on_cpu():
  mm = mmap.mmap(-1, 1 << 20)
  host = np.frombuffer(mm, np.float32, count=1024)
  x = transfer.put(host, jax.devices()[0])
  assert x.unsafe_buffer_pointer() == host.ctypes.data
  host[7] = 42.0
  assert float(x[7]) == 42.0
  del x, host


def test_to_devices_moves_array_leaves_only():
  device = jax.devices()[1]
  tree = {"a": np.ones(3, np.float32), "n": 7, "s": "text", "j": jnp.zeros(2)}
  out = transfer.to_devices(tree, device)
  assert out["a"].devices() == {device} and isinstance(out["a"], jax.Array)
  assert out["n"] == 7 and out["s"] == "text" and out["j"] is tree["j"]


def test_global_array_matches_device_put_with_the_sharding():
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
  sharding = NamedSharding(mesh, P("data", "model"))
  full = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
  index = sharding.addressable_devices_indices_map(full.shape)
  devices = list(index)
  got = transfer.global_array(full.shape, sharding, [full[index[d]] for d in devices], devices)
  want = jax.device_put(full, sharding)
  assert got.sharding == want.sharding
  np.testing.assert_array_equal(np.asarray(got), full)
  for a, b in zip(got.addressable_shards, want.addressable_shards):
    np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))


def test_put_many_wants_one_device_per_array():
  with pytest.raises(ValueError):
    transfer.put_many([np.ones(2)], jax.devices()[:2])


def test_release_dropped_lets_go_of_the_view_a_dropped_array_aliased():
  """JAX holds the host array a dropped jax.Array aliased until its next call into XLA
  (or a garbage collection); release_dropped() carries that out at once, so a restore's
  reads find the blocks of trees dropped before it free."""
  import gc
  import weakref
  mm = mmap.mmap(-1, 1 << 20)
  freed = []
  host = np.frombuffer(mm, np.float32, count=1024)
  weakref.finalize(host, freed.append, True)
  x = transfer.put(host, jax.devices()[0])
  x.block_until_ready()
  del host
  gc.disable()
  try:
    del x
    assert freed == []  # what the fix is for: dropped, yet still held
    transfer.release_dropped()
    assert freed == [True]
  finally:
    gc.enable()


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 1, 0, 2]], ids=["in-order", "shuffled"])
def test_global_array_of_numpy_blocks_in_any_device_order_is_device_put(order):
  mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
  sharding = NamedSharding(mesh, P("data"))
  full = np.arange(8 * 3, dtype=np.int64).reshape(8, 3)  # canonicalised: int32 without x64
  index = sharding.addressable_devices_indices_map(full.shape)
  devices = [list(index)[i] for i in order]
  got = transfer.global_array(full.shape, sharding, [full[index[d]] for d in devices], devices)
  want = jax.device_put(full, sharding)
  assert (got.shape, got.dtype, got.sharding, got.committed) == (
      want.shape, want.dtype, want.sharding, want.committed)
  for s in got.addressable_shards:
    np.testing.assert_array_equal(np.asarray(s.data), full[index[s.device]])
  np.testing.assert_array_equal(np.asarray(got), full)


def test_global_array_of_a_block_of_the_wrong_shape_is_refused():
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
  sharding = NamedSharding(mesh, P("data"))
  blocks = [np.zeros((4, 3), np.float32), np.zeros((3, 3), np.float32)]
  with pytest.raises(ValueError):
    transfer.global_array((8, 3), sharding, blocks, jax.devices()[:2])
