import json

import numpy as np
import orbax.checkpoint as ocp
import pytest

import sidecar
from sidecar._src.jax import feed_state as fc

pytestmark = pytest.mark.unit

STATE = {"position": 1234, "epoch": 2, "seed": 7, "pipeline": "digits",
         "shards": [{"index": 0, "position": 617}, {"index": 1, "position": 617}]}


@pytest.fixture
def manager(tmp_path):
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    yield mngr


def _params():
  return {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array(0.5, np.float32)}


def test_state_saved_beside_a_tree_restores_equal(manager):
  manager.save(10, args=ocp.args.Composite(params=ocp.args.StandardSave(_params()),
                                           data=fc.FeedStateSave(STATE)))
  manager.wait_until_finished()
  restored = manager.restore(10, args=ocp.args.Composite(
      params=ocp.args.StandardRestore(_params()), data=fc.FeedStateRestore()))
  assert restored.data == STATE
  np.testing.assert_array_equal(restored.params["w"], _params()["w"])
  assert manager.restore(10).data == STATE  # Orbax can build the restore args itself.


def test_step_without_feed_state_raises(manager):
  manager.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(_params())))
  manager.wait_until_finished()
  # KeyError's str() quotes its message; Orbax names the item and what the step holds.
  with pytest.raises(KeyError, match=r"Item .data. was not found in the checkpoint\. "
                                     r"Available items: \[.*params.*\]"):
    manager.restore(1, args=ocp.args.Composite(data=fc.FeedStateRestore()))


def test_item_directory_without_the_file_raises(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"no feed state at .*feed_state\.json: this "
                                              r"checkpoint was saved without a FeedStateSave"):
    fc.FeedStateHandler().restore(tmp_path, fc.FeedStateRestore())


def test_file_is_json_written_by_rename(tmp_path):
  fc.FeedStateHandler().save(tmp_path, fc.FeedStateSave(STATE))
  assert [p.name for p in tmp_path.iterdir()] == ["feed_state.json"]  # No temporary left.
  record = json.loads((tmp_path / "feed_state.json").read_text())
  assert record == {"format": "sidecar.feed_state", "version": 1, "state": STATE}


def test_only_the_primary_host_writes(tmp_path):
  fc.FeedStateHandler(primary_host=1).save(tmp_path, fc.FeedStateSave(STATE))  # We are 0.
  assert list(tmp_path.iterdir()) == []
  fc.FeedStateHandler(primary_host=None).save(tmp_path, fc.FeedStateSave(STATE))
  assert fc.FeedStateHandler().restore(tmp_path) == STATE


@pytest.mark.parametrize("state, match", [
    ([1, 2], "needs the dict from feed.state\\(\\), got list"),
    ({"position": np.int64(3)}, "must be JSON-serialisable.*int64"),
    ({"x": float("nan")}, "must be JSON-serialisable"),
    ({("a", 1): 2}, "must be JSON-serialisable"),
], ids=["list", "numpy-int", "nan", "tuple-key"])
def test_bad_state_is_refused_before_writing(tmp_path, state, match):
  with pytest.raises(sidecar.InvalidArgumentError, match=match):
    fc.FeedStateHandler().save(tmp_path, fc.FeedStateSave(state))
  assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("record, match", [
    ({"format": "other"}, "is not a feed state written by FeedStateHandler"),
    ({"format": "sidecar.feed_state", "version": 99, "state": {}},
     "has feed state version 99; this colocated-sidecar reads version 1"),
], ids=["foreign", "future-version"])
def test_foreign_or_newer_files_are_refused(tmp_path, record, match):
  (tmp_path / "feed_state.json").write_text(json.dumps(record))
  with pytest.raises(ValueError, match=match):
    fc.FeedStateHandler().restore(tmp_path)
