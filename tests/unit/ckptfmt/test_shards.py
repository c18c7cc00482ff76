"""The values a host writes and the checksum it reports for each shard."""

import dataclasses

import crc32c
import ml_dtypes
import numpy as np
import pytest

from sidecar._src.ckptfmt import spec as layout_spec
from sidecar._src.ckptfmt.records import ShardChecksum
from sidecar._src.ckptfmt.shards import HostLeaf, Shard, shard_crc32c

pytestmark = pytest.mark.unit

SPEC = layout_spec.LeafSpec(key_path=("w",), shape=(4,), dtype=np.float32)


def test_the_checksum_is_crc32c_castagnoli():
  assert shard_crc32c(np.frombuffer(b"123456789", np.uint8)) == 0xE3069283


@pytest.mark.parametrize("data", [
    np.arange(12, dtype=np.float32).reshape(3, 4).T,
    np.arange(24, dtype=np.int64).reshape(4, 6)[::2, 1:4],
    np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16),
    np.asarray(np.float64(0.25)),
], ids=["transposed", "strided", "bfloat16", "scalar"])
def test_the_checksum_is_of_the_c_order_bytes(data):
  """What is written (and read back) is C-order: any view's checksum matches it."""
  assert shard_crc32c(data) == crc32c.crc32c(np.ascontiguousarray(data).tobytes())


def test_a_host_leaf_keeps_its_shards_as_a_tuple():
  shards = [Shard((slice(0, 2),), np.zeros(2, np.float32)), Shard(((2, 4),), np.ones(2, np.float32))]
  leaf = HostLeaf(SPEC, shards)
  shards.clear()
  assert isinstance(leaf.shards, tuple) and len(leaf.shards) == 2
  assert HostLeaf(SPEC).shards == ()


@pytest.mark.parametrize("value", [
    Shard(((0, 2),), np.zeros(2)), HostLeaf(SPEC), ShardChecksum(("w",), ((0, 2),), 8, 1),
], ids=["shard", "host-leaf", "checksum"])
def test_the_values_are_frozen(value):
  field = dataclasses.fields(value)[0].name
  with pytest.raises(dataclasses.FrozenInstanceError):
    setattr(value, field, None)
