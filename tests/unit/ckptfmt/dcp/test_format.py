"""DCP's numbering of staged shards: each record is its item, numbered in its rank's part."""

import dataclasses

import numpy as np
import pytest

from sidecar._src.ckptfmt.dcp import DcpPart, Item, ItemKind
from sidecar._src.ckptfmt.dcp.format import MAX_RANKS, ItemNumbering
from sidecar._src.ckptfmt.records import ShardId, Staged
from sidecar._src.core import errors

pytestmark = pytest.mark.unit

W = np.arange(6, dtype=np.float32).reshape(2, 3)
ITEMS = (Item(fqn="w", kind=ItemKind.TENSOR, nbytes=W.nbytes, dtype="float32", sizes=(2, 3),
              offsets=(2, 0)),
         Item(fqn="extra", kind=ItemKind.BYTES, nbytes=5))
BLOB = np.zeros(5, np.uint8)
SCALAR = np.zeros((), np.uint8)


def test_a_ranks_records_are_taken_as_they_are_and_its_item_count_kept():
  numbering = ItemNumbering()
  shards = [Staged(ITEMS[0].record(0, 3, W, host=1), W),
            Staged(ITEMS[1].record(1, 3, BLOB, host=1), BLOB)]
  assert numbering.take(DcpPart(3, 2), shards) == shards
  assert shards[0].record.id == ShardId(("w",), ((2, 4), (0, 3)))  # keyed as the RAM tier's
  assert (shards[1].record.rank, shards[1].record.shape) == (3, (5,))
  assert numbering.counts == {3: 2}
  later = [Staged(ITEMS[0].record(0, 3, W), W)]  # a later part: the same count
  assert numbering.take(DcpPart(3, 2), later) == later
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"^dcp.item_count: rank 3 has 2 items \(its first part said so\), "
                           r"this part says 5$"):
    numbering.take(DcpPart(3, 5), later)


@pytest.mark.parametrize("item, data", [
    (ITEMS[0], W), (ITEMS[1], BLOB),
    (Item(fqn="s", kind=ItemKind.TENSOR, nbytes=1, dtype="uint8"), SCALAR),  # a 0-d uint8
    (Item(fqn="e", kind=ItemKind.BYTES, nbytes=0), np.zeros(0, np.uint8)),
], ids=["chunk", "bytes", "scalar-uint8", "empty-bytes"])
def test_each_item_is_its_record(item, data):
  assert Item.of_record(item.record(4, 0, data)) == item


@pytest.mark.parametrize("change, match", [
    ({"id": ShardId(("a", "b"), ((2, 4), (0, 3)))}, r"has one key, its fqn"),
    ({"id": ShardId(("w",), ((2, 5), (0, 3)))}, r"a tensor chunk's index spans its shape"),
    ({"id": ShardId(("w",), ())}, r"is neither a tensor chunk .* nor a bytes item"),
    ({"nbytes": 4}, r"holds 24 bytes, got nbytes 4"),
    ({"dtype": "object"}, r"has no torch.save storage"),
], ids=["two-keys", "index-off-shape", "no-index", "nbytes", "dtype"])
def test_a_record_that_is_no_item_is_refused_naming_it(change, match):
  record = dataclasses.replace(ITEMS[0].record(0, 3, W), **change)
  with pytest.raises(errors.InvalidArgumentError, match=match):
    Item.of_record(record)
  with pytest.raises(errors.InvalidArgumentError, match=match):  # at its Stage
    ItemNumbering().take(DcpPart(3, 1), [Staged(record, W)])


@pytest.mark.parametrize("staged, match", [
    (Staged(ITEMS[0].record(0, 4, W), W), r"of rank 4: rank 3's part has items 0 to 1"),
    (Staged(ITEMS[0].record(2, 3, W), W), r"^shard of item 2 names \['w'\] of rank 3: rank 3's"),
], ids=["another-rank", "past-the-end"])
def test_a_record_out_of_its_ranks_part_is_refused(staged, match):
  numbering = ItemNumbering()
  with pytest.raises(errors.InvalidArgumentError, match=match):
    numbering.take(DcpPart(3, 2), [staged])
  assert numbering.counts == {}  # nothing recorded


def test_a_step_takes_the_parts_of_at_most_max_ranks_ranks():
  # Each rank's file has a writer thread of its own: a client naming a new rank in each
  # part started one each, unbounded (issue 76, the threads a Stage starts).
  numbering = ItemNumbering()
  for rank in range(MAX_RANKS):
    numbering.take(DcpPart(rank, 1), [Staged(ITEMS[1].record(0, rank, BLOB), BLOB)])
  with pytest.raises(errors.InvalidArgumentError,
                     match=rf"^dcp.rank 999: this step has the parts of {MAX_RANKS} ranks on "
                           rf"this sidecar already, the most one step may \(MAX_RANKS"):
    numbering.take(DcpPart(999, 1), [Staged(ITEMS[1].record(0, 999, BLOB), BLOB)])
  numbering.take(DcpPart(0, 1), [])  # a rank it has: taken
