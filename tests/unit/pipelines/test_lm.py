import json

import grain
import numpy as np
import pytest

import sidecar
from pipelines import lm

pytestmark = pytest.mark.unit

CTX = sidecar.PipelineContext(shard_index=0, shard_count=1)
TEXT = bytes(range(256)) * 3 + b"the end"  # 775 bytes, every byte value


@pytest.fixture
def corpus(tmp_path):
  """TEXT in 16-byte records, 3 records a shard (so 17 shards): many boundaries to cross."""
  chunks = [TEXT[i:i + 100] for i in range(0, len(TEXT), 100)]
  manifest = lm.write_corpus(tmp_path, chunks, record_bytes=16, shard_bytes=48, sources=8)
  return tmp_path, manifest


def test_write_corpus_records_its_layout(corpus):
  directory, manifest = corpus
  assert manifest.total_bytes == len(TEXT)
  assert sum(manifest.records) == -(-len(TEXT) // 16)
  assert len(manifest.shards) == 17 and set(manifest.records[:-1]) == {3}
  assert lm.read_manifest(directory) == manifest
  assert json.loads((directory / lm.MANIFEST).read_text())["sources"] == 8


@pytest.mark.parametrize("seq_len", [1, 7, 16, 64, 774], ids=["1", "7", "record", "64", "all"])
def test_sequence_i_is_bytes_i_times_l_to_next_plus_one(corpus, seq_len):
  ds = lm.lm(CTX, data=str(corpus[0]), seq_len=seq_len)
  assert isinstance(ds, grain.MapDataset)
  assert len(ds) == (len(TEXT) - 1) // seq_len
  for i in sorted({0, min(1, len(ds) - 1), len(ds) // 2, len(ds) - 1}):
    tokens = ds[i]["tokens"]
    assert tokens.dtype == np.int32 and tokens.shape == (seq_len + 1,)
    assert bytes(tokens.astype(np.uint8)) == TEXT[i * seq_len:(i + 1) * seq_len + 1]


def test_max_bytes_cuts_the_corpus(tmp_path):
  manifest = lm.write_corpus(tmp_path, [TEXT, TEXT], record_bytes=64, max_bytes=1000)
  assert manifest.total_bytes == 1000
  ds = lm.lm(CTX, data=str(tmp_path), seq_len=10)
  assert len(ds) == 99
  assert bytes(ds[98]["tokens"].astype(np.uint8)) == (TEXT + TEXT)[980:991]


def test_an_unprepared_directory_names_the_script(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"no corpus manifest at .*prepare\.py --out"):
    lm.lm(CTX, data=str(tmp_path), seq_len=8)


@pytest.mark.parametrize("kwargs, match", [
    ({"seq_len": 0}, "seq_len must be at least 1, got 0"),
    ({"seq_len": len(TEXT)}, "775 bytes: too few for one sequence of 776 tokens"),
], ids=["zero", "too-long"])
def test_bad_lengths_are_refused(corpus, kwargs, match):
  with pytest.raises(ValueError, match=match):
    lm.lm(CTX, data=str(corpus[0]), **kwargs)


def test_a_foreign_manifest_is_refused(tmp_path):
  (tmp_path / lm.MANIFEST).write_text(json.dumps({"format": "other"}))
  with pytest.raises(ValueError, match="manifest format is 'other'"):
    lm.read_manifest(tmp_path)


def test_shard_size_must_hold_whole_records(tmp_path):
  with pytest.raises(ValueError, match="shard_bytes must be a positive multiple of record_bytes"):
    lm.write_corpus(tmp_path, [TEXT], record_bytes=16, shard_bytes=40)


def test_in_a_pool_a_manifest_names_shards_beneath_its_directory_only(corpus, tmp_path_factory):
  from sidecar._src.user.data_roots import DataRoots
  directory, manifest = corpus
  ctx = sidecar.PipelineContext(shard_index=0, shard_count=1,
                                data_roots=DataRoots(roots=(str(directory),), tenant="bob"))
  ds = lm.lm(ctx, data=str(directory), seq_len=8)
  assert bytes(ds[0]["tokens"].astype(np.uint8)) == TEXT[:9]
  hostile = tmp_path_factory.mktemp("hostile")
  for shards, error, match in (
      ([str(directory / manifest.shards[0])], sidecar.InvalidArgumentError, "is no name inside"),
      (["../" + manifest.shards[0]], sidecar.InvalidArgumentError, "is no name inside"),
      (["nothing.array_record"], sidecar.NotFoundError, "no file or directory at")):
    (hostile / lm.MANIFEST).write_text(json.dumps({**manifest.to_dict(), "shards": shards}))
    inside = sidecar.PipelineContext(
        shard_index=0, shard_count=1, data_roots=DataRoots(roots=(str(hostile),), tenant="bob"))
    with pytest.raises(error, match=match):
      lm.lm(inside, data=str(hostile), seq_len=8)
