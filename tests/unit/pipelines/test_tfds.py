"""TFDS without TensorFlow: ``tfds.testing.mock_data``, and a real tiny dataset
prepared in ``array_record`` format at test time (TFDS writes and reads it with
no TensorFlow installed)."""

import pickle

import grain
import numpy as np
import pytest
import tensorflow_datasets as tfds_lib

import sidecar
from pipelines import tfds as tfds_pipeline

pytestmark = pytest.mark.unit

CTX = sidecar.PipelineContext(shard_index=0, shard_count=1)


class SidecarTestTiny(tfds_lib.core.GeneratorBasedBuilder):
  """Registered with TFDS as ``sidecar_test_tiny``: 10 train and 4 test examples."""
  VERSION = tfds_lib.core.Version("1.0.0")

  def _info(self):
    return tfds_lib.core.DatasetInfo(builder=self, features=tfds_lib.features.FeaturesDict({
        "x": tfds_lib.features.Tensor(shape=(3,), dtype=np.float32),
        "label": tfds_lib.features.ClassLabel(num_classes=4),
        "text": tfds_lib.features.Text(),
    }))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples(0, 10), "test": self._generate_examples(10, 14)}

  def _generate_examples(self, start, stop):
    for i in range(start, stop):
      yield i, {"x": np.full((3,), i, np.float32), "label": i % 4, "text": f"example {i}"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  data_dir = tmp_path_factory.mktemp("tfds")
  tfds_lib.disable_progress_bar()
  SidecarTestTiny(data_dir=data_dir, file_format="array_record").download_and_prepare()
  return str(data_dir)


def test_mock_data_without_tensorflow():
  with tfds_lib.testing.mock_data(num_examples=6):
    ds = tfds_pipeline.tfds(CTX, name="mnist", split="train")
    assert isinstance(ds, grain.MapDataset)
    assert len(ds) == 6
    element = ds[5]
    assert sorted(element) == ["image", "label"]
    assert element["image"].dtype == np.uint8 and element["image"].shape == (28, 28, 1)
    assert element["label"].dtype == np.int64 and element["label"].shape == ()
    assert sorted(tfds_pipeline.tfds(CTX, name="mnist", split="train", keys=["label"])[0]) \
        == ["label"]


def test_real_array_record_dataset(data_dir):
  ds = tfds_pipeline.tfds(CTX, name="sidecar_test_tiny", split="train", data_dir=data_dir,
                          keys=["x", "label"])
  assert len(ds) == 10
  elements = [ds[i] for i in range(len(ds))]
  assert all(sorted(e) == ["label", "x"] for e in elements)
  assert all(e["x"].dtype == np.float32 and e["x"].shape == (3,) for e in elements)
  ids = sorted(int(e["x"][0]) for e in elements)
  assert ids == list(range(10))  # TFDS shuffles on write; every example is there once.
  assert all(e["label"] == int(e["x"][0]) % 4 for e in elements)
  test = tfds_pipeline.tfds(CTX, name="sidecar_test_tiny", split="test[:3]",
                            data_dir=data_dir, keys=["x"])
  assert len(test) == 3 and all(10 <= test[i]["x"][0] < 14 for i in range(3))


def test_text_feature_is_refused_by_name(data_dir):
  with pytest.raises(TypeError, match=r"feature 'text' decodes to .* values, which cannot be "
                                      r"batched.*keys=\[...\]"):
    tfds_pipeline.tfds(CTX, name="sidecar_test_tiny", split="train", data_dir=data_dir)


def test_unknown_key_lists_the_features(data_dir):
  with pytest.raises(ValueError, match=r"keys \['image'\] are not features of this dataset; "
                                       r"its features are \['label', 'text', 'x'\]"):
    tfds_pipeline.tfds(CTX, name="sidecar_test_tiny", split="train", data_dir=data_dir,
                       keys=["x", "image"])


def test_bad_split_is_named(data_dir):
  with pytest.raises(ValueError, match=r"Unknown split 'validation'"):
    tfds_pipeline.tfds(CTX, name="sidecar_test_tiny", split="validation", data_dir=data_dir)


def test_unprepared_dataset_says_how_to_prepare_it(tmp_path):
  with pytest.raises(FileNotFoundError,
                     match=r"'sidecar_test_tiny' has no array_record files under data_dir="
                           r".*tfds build sidecar_test_tiny --file_format=array_record"):
    tfds_pipeline.tfds(CTX, name="sidecar_test_tiny", split="train", data_dir=str(tmp_path))


def test_unknown_dataset():
  with pytest.raises(ValueError, match="Dataset no_such_dataset_here not found"):
    tfds_pipeline.tfds(CTX, name="no_such_dataset_here", split="train")


def test_registered_as_tfds():
  assert sidecar.default_registry().get("pipeline", "tfds").fn is tfds_pipeline.tfds


def test_dataset_pickles_for_spawned_workers(data_dir):
  ds = tfds_pipeline.tfds(CTX, name="sidecar_test_tiny", split="test", data_dir=data_dir,
                          keys=["x"])
  copy = pickle.loads(pickle.dumps(ds))
  assert len(copy) == 4
  np.testing.assert_array_equal(copy[2]["x"], ds[2]["x"])


def test_in_a_pool_tfds_reads_a_view_of_the_dataset_beneath_the_data_roots(data_dir, tmp_path):
  import os

  from sidecar._src.user.data_roots import DataRoots
  ctx = sidecar.PipelineContext(shard_index=0, shard_count=1,
                                data_roots=DataRoots(roots=(data_dir,), tenant="bob"))
  ds = tfds_pipeline.tfds(ctx, name="sidecar_test_tiny", split="train", data_dir=data_dir,
                          keys=["x"])
  assert sorted(int(ds[i]["x"][0]) for i in range(len(ds))) == list(range(10))
  with pytest.raises(TypeError, match="cannot cross to another process"):
    pickle.dumps(ds)  # its view holds this process's descriptors
  with pytest.raises(sidecar.PermissionDeniedError, match="is not under tenant 'bob'"):
    tfds_pipeline.tfds(ctx, name="sidecar_test_tiny", split="train")  # TFDS's default dir
  with pytest.raises(sidecar.NotFoundError, match=r"'sidecar_test_tiny' is not prepared: .*"
                                                  "tfds build sidecar_test_tiny"):
    tfds_pipeline.tfds(ctx, name="sidecar_test_tiny", split="train", data_dir=f"{data_dir}/x")
  # A file of the dataset swapped for a symlink out of the roots: refused, not followed.
  (tmp_path / "secret").write_text("{}")
  info = next(p for p, _, names in os.walk(data_dir) if "dataset_info.json" in names)
  os.rename(f"{info}/features.json", f"{info}/features.json.orig")
  os.symlink(tmp_path / "secret", f"{info}/features.json")
  try:
    with pytest.raises(sidecar.PermissionDeniedError, match="features.json' leads out of"):
      tfds_pipeline.tfds(ctx, name="sidecar_test_tiny", split="train", data_dir=data_dir)
  finally:
    os.remove(f"{info}/features.json")
    os.rename(f"{info}/features.json.orig", f"{info}/features.json")


@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_in_a_pool_a_template_naming_shards_outside_is_refused(data_dir, tmp_path, how):
  """bob's own dataset whose dataset_info.json names alice's shards (absolute, or by '..'
  from his data_dir): TFDS would join the template to the data_dir and open hers; the
  shards it would open are checked first (issue 70, item 1)."""
  import json
  import os
  import shutil

  from sidecar._src.user.data_roots import OPEN_FILES, DataRoots
  alice, bob = tmp_path / "alice", tmp_path / "bob"
  shutil.copytree(data_dir, alice)
  shutil.copytree(data_dir, bob)
  version = bob / "sidecar_test_tiny" / "1.0.0"
  theirs = f"{alice}/sidecar_test_tiny/1.0.0/{{DATASET}}-{{SPLIT}}.{{FILEFORMAT}}-{{SHARD_X_OF_Y}}"
  template = theirs if how == "absolute" else "../" * 16 + theirs.lstrip("/")
  info = json.loads((version / "dataset_info.json").read_text())
  for split in info["splits"]:
    split["filepathTemplate"] = template
  (version / "dataset_info.json").write_text(json.dumps(info))
  for shard in version.glob("*.array_record-*"):
    os.remove(shard)  # his copy has none: only hers could be read
  ctx = sidecar.PipelineContext(shard_index=0, shard_count=1,
                                data_roots=DataRoots(roots=(str(bob),), tenant="bob-tfds"))
  with pytest.raises(sidecar.PermissionDeniedError,
                     match=rf"TFDS dataset 'sidecar_test_tiny' in '{bob}/sidecar_test_tiny': "
                           r"its dataset_info.json has split '(train|test)' read from .*"
                           r"outside the dataset's own directory"):
    tfds_pipeline.tfds(ctx, name="sidecar_test_tiny", split="train", data_dir=str(bob),
                       keys=["x"])
  assert OPEN_FILES.held("bob-tfds") == 0  # its view closed with the refusal
