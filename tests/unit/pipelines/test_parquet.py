import collections.abc
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import sidecar
from pipelines import parquet as parquet_lib

pytestmark = pytest.mark.unit

# (rows, row group size) per file: row groups of 10,10,5 | 7 | 8,8,8,8,8 -> 9 units, 72 rows.
FILES = [(25, 10), (7, 7), (40, 8)]
TOTAL = sum(rows for rows, _ in FILES)
CTX = sidecar.PipelineContext(shard_index=0, shard_count=1)


def _table(start, rows):
  ids = np.arange(start, start + rows)
  return pa.table({
      "id": ids,
      "x": pa.FixedSizeListArray.from_arrays(
          pa.array(np.repeat(ids, 3).astype(np.float32)), 3),
      "m": pa.FixedSizeListArray.from_arrays(pa.FixedSizeListArray.from_arrays(
          pa.array((np.repeat(ids, 4) % 128).astype(np.int8)), 2), 2),
      "flag": ids % 2 == 0,
      "name": [f"row{i}" for i in ids],
  })


@pytest.fixture
def paths(tmp_path):
  paths, start = [], 0
  for i, (rows, group) in enumerate(FILES):
    path = str(tmp_path / f"part-{i}.parquet")
    pq.write_table(_table(start, rows), path, row_group_size=group)
    paths.append(path)
    start += rows
  assert [pq.read_metadata(p).num_row_groups for p in paths] == [3, 1, 5]
  return paths


def _ids(paths, shard_index=0, shard_count=1, **kw):
  ctx = sidecar.PipelineContext(shard_index=shard_index, shard_count=shard_count,
                                **{k: kw.pop(k) for k in ("seed", "epoch", "position") if k in kw})
  kw.setdefault("columns", ["id"])
  return [int(row["id"]) for row in parquet_lib.parquet(ctx, paths=paths, **kw)]


def test_reads_every_row_in_order_with_projection(paths):
  rows = parquet_lib.parquet(CTX, paths=paths, columns=["x", "id", "m", "flag"], batch_rows=4)
  assert isinstance(rows, collections.abc.Iterator)
  rows = list(rows)
  assert [int(r["id"]) for r in rows] == list(range(TOTAL))
  row = rows[30]
  assert sorted(row) == ["flag", "id", "m", "x"]  # "name" was projected out.
  assert row["id"].dtype == np.int64 and row["flag"].dtype == np.bool_ and row["flag"]
  assert row["x"].dtype == np.float32 and row["x"].shape == (3,)
  np.testing.assert_array_equal(row["x"], [30, 30, 30])
  assert row["m"].dtype == np.int8 and row["m"].shape == (2, 2)
  np.testing.assert_array_equal(row["m"], [[30, 30], [30, 30]])


@pytest.mark.parametrize("shard_count", [1, 2, 4, 9, 12], ids=lambda n: f"{n}-shards")
def test_shards_partition_the_rows(paths, shard_count):
  shards = [_ids(paths, i, shard_count, batch_rows=3) for i in range(shard_count)]
  every = [i for shard in shards for i in shard]
  assert sorted(every) == list(range(TOTAL))  # All rows, none twice.
  if shard_count > 9:  # More shards than row groups: the extra shards yield nothing.
    assert shards[9:] == [[]] * (shard_count - 9)


def test_shards_are_dealt_row_groups_round_robin(paths):
  # Units in order: [0,10) [10,20) [20,25) [25,32) [32,40) ...; shard 1 of 2 gets 2nd, 4th, ...
  assert _ids(paths, 1, 2)[:18] == list(range(10, 20)) + list(range(25, 32)) + [40]


@pytest.mark.parametrize("position", [0, 1, 9, 10, 11, 17, 24, 30, 35, 36, 50],
                         ids=lambda p: f"at-{p}")
@pytest.mark.parametrize("shard_index", [0, 1], ids=["shard0", "shard1"])
def test_resume_gives_the_tail_of_an_uninterrupted_run(paths, shard_index, position):
  full = _ids(paths, shard_index, 2)
  assert len(full) == {0: 39, 1: 33}[shard_index]
  assert _ids(paths, shard_index, 2, position=position, batch_rows=4) == full[position:]


def test_resume_skips_whole_row_groups_unread(paths, monkeypatch):
  read = []
  real = pq.ParquetFile.iter_batches

  def spy(self, *args, row_groups=None, **kw):
    read.append(row_groups)
    return real(self, *args, row_groups=row_groups, **kw)

  monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
  assert _ids(paths, position=21)[:5] == [21, 22, 23, 24, 25]
  assert read[0] == [2]  # Row groups 0 and 1 of the first file were never read.
  assert len(read) == 9 - 2


def test_shuffle_orders_row_groups_by_seed_and_epoch(paths):
  plain = _ids(paths)
  epoch0 = _ids(paths, shuffle=True, seed=3, epoch=0)
  assert epoch0 == _ids(paths, shuffle=True, seed=3, epoch=0)  # Deterministic.
  assert epoch0 != _ids(paths, shuffle=True, seed=3, epoch=1) != plain
  assert sorted(epoch0) == plain
  halves = _ids(paths, 0, 2, shuffle=True, seed=3) + _ids(paths, 1, 2, shuffle=True, seed=3)
  assert sorted(halves) == plain
  tail = _ids(paths, 1, 2, shuffle=True, seed=3, position=12)
  assert tail == _ids(paths, 1, 2, shuffle=True, seed=3)[12:]


def test_glob_is_expanded_in_sorted_order(paths, tmp_path):
  assert _ids(str(tmp_path / "part-*.parquet")) == list(range(TOTAL))
  assert _ids([paths[2], paths[0]])[:3] == [32, 33, 34]  # A list keeps its order.


@pytest.mark.parametrize("columns", [None, ["id", "name"]], ids=["all", "projected"])
def test_string_column_is_refused_by_name(paths, columns):
  with pytest.raises(TypeError, match=r"column 'name' of .*part-0.parquet has type string, "
                                      r"which has no fixed-shape numpy form; leave it out"):
    parquet_lib.parquet(CTX, paths=paths, columns=columns)


def test_variable_length_list_is_refused_by_name(tmp_path):
  path = str(tmp_path / "ragged.parquet")
  pq.write_table(pa.table({"ragged": pa.array([[1], [2, 3]])}), path)
  with pytest.raises(TypeError, match=r"column 'ragged' .* has type list<.*: int64>"):
    parquet_lib.parquet(CTX, paths=path)


def test_nulls_are_refused_by_name(tmp_path):
  path = str(tmp_path / "nulls.parquet")
  pq.write_table(pa.table({"v": pa.array([1.0, None, 3.0])}), path)
  rows = parquet_lib.parquet(CTX, paths=path)
  with pytest.raises(ValueError, match=r"column 'v' of .*nulls.parquet has 1 nulls"):
    list(rows)


def test_missing_column_and_mismatched_files(paths, tmp_path):
  with pytest.raises(ValueError, match=r"column 'nope' is not in .*part-0.parquet; its "
                                       r"columns are \['id', 'x', 'm', 'flag', 'name'\]"):
    parquet_lib.parquet(CTX, paths=paths, columns=["id", "nope"])
  other = str(tmp_path / "other.parquet")
  pq.write_table(pa.table({"id": np.arange(3, dtype=np.int32)}), other)
  with pytest.raises(ValueError, match=r"column 'id' is int32 in .*other.parquet but int64"):
    parquet_lib.parquet(CTX, paths=[paths[0], other], columns=["id"])
  wider = str(tmp_path / "wider.parquet")
  pq.write_table(pa.table({"id": np.arange(3, dtype=np.int32), "y": np.arange(3.0)}), wider)
  with pytest.raises(ValueError, match=r"wider.parquet has columns \['id', 'y'\] but "
                                       r".*other.parquet has \['id'\]; pass columns="):
    parquet_lib.parquet(CTX, paths=[other, wider])


@pytest.mark.parametrize("name", ["missing.parquet", "*.nothing"], ids=["file", "glob"])
def test_missing_paths_are_named(paths, tmp_path, name):
  missing = str(tmp_path / name)
  with pytest.raises(FileNotFoundError, match=f"no Parquet file at '{re.escape(missing)}'"):
    parquet_lib.parquet(CTX, paths=[paths[0], missing])


@pytest.mark.parametrize("batch_rows", [0, -1, 2.5], ids=["zero", "negative", "float"])
def test_bad_batch_rows(paths, batch_rows):
  with pytest.raises(ValueError, match=f"batch_rows must be a positive int, got {batch_rows}"):
    parquet_lib.parquet(CTX, paths=paths, batch_rows=batch_rows)


def test_registered_as_parquet():
  assert sidecar.default_registry().get("pipeline", "parquet").fn is parquet_lib.parquet


def test_in_a_pool_only_files_beneath_the_data_roots_are_read(paths, tmp_path):
  from sidecar._src.user.data_roots import DataRoots
  ctx = sidecar.PipelineContext(shard_index=0, shard_count=1,
                                data_roots=DataRoots(roots=(str(tmp_path),), tenant="bob"))
  rows = parquet_lib.parquet(ctx, paths=f"{tmp_path}/*.parquet", columns=["id"])
  assert [int(r["id"]) for r in rows] == list(range(TOTAL))
  outside = sidecar.PipelineContext(
      shard_index=0, shard_count=1,
      data_roots=DataRoots(roots=(str(tmp_path / "bob"),), tenant="bob"))
  with pytest.raises(sidecar.PermissionDeniedError, match="is not under tenant 'bob'"):
    parquet_lib.parquet(outside, paths=f"{tmp_path}/*.parquet")


def test_in_a_pool_a_footer_naming_another_file_is_refused(paths, tmp_path):
  """A _metadata summary (each column chunk's file_path naming a file): a pool feed reads
  each file's own bytes and refuses a footer naming another (issue 70, item 1)."""
  from sidecar._src.user.data_roots import DataRoots
  meta = pq.read_metadata(paths[0])
  meta.set_file_path("/elsewhere/alice.parquet")
  meta.write_metadata_file(str(tmp_path / "summary.parquet"))
  ctx = sidecar.PipelineContext(shard_index=0, shard_count=1,
                                data_roots=DataRoots(roots=(str(tmp_path),), tenant="bob"))
  with pytest.raises(sidecar.InvalidArgumentError,
                     match=r"summary.parquet: row group 0 says its column data is in "
                           r"'/elsewhere/alice.parquet', another file"):
    parquet_lib.parquet(ctx, paths=str(tmp_path / "summary.parquet"))
