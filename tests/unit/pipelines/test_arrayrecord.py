import os
import pickle
import re

import grain
import numpy as np
import pytest

import sidecar
from pipelines import arrayrecord as ar
from sidecar._src.server.feeds import producer
from sidecar._src.user import data_roots, registry as registry_lib

pytestmark = pytest.mark.unit

CTX = sidecar.PipelineContext(shard_index=0, shard_count=1)


def _example(i):
  return {"id": np.int64(i), "x": np.full((2, 3), i, np.float32), "ok": np.bool_(i % 2)}


@pytest.fixture
def files(tmp_path):
  """Two files: ids 0..6 and 7..11."""
  paths = [tmp_path / "a.array_record", tmp_path / "b.array_record"]
  assert ar.write_arrayrecord(paths[0], map(_example, range(7))) == 7
  assert ar.write_arrayrecord(paths[1], map(_example, range(7, 12))) == 5
  return [str(p) for p in paths]


@pytest.mark.parametrize("value", [
    np.float32(1.5), np.int8(-3), np.bool_(True), np.arange(12, dtype=np.uint16).reshape(3, 4),
    np.arange(6.0).reshape(2, 3).T, np.array([1 + 2j], np.complex64),
    np.array(["ab", "c"]), np.array([b"xyz"]), np.zeros((0, 4), np.float16),
    np.array(["2024-01-02"], "datetime64[D]"), 7, 2.5,
], ids=["f32-scalar", "i8-scalar", "bool", "u16-2d", "transposed", "complex", "unicode",
        "bytes", "empty", "datetime", "py-int", "py-float"])
def test_encode_decode_round_trip(value):
  decoded = ar.decode_example(ar.encode_example({"v": value, "tail": np.int16(9)}))
  expected = np.asarray(value)
  assert decoded["v"].dtype == expected.dtype
  assert decoded["v"].shape == expected.shape
  np.testing.assert_array_equal(decoded["v"], expected)
  assert decoded["tail"] == 9 and decoded["tail"].dtype == np.int16


def test_decoded_arrays_are_aligned_read_only_views():
  record = ar.encode_example({"a": np.int8(1), "b": np.arange(3, dtype=np.float64)})
  assert record.startswith(ar.MAGIC)
  b = ar.decode_example(record)["b"]
  assert not b.flags.writeable
  assert (b.ctypes.data - ar.decode_example(record)["a"].ctypes.data) % 8 == 0


@pytest.mark.parametrize("example, match", [
    ({"o": np.array([{}], dtype=object)}, r"example\['o'\] has dtype object"),
    ({"s": np.zeros(2, dtype=[("f", "i4")])}, r"example\['s'\] has dtype"),
    ({1: np.int8(1)}, "example keys must be str, got int 1"),
], ids=["object", "structured", "int-key"])
def test_encode_refuses_what_needs_pickle(example, match):
  with pytest.raises(TypeError, match=match):
    ar.encode_example(example)


def test_decode_rejects_foreign_records():
  with pytest.raises(ValueError, match="was not written by encode_example; pass parse="):
    ar.decode_example(b"\x80\x04K\x01.")  # A pickle: never loaded.


def test_pipeline_reads_files_in_order_with_random_access(files):
  ds = ar.arrayrecord(CTX, paths=files)
  assert isinstance(ds, grain.MapDataset)
  assert len(ds) == 12
  for i in (11, 0, 7, 6):  # Out of order and across the file boundary.
    element = ds[i]
    assert element["id"] == i
    np.testing.assert_array_equal(element["x"], np.full((2, 3), i, np.float32))
    assert element["ok"] == bool(i % 2)


def test_paths_accept_a_glob_and_a_single_file(files, tmp_path):
  ds = ar.arrayrecord(CTX, paths=str(tmp_path / "*.array_record"))
  assert [ds[i]["id"] for i in range(len(ds))] == list(range(12))
  assert len(ar.arrayrecord(CTX, paths=files[1])) == 5


def test_parse_by_registered_function_name(files, registry):
  @sidecar.function(name="record_size")
  def record_size(record: bytes):
    return {"size": np.int64(len(record))}

  ds = ar.arrayrecord(CTX, paths=files, parse="record_size")
  assert ds[0]["size"] == len(ar.encode_example(_example(0)))
  with pytest.raises(sidecar.NotRegisteredError, match=r"no function named 'nope'.*record_size"):
    ar.arrayrecord(CTX, paths=files, parse="nope")


def test_parse_reaches_only_the_feed_s_tenant_s_allowlist(files, registry):
  """Issue 70, item 5: bob, whose functions allowlist holds only `total`, ran the
  operator's function by naming it in parse=; a feed opens its pipeline within its
  tenant's allowlist (its DataRoots'), in the sidecar and in its worker processes."""
  @sidecar.function(name="total")
  def total(record: bytes):
    return {"size": np.int64(len(record))}

  @sidecar.function(name="operator_secret")
  def operator_secret(record: bytes):
    return {"secret": np.frombuffer(b"from the environment", np.uint8)}

  bob = data_roots.DataRoots.from_dict(data_roots.DataRoots(
      tenant="bob", where="pool.yaml:3", functions=("total",)).to_dict())  # as workers get it
  spec = producer.Spec(global_batch_size=2, ranges=((0, 2),), seed=0, num_epochs=None,
                       shard_index=0, shard_count=1, start={}, workers=0)
  entry = registry_lib.Entry("pipeline", "arrayrecord", ar.arrayrecord, "", None)
  for name in ("operator_secret", "nope"):  # registered or not: the same answer
    with pytest.raises(sidecar.PermissionDeniedError,
                       match=rf"tenant 'bob' may not run function '{name}', named in a "
                       r"pipeline's arguments: its functions allowlist \(pool.yaml:3\) "
                       r"holds total; add it there"):
      producer.open_source(entry, {"paths": files, "parse": name}, spec, 0, 0, bob)
  ds = producer.open_source(entry, {"paths": files, "parse": "total"}, spec, 0, 0, bob)
  assert ds[0]["size"] == len(ar.encode_example(_example(0)))
  # Outside the feed's opening, and outside a pool, any registered function.
  assert ar.arrayrecord(CTX, paths=files, parse="operator_secret")[0]["secret"].size


def test_parse_by_callable(files):
  ds = ar.arrayrecord(CTX, paths=files, parse=lambda r: {"first": np.uint8(r[0])})
  assert ds[3] == {"first": ar.MAGIC[0]}


@pytest.mark.parametrize("name", ["missing.array_record", "*.nothing"], ids=["file", "glob"])
def test_missing_paths_are_named(files, tmp_path, name):
  missing = str(tmp_path / name)
  with pytest.raises(FileNotFoundError, match=f"no ArrayRecord file at '{re.escape(missing)}'"):
    ar.arrayrecord(CTX, paths=[files[0], missing])


def test_empty_paths_and_bad_parse(files):
  with pytest.raises(ValueError, match="paths must name at least one file"):
    ar.arrayrecord(CTX, paths=[])
  with pytest.raises(TypeError, match="parse must be 'example'.*got int 3"):
    ar.arrayrecord(CTX, paths=files, parse=3)


def test_dataset_pickles_for_spawned_workers(files):
  ds = pickle.loads(pickle.dumps(ar.arrayrecord(CTX, paths=files)))
  assert len(ds) == 12 and ds[8]["id"] == 8


def test_in_a_pool_only_files_beneath_the_data_roots_are_read(files, tmp_path):
  from sidecar._src.user.data_roots import DataRoots
  mine = tmp_path / "bob"
  mine.mkdir()
  os.symlink(files[0], mine / "a.array_record")  # leads out of bob's root
  ar.write_arrayrecord(mine / "c.array_record", map(_example, range(3)))
  ctx = sidecar.PipelineContext(shard_index=0, shard_count=1,
                                data_roots=DataRoots(roots=(str(mine),), tenant="bob"))
  ds = ar.arrayrecord(ctx, paths=f"{mine}/c.*")
  assert [int(ds[i]["id"]) for i in range(len(ds))] == [0, 1, 2]
  with pytest.raises(sidecar.PermissionDeniedError, match="is not under tenant 'bob'"):
    ar.arrayrecord(ctx, paths=files)
  with pytest.raises(sidecar.PermissionDeniedError, match="leads out of its data root"):
    ar.arrayrecord(ctx, paths=str(mine / "a.array_record"))
