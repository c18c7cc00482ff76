"""jax.checkpoint: a JAX tree's leaves as Orbax names them, its shards to save, restore targets.

Real CPU devices, no sockets.
"""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding
from orbax.checkpoint._src.metadata import sharding as sharding_metadata

from sidecar._src.core import errors
from sidecar._src.jax import checkpoint as jax_checkpoint

pytestmark = pytest.mark.unit


def _mesh(shape, names):
  return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


@pytest.mark.parametrize("sharding", [
    lambda: NamedSharding(_mesh((4,), ("data",)), P("data")),
    lambda: NamedSharding(_mesh((2, 2), ("a", "b")), P(("a", "b"))),
    lambda: NamedSharding(_mesh((2, 2), ("a", "b")), P(None, "b")),
    lambda: NamedSharding(_mesh((2, 2), ("a", "b")), P()),
    lambda: NamedSharding(Mesh(np.array(jax.devices()[3:1:-1]), ("x",)), P("x")),
    lambda: SingleDeviceSharding(jax.devices()[1]),
], ids=["1d", "2d-tuple", "2d-none", "replicated", "reversed-devices", "single-device"])
def test_serialized_sharding_is_orbaxs_byte_for_byte(sharding):
  s = sharding()
  want = sharding_metadata.from_jax_sharding(s).to_serialized_string()
  assert jax_checkpoint.serialized_sharding(s) == want
  # And Orbax reads it back as the same sharding.
  back = sharding_metadata.from_serialized_string(want).to_jax_sharding()
  assert back == s or back.device_set == s.device_set




def test_key_paths_are_orbaxs_names():
  tree = {"opt": [{"mu": np.zeros(2)}, np.ones(1)], "w": np.zeros(3)}
  leaves = jax_checkpoint.save_leaves(tree)
  assert [leaf.spec.key_path for leaf in leaves] == [("opt", 0, "mu"), ("opt", 1), ("w",)]
  assert [leaf.spec.param_name for leaf in leaves] == ["opt.0.mu", "opt.1", "w"]


def test_a_sharded_array_saves_only_its_replica_0_shards_with_their_devices():
  mesh = _mesh((2, 2), ("data", "model"))
  x = jax.device_put(np.arange(16.0).reshape(4, 4), NamedSharding(mesh, P("data")))
  (leaf,) = jax_checkpoint.save_leaves({"x": x})
  # Rows split over "data", replicated over "model": 2 of the 4 device shards are saved.
  assert sorted(s.record.index for s in leaf.shards) == [((0, 2), (0, 4)), ((2, 4), (0, 4))]
  by_device = {s.device.id: s for s in x.addressable_shards}
  for s in leaf.shards:
    assert by_device[s.device_id].replica_id == 0
    (a, b), _ = s.record.index
    np.testing.assert_array_equal(s.data, np.asarray(x)[a:b])
    # Its record, made by the adapter: the core only chooses its host.
    assert (s.record.key_path, s.record.leaf, s.record.host) == (("x",), 0, None)
    assert (s.record.dtype, s.record.shape, s.record.nbytes) == ("float32", (2, 4), 32)
  assert leaf.spec.write_shape == (2, 4) and leaf.spec.sharding is not None


def test_host_values_are_saved_whole_with_no_device():
  (a, b) = jax_checkpoint.save_leaves({"a": np.zeros((2, 3), np.int8), "b": 7})
  assert [(s.record.index, s.device_id) for s in a.shards] == [(((0, 2), (0, 3)), None)]
  assert (b.spec.kind, b.shards[0].record.index, b.shards[0].record.leaf) == ("scalar", (), 1)


@pytest.mark.parametrize("tree,match", [
    ({}, "no leaves to save"), (np.zeros(2), "not a bare ndarray"),
    ({"s": "text"}, "cannot checkpoint a str; expected a jax.Array"),
], ids=["empty", "bare", "str-leaf"])
def test_trees_that_cannot_be_saved_are_refused(tree, match):
  with pytest.raises(errors.InvalidArgumentError, match=match):
    jax_checkpoint.save_leaves(tree)


def test_a_restore_target_fills_each_addressable_device_then_builds_global_arrays():
  mesh = _mesh((4,), ("data",))
  sharding = NamedSharding(mesh, P("data"))
  target = {"x": jax.ShapeDtypeStruct((8, 2), np.float32, sharding=sharding),
            "n": np.zeros((), np.int32)}
  wanted = jax_checkpoint.restore_target(target)
  n, x = wanted.leaves  # dict keys in sorted order
  assert (n.key_path, n.blocks) == (("n",), (((), None),))
  assert x.dtype == np.float32 and len(x.blocks) == 4
  full = np.arange(16, dtype=np.float32).reshape(8, 2)
  blocks = [[full[a:b] for ((a, b), _), _ in x.blocks]]
  out = wanted.build([[np.array(5, np.int32)], *blocks])
  assert out["n"] == 5 and out["x"].sharding == sharding
  np.testing.assert_array_equal(np.asarray(out["x"]), full)
