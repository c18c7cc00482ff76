import pickle

import grain
import numpy as np
import pytest
from sklearn import datasets

import sidecar
from pipelines import digits as digits_lib

pytestmark = pytest.mark.unit

CTX = sidecar.PipelineContext(shard_index=0, shard_count=1)


@pytest.mark.parametrize("split, size, first", [("train", 1500, 0), ("test", 297, 1500)],
                         ids=["train", "test"])
def test_split_sizes_specs_and_values(split, size, first):
  ds = digits_lib.digits(CTX, split=split)
  assert isinstance(ds, grain.MapDataset)
  assert len(ds) == size
  element = ds[0]
  assert sorted(element) == ["image", "label"]
  assert element["image"].dtype == np.float32 and element["image"].shape == (8, 8, 1)
  assert element["label"].dtype == np.int32 and element["label"].shape == ()
  raw = datasets.load_digits()
  np.testing.assert_allclose(element["image"][..., 0], raw.images[first] / 16.0)
  assert element["label"] == raw.target[first]
  images = np.stack([ds[i]["image"] for i in range(len(ds))])
  labels = np.array([ds[i]["label"] for i in range(len(ds))])
  assert images.min() == 0.0 and images.max() == 1.0
  assert set(labels) == set(range(10))  # Every class in both splits.


def test_splits_are_disjoint_and_cover_the_dataset():
  train, test = digits_lib.digits(CTX, split="train"), digits_lib.digits(CTX, split="test")
  labels = [train[i]["label"] for i in range(len(train))] + [test[i]["label"]
                                                             for i in range(len(test))]
  np.testing.assert_array_equal(labels, datasets.load_digits().target)


def test_deterministic_and_independent_of_the_shard():
  a = digits_lib.digits(CTX, split="test")
  other = sidecar.PipelineContext(shard_index=3, shard_count=4, seed=9, epoch=2)
  b = digits_lib.digits(other, split="test")
  for i in (0, 100, 296):
    np.testing.assert_array_equal(a[i]["image"], b[i]["image"])
    assert a[i]["label"] == b[i]["label"]


def test_bad_split_names_the_choices():
  with pytest.raises(ValueError, match=r"split must be one of \['test', 'train'\], "
                                       r"got 'validation'"):
    digits_lib.digits(CTX, split="validation")


def test_registered_as_digits():
  assert sidecar.default_registry().get("pipeline", "digits").fn is digits_lib.digits


def test_dataset_pickles_for_spawned_workers():
  ds = pickle.loads(pickle.dumps(digits_lib.digits(CTX, split="test")))
  assert len(ds) == 297 and ds[296]["label"] == datasets.load_digits().target[-1]
