"""The checksum a host reports for each shard it writes, and the values that carry it."""

import dataclasses

import crc32c
import ml_dtypes
import numpy as np
import pytest

from sidecar._src.ckptfmt.records import ShardId, ShardRecord, Staged
from sidecar._src.ckptfmt.shards import shard_crc32c

pytestmark = pytest.mark.unit

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


@pytest.mark.parametrize("value", [
    ShardRecord(ShardId(("w",), ((0, 2),)), 0, 0, "float64", (2,), 16, crc32c=1),
    Staged(ShardRecord.of(ShardId(("w",), ((0, 2),)), 0, np.zeros(2)), np.zeros(2)),
], ids=["record", "staged"])
def test_the_values_are_frozen(value):
  field = dataclasses.fields(value)[0].name
  with pytest.raises(dataclasses.FrozenInstanceError):
    setattr(value, field, None)
