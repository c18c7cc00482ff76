"""The frozen records of the Checkpoint service, a shard's checksum, and the manifest's file."""

import dataclasses

import crc32c
import ml_dtypes
import numpy as np
import pytest

from sidecar._src.ckptfmt.records import (
  Manifest,
  SavedLeaf,
  ShardId,
  ShardRecord,
  Staged,
  shard_crc32c,
)
from sidecar._src.ckptfmt.spec import LeafSpec
from sidecar._src.core import errors

pytestmark = pytest.mark.unit


def test_records_are_frozen():
  shard = ShardId(("a", 0), ((0, 2),))
  with pytest.raises(dataclasses.FrozenInstanceError):
    shard.index = ()  # type: ignore[misc]
  key_path, index = shard  # unpacks as the (key_path, index) tuples it replaces
  assert (key_path, index) == (("a", 0), ((0, 2),))
  record = ShardRecord(shard, 0, 1, "float32", (2,), 8)
  assert (record.key_path, record.index, record.crc32c) == (shard.key_path, shard.index, None)
  assert record.with_crc32c(5) == dataclasses.replace(record, crc32c=5)
  data = np.arange(2, dtype=np.float32)
  assert record.with_crc32c_of(data) == record.with_crc32c(shard_crc32c(data))


def test_a_record_is_made_of_its_bytes():
  """dtype, shape and size from the array (or a device copy on its way), no checksum yet."""
  r = ShardRecord.of(ShardId(("w",), ((0, 2), (0, 3))), 4, np.zeros((2, 3), np.int16), host=2)
  assert r == ShardRecord(ShardId(("w",), ((0, 2), (0, 3))), 4, 2, "int16", (2, 3), 12)
  dcp = ShardRecord.of(ShardId(("m.w",), ()), 0, np.zeros(5, np.uint8), rank=3)
  assert (dcp.rank, dcp.host, dcp.shape) == (3, None, (5,))


def test_a_frameworks_record_gets_its_host_from_the_plan():
  """A framework adapter's record leaves the host to the save's plan, which sets only it."""
  r = ShardRecord.of(ShardId(("w",), ((0, 2),)), 1, np.zeros(2, np.float32))
  assert r.host is None
  assert r.on(3) == dataclasses.replace(r, host=3) and r.host is None


def test_manifest_round_trips_through_its_file():
  spec = LeafSpec(key_path=("w", 1), shape=(4, 2), dtype=np.float32, write_shape=(2, 2),
                  sharding='{"x": 1}')
  sums = [ShardRecord(ShardId(("w", 1), ((0, 2), (0, 2))), 0, 0, "float32", (2, 2), 16,
                      crc32c=7),
          ShardRecord(ShardId(("w", 1), ((2, 4), (0, 2))), 0, 1, "float32", (2, 2), 16)]
  m = Manifest.of_save("orbax", step=3, leaves=[spec], shards=sums,
                       data_state_json='{"pos": 5}', replicas={0: [1], 1: [0]},
                       extras={"plan": {"state": {}}})
  back = Manifest.from_json(m.to_json(), "here")
  assert back == m
  assert back.leaves == (SavedLeaf(("w", 1), (4, 2), "float32", "jax.Array", (2, 2), '{"x": 1}'),)
  assert back.data_state == {"pos": 5} and back.step == 3 and dict(back.replicas) == {0: (1,),
                                                                                      1: (0,)}
  assert back.dcp_plan == {"state": {}}


def test_a_manifest_entry_keeps_the_keys_an_earlier_release_wrote_and_reads_them():
  """An entry written before shards were records (key path, index, nbytes, crc32c, host)
  reads with its number, dtype and shape not recorded; a new entry adds those keys."""
  old = {"key_path": ["w", 1], "index": [[0, 2], [0, 2]], "nbytes": 16, "crc32c": 7,
         "host": 0}
  record = ShardRecord.from_dict(old)
  assert record == ShardRecord(ShardId(("w", 1), ((0, 2), (0, 2))), -1, 0, "", (), 16,
                               crc32c=7)
  new = dataclasses.replace(record, leaf=3, dtype="float32", shape=(2, 2), rank=None)
  assert {k: v for k, v in new.to_dict().items() if k in old} == old
  assert ShardRecord.from_dict(new.to_dict()) == new
  stock = {"key_path": ["s"], "index": [], "nbytes": 0, "crc32c": None, "host": None}
  assert ShardRecord.from_dict(stock).crc32c is None


def test_a_dcp_manifests_plan_is_its_format_extra():
  m = Manifest("dcp", (), (), None, {}, extras={"plan": {"storage": []}})
  assert m.dcp_plan == {"storage": []} and Manifest("orbax", (), ()).dcp_plan is None
  assert '"plan":{"storage":[]}' in m.to_json()


@pytest.mark.parametrize("text", ["{", '{"leaves": []}', '{"leaves": [{}], "shards": []}'],
                         ids=["not-json", "no-shards", "bad-leaf"])
def test_a_manifest_that_is_not_ours_names_the_fix(text):
  with pytest.raises(errors.InvalidArgumentError, match=r"/d/3: its manifest is not one this "
                     r"sidecar wrote .*restore it with Orbax, or an older step"):
    Manifest.from_json(text, "/d/3")


def test_a_bad_data_state_is_refused():
  with pytest.raises(errors.InvalidArgumentError, match="data_state_json is not JSON"):
    Manifest.of_save("x", step=0, leaves=(), shards=(), data_state_json="{",
                     replicas=None)


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
