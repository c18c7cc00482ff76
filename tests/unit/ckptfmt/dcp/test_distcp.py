"""Tier 1: DCP's layout written without torch, restored by stock ``dcp.load`` bit-exact.

The sidecar side (``ckptfmt.dcp``) writes each rank's ``.distcp`` file from numpy
arrays; the test plays rank 0's trainer, pickling DCP's Metadata from the same layout.
Then stock ``FileSystemReader`` reads the directory with no sidecar involved.
"""

import contextlib
import io
import os
import pickle

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

from sidecar._src.ckptfmt.dcp import archive, commit as dcp_commit, distcp
from sidecar._src.ckptfmt.records import Manifest, ShardId, ShardRecord, Staged, shard_crc32c
from sidecar._src.core import errors

pytestmark = [pytest.mark.unit,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def tensor_item(fqn, array, offsets=None):
  offsets = offsets or (0,) * array.ndim
  return distcp.Item(fqn=fqn, kind="tensor", nbytes=array.nbytes, dtype=array.dtype.name,
                  sizes=array.shape, offsets=offsets)


def bytes_item(fqn, value):
  buf = io.BytesIO()
  torch.save(value, buf)  # what DCP's planner makes of a non-tensor value
  raw = np.frombuffer(buf.getvalue(), np.uint8)
  return distcp.Item(fqn=fqn, kind="bytes", nbytes=raw.nbytes), raw


def two_ranks():
  """A state dict split over two ranks, as DCP plans one: a row-sharded weight, a bf16
  tensor, a scalar, a large tensor (direct I/O), a non-tensor value."""
  rng = np.random.default_rng(0)
  w = rng.standard_normal((4, 3)).astype(np.float32)
  h = rng.standard_normal((5,)).astype(ml_dtypes.bfloat16)
  big = rng.integers(0, 1 << 30, (3, 4096), dtype=np.int64)
  step = np.array(7, np.int64)
  meta_item, meta_raw = bytes_item("extra", {"epoch": 3, "name": "run"})
  ranks = {
      0: [(tensor_item("w", w[:2]), w[:2]), (meta_item, meta_raw),
          (tensor_item("step", step), step)],
      1: [(tensor_item("w", w[2:], (2, 0)), w[2:]), (tensor_item("h", h), h),
          (tensor_item("big", big), big)],
  }
  expected = {"w": w, "h": h, "big": big, "step": step, "extra": {"epoch": 3, "name": "run"}}
  return ranks, expected


def staged(rank, pairs):
  """A rank's ``(item, array)`` pairs as it stages them: each item's record, its bytes
  beside it."""
  return [Staged(item.record(i, rank, a), a) for i, (item, a) in enumerate(pairs)]


def metadata_for(ranks, shapes):
  """What rank 0's trainer pickles: DCP's Metadata with our layout as storage_data."""
  state, storage = {}, {}
  for rank, pairs in ranks.items():
    items = [item for item, _ in pairs]
    placements, _ = distcp.layout(rank, items)
    for item, where in zip(items, placements):
      if item.kind is distcp.ItemKind.BYTES:
        state[item.fqn] = dcp_metadata.BytesStorageMetadata()
        index = dcp_metadata.MetadataIndex(item.fqn)
      else:
        md = state.setdefault(item.fqn, dcp_metadata.TensorStorageMetadata(
            dcp_metadata.TensorProperties(dtype=getattr(torch, item.dtype)),
            torch.Size(shapes[item.fqn]), []))
        md.chunks.append(dcp_metadata.ChunkStorageMetadata(torch.Size(item.offsets),
                                                    torch.Size(item.sizes)))
        index = dcp_metadata.MetadataIndex(item.fqn, item.offsets)
      storage[index] = _StorageInfo(where.relative_path, where.offset, where.length)
  return pickle.dumps(dcp_metadata.Metadata(state_dict_metadata=state, planner_data=None,
                                     storage_data=storage, version="1.0.0"))


def write_checkpoint(path, ranks, expected):
  tmp = dcp_commit.create_tmp(path)
  sizes, sums = {}, {}
  for rank, pairs in ranks.items():
    items = [item for item, _ in pairs]
    _, sizes[rank] = distcp.layout(rank, items)
    # Items arrive in any order: the layout, not the arrival, places them (an item whose
    # predecessors' records have not come waits for them).
    sums[rank] = distcp.write_rank_part(tmp, rank, len(items), reversed(staged(rank, pairs)))
  shapes = {k: np.shape(v) for k, v in expected.items() if isinstance(v, np.ndarray)}
  final = dcp_commit.finalize(tmp, metadata=metadata_for(ranks, shapes), file_sizes=sizes,
                       manifest=Manifest(distcp.FORMAT, (), ()))
  return final, sums


def as_torch(a):
  return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == ml_dtypes.bfloat16 \
      else torch.from_numpy(np.array(a))


def target_like(expected):
  return {k: torch.zeros_like(as_torch(v)) if isinstance(v, np.ndarray) else None
          for k, v in expected.items()}


def test_stock_dcp_load_restores_it_bit_exact(tmp_path):
  ranks, expected = two_ranks()
  final, _ = write_checkpoint(tmp_path / "ckpt", ranks, expected)
  assert sorted(os.listdir(final)) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                       distcp.MANIFEST]
  state = target_like(expected)
  dcp.load(state, storage_reader=dcp.FileSystemReader(str(final)), no_dist=True)
  for k, v in expected.items():
    if isinstance(v, np.ndarray):
      assert state[k].dtype == as_torch(v).dtype
      assert torch.equal(state[k].view(torch.uint8) if v.ndim else state[k],
                         as_torch(v).view(torch.uint8) if v.ndim else as_torch(v)), k
    else:
      assert state[k] == v


def test_tensor_bytes_start_on_4k_and_read_back(tmp_path):
  ranks, expected = two_ranks()
  final, sums = write_checkpoint(tmp_path / "ckpt", ranks, expected)
  items = [item for item, _ in ranks[1]]
  placements, size = distcp.layout(1, items)
  assert os.path.getsize(final / "__1_0.distcp") == size
  big = placements[2]
  assert big.data_offset % 4096 == 0 and big.offset % 64 == 0
  out = np.empty_like(expected["big"])
  distcp.read_item(final, big, out)
  assert np.array_equal(out, expected["big"])
  assert sums[1][2] == items[2].record(2, 1, expected["big"]).with_crc32c(
      shard_crc32c(expected["big"]))
  assert sums[1][2].key_path == ("big",) and sums[1][2].index == ((0, 3), (0, 4096))


def test_a_ranks_items_are_written_in_turns_of_their_bytes(tmp_path):
  """With a turn (a pool tenant's share of the storage), every byte of an item is
  written holding one: the aligned part in pieces of at most TURN_BYTES, the tail too."""
  ranks, _ = two_ranks()
  tmp = dcp_commit.create_tmp(tmp_path / "ckpt")
  items = [item for item, _ in ranks[1]]
  turns = []

  def turn(nbytes):
    turns.append(nbytes)
    return contextlib.nullcontext()

  distcp.write_rank_part(tmp, 1, len(items), staged(1, ranks[1]), turn=turn)
  assert sum(turns) == sum(a.nbytes for _, a in ranks[1])
  assert max(turns) <= distcp.direct_io.TURN_BYTES


def test_nothing_is_visible_before_the_commit(tmp_path):
  ranks, expected = two_ranks()
  path = tmp_path / "ckpt"
  tmp = dcp_commit.create_tmp(path)
  items = [item for item, _ in ranks[0]]
  distcp.write_rank_part(tmp, 0, len(items), staged(0, ranks[0]))
  # Rank 1 never wrote: the commit refuses, and nothing is at the path.
  _, size0 = distcp.layout(0, items)
  _, size1 = distcp.layout(1, [item for item, _ in ranks[1]])
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"incomplete: rank 1's __1_0.distcp is missing"):
    dcp_commit.finalize(tmp, metadata=pickle.dumps(None), file_sizes={0: size0, 1: size1})
  assert not path.exists() and not distcp.is_checkpoint(path)
  # A new attempt starts from a clean tmp directory.
  assert dcp_commit.create_tmp(path) == tmp and os.listdir(tmp) == [dcp_commit.MADE_FILE]


def test_a_committed_checkpoint_is_replaced_whole(tmp_path):
  ranks, expected = two_ranks()
  path = tmp_path / "ckpt"
  write_checkpoint(path, ranks, expected)
  expected["w"] = expected["w"] + 1
  ranks[0][0] = (ranks[0][0][0], expected["w"][:2])
  ranks[1][0] = (ranks[1][0][0], expected["w"][2:])
  write_checkpoint(path, ranks, expected)
  state = target_like(expected)
  dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
  assert torch.equal(state["w"], torch.from_numpy(expected["w"]))
  assert sorted(os.listdir(tmp_path)) == ["ckpt"]
  tmp = dcp_commit.create_tmp(path)
  with pytest.raises(FileExistsError, match="already committed"):
    dcp_commit.finalize(tmp, metadata=pickle.dumps(None), file_sizes={}, replace=False)


def test_finalize_writes_the_trainers_bytes_and_never_unpickles(tmp_path):
  tmp = dcp_commit.create_tmp(tmp_path / "ckpt")
  with pytest.raises(errors.InvalidArgumentError, match="pickle bytes"):
    dcp_commit.finalize(tmp, metadata=b"not a pickle", file_sizes={})
  # A pickle whose loading would run code is only written, never loaded.
  evil = pickle.dumps(os.system)  # GLOBAL posix.system: loading it would import
  final = dcp_commit.finalize(tmp, metadata=evil, file_sizes={})
  assert (final / ".metadata").read_bytes() == evil


@pytest.mark.parametrize("kwargs, match", [
    (dict(fqn="", kind="bytes", nbytes=1), "non-empty str"),
    (dict(fqn="w", kind="tensor", nbytes=8, dtype="float32", sizes=(3,), offsets=(0,)),
     "holds 12 bytes, got nbytes 8"),
    (dict(fqn="w", kind="tensor", nbytes=12, dtype="float32", sizes=(3,), offsets=()),
     "holds 12 bytes"),
    (dict(fqn="w", kind="tensor", nbytes=3, dtype="object", sizes=(3,), offsets=(0,)),
     "has no torch.save storage"),
    (dict(fqn="b", kind="bytes", nbytes=3, dtype="uint8"), "no dtype"),
    (dict(fqn="b", kind="bytes", nbytes=-1), "nbytes must be an int >= 0"),
], ids=["fqn", "nbytes", "offsets", "dtype", "bytes-dtype", "negative"])
def test_bad_items_are_named(kwargs, match):
  with pytest.raises(errors.InvalidArgumentError, match=match):
    distcp.Item(**kwargs)


def test_an_item_round_trips_through_its_dict():
  item = distcp.Item(fqn="w", kind="tensor", nbytes=24, dtype="float32", sizes=(2, 3),
                  offsets=(2, 0))
  assert distcp.Item.from_dict(item.to_dict()) == item
  with pytest.raises(errors.InvalidArgumentError, match="malformed DCP item"):
    distcp.Item.from_dict({"fqn": "w"})


def test_write_rank_part_refuses_wrong_or_missing_data(tmp_path):
  tmp = dcp_commit.create_tmp(tmp_path / "ckpt")
  a = np.arange(6, dtype=np.float32)
  items = [tensor_item("a", a), tensor_item("b", a)]
  def first(data):  # item 0's record (of ``a``), with ``data`` beside it
    return Staged(items[0].record(0, 0, a), data)
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"rank 0's part is missing items number \[1\] of its 2"):
    distcp.write_rank_part(tmp, 0, 2, [first(a)])
  with pytest.raises(errors.InvalidArgumentError, match="expected dtype float32, got int32"):
    distcp.write_rank_part(tmp, 0, 2, [first(a.view(np.int32))])
  with pytest.raises(errors.InvalidArgumentError, match="expected 24 bytes"):
    distcp.write_rank_part(tmp, 0, 2, [first(a[:3])])
  with pytest.raises(errors.InvalidArgumentError, match="came twice"):
    distcp.write_rank_part(tmp, 0, 2, [first(a), first(a)])
  with pytest.raises(errors.InvalidArgumentError, match=r"item number 2: rank 0 has 2 items"):
    distcp.write_rank_part(tmp, 0, 2, [Staged(items[1].record(2, 0, a), a)])
  with pytest.raises(errors.InvalidArgumentError, match="is neither a tensor chunk"):
    distcp.write_rank_part(tmp, 0, 2, [Staged(ShardRecord.of(ShardId(("a",), ()), 0, a), a)])
  with pytest.raises(errors.InvalidArgumentError, match="not an uncommitted DCP checkpoint"):
    distcp.write_rank_part(tmp_path, 0, 2, [])


# Every dtype an archive holds, in every shape kind, at offsets of each alignment case.
@pytest.mark.parametrize("dtype", sorted(archive.ITEMSIZES))
def test_each_archive_is_what_torch_load_reads(dtype):
  rng = np.random.default_rng(1)
  np_dtype = np.dtype(getattr(ml_dtypes, dtype, dtype))
  for shape in [(), (3,), (2, 3), (1024, 5), (0, 4)]:
    for at in (0, 64, 4032):
      raw = rng.integers(0, 256, int(np.prod(shape)) * np_dtype.itemsize, dtype=np.uint8)
      if dtype == "bool":
        raw &= 1
      head = archive.header(dtype, shape, at=at)
      made = head + raw.tobytes() + archive.trailer(dtype, shape, at=at)
      assert (at + len(head)) % (4096 if raw.nbytes >= 4096 else 64) == 0
      assert len(made) == archive.archive_length(dtype, shape, at=at)
      t = torch.load(io.BytesIO(made), weights_only=True)
      assert t.dtype == getattr(torch, dtype) and tuple(t.shape) == shape
      assert t.reshape(-1).view(torch.uint8).numpy().tobytes() == raw.tobytes()


def test_zip64_archives_load_too(monkeypatch):
  # Archives over 4 GiB take zip64 entries; lowering the threshold makes every one so.
  monkeypatch.setattr(archive, "ZIP64_AT", 0)
  a = np.arange(2048, dtype=np.float32).reshape(2, 1024)
  made = (archive.header("float32", a.shape, at=64) + a.tobytes()
          + archive.trailer("float32", a.shape, at=64))
  assert b"PK\x06\x06" in made  # the zip64 end of central directory
  assert np.array_equal(torch.load(io.BytesIO(made), weights_only=True).numpy(), a)


def test_an_archive_start_off_64_bytes_is_refused():
  with pytest.raises(errors.InvalidArgumentError, match="starts on 64 bytes"):
    archive.header("float32", (3,), at=10)
