"""The frozen records of the Checkpoint service, and the manifest's file."""

import dataclasses

import numpy as np
import pytest

from sidecar._src.ckptfmt.records import Manifest, SavedLeaf, ShardChecksum, ShardId
from sidecar._src.ckptfmt.spec import LeafSpec
from sidecar._src.core import errors

pytestmark = pytest.mark.unit


def test_records_are_frozen():
  shard = ShardId(("a", 0), ((0, 2),))
  with pytest.raises(dataclasses.FrozenInstanceError):
    shard.index = ()  # type: ignore[misc]
  key_path, index = shard  # unpacks as the (key_path, index) tuples it replaces
  assert (key_path, index) == (("a", 0), ((0, 2),))
  assert ShardChecksum(("a", 0), ((0, 2),), 8, 5).shard == shard


def test_manifest_round_trips_through_its_file():
  spec = LeafSpec(key_path=("w", 1), shape=(4, 2), dtype=np.float32, write_shape=(2, 2),
                  sharding='{"x": 1}')
  sums = [ShardChecksum(("w", 1), ((0, 2), (0, 2)), 16, 7, host=0),
          ShardChecksum(("w", 1), ((2, 4), (0, 2)), 16, None, host=1)]
  m = Manifest.of_save("orbax", step=3, leaves=[spec], checksums=sums,
                       data_state_json='{"pos": 5}', replicas={0: [1], 1: [0]},
                       extras={"plan": {"state": {}}})
  back = Manifest.from_json(m.to_json(), "here")
  assert back == m
  assert back.leaves == (SavedLeaf(("w", 1), (4, 2), "float32", "jax.Array", (2, 2), '{"x": 1}'),)
  assert back.data_state == {"pos": 5} and back.step == 3 and dict(back.replicas) == {0: (1,),
                                                                                      1: (0,)}
  assert back.dcp_plan == {"state": {}}


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
    Manifest.of_save("x", step=0, leaves=(), checksums=(), data_state_json="{",
                     replicas=None)
