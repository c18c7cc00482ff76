"""pipelines.digits_iterable: the digits of pipelines.digits without Grain, sharded,
shuffled and positioned by the pipeline itself."""

import importlib
import sys

import numpy as np
import pytest

import sidecar

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def module():
  # It registers "digits", as pipelines.digits does: a registry of its own here.
  previous = sidecar.set_default_registry(sidecar.Registry())
  try:
    sys.modules.pop("pipelines.digits_iterable", None)
    mod = importlib.import_module("pipelines.digits_iterable")
    assert sidecar.default_registry().get("pipeline", "digits").fn is mod.digits
  finally:
    sidecar.set_default_registry(previous)
  return mod


def _elements(module, **ctx):
  return list(module.digits(sidecar.PipelineContext(**ctx), split="test"))


def _key(element):
  return (element["image"].tobytes(), int(element["label"]))


def test_the_shards_of_an_epoch_are_the_split_once_each(module):
  from pipelines import _digits_data
  images, labels = _digits_data.load("test")
  shards = [_elements(module, shard_index=i, shard_count=3, seed=5) for i in range(3)]
  assert [len(s) for s in shards] == [99, 99, 99]
  element = shards[0][0]
  assert element["image"].dtype == np.float32 and element["image"].shape == (8, 8, 1)
  assert element["label"].dtype == np.int32
  got = sorted(_key(e) for shard in shards for e in shard)
  assert got == sorted((images[i].tobytes(), int(labels[i])) for i in range(len(labels)))


def test_a_shard_resumes_after_its_position_and_epochs_are_reshuffled(module):
  whole = _elements(module, shard_index=1, shard_count=2, seed=7)
  rest = _elements(module, shard_index=1, shard_count=2, seed=7, position=40)
  assert [_key(e) for e in rest] == [_key(e) for e in whole[40:]]
  again = _elements(module, shard_index=1, shard_count=2, seed=7)
  assert [_key(e) for e in again] == [_key(e) for e in whole]  # the seed decides
  other = _elements(module, shard_index=1, shard_count=2, seed=7, epoch=1)
  assert [_key(e) for e in other] != [_key(e) for e in whole]


def test_bad_split_names_the_choices(module):
  with pytest.raises(ValueError, match=r"split must be one of \['test', 'train'\]"):
    list(module.digits(sidecar.PipelineContext(shard_index=0, shard_count=1), split="val"))
