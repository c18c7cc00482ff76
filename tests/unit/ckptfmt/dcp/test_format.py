"""DCP's numbering of staged shards: each record names its rank's item by number, id and rank."""

import numpy as np
import pytest

from sidecar._src.ckptfmt.dcp import DcpPart, Item, ItemKind
from sidecar._src.ckptfmt.dcp.format import ItemNumbering
from sidecar._src.ckptfmt.records import ShardId, Staged
from sidecar._src.core import errors

pytestmark = pytest.mark.unit

W = np.arange(6, dtype=np.float32).reshape(2, 3)
ITEMS = (Item(fqn="w", kind=ItemKind.TENSOR, nbytes=W.nbytes, dtype="float32", sizes=(2, 3),
              offsets=(2, 0)),
         Item(fqn="extra", kind=ItemKind.BYTES, nbytes=5))
BLOB = np.zeros(5, np.uint8)


def test_a_ranks_records_are_taken_as_they_are_and_its_items_kept():
  numbering = ItemNumbering()
  shards = [Staged(ITEMS[0].record(0, 3, W, host=1), W),
            Staged(ITEMS[1].record(1, 3, BLOB, host=1), BLOB)]
  assert numbering.take(DcpPart(3, ITEMS), shards) == shards
  assert shards[0].record.id == ShardId(("w",), ((2, 4), (0, 3)))  # keyed as the RAM tier's
  assert (shards[1].record.rank, shards[1].record.shape) == (3, (5,))
  assert numbering.items == {3: ITEMS}
  later = [Staged(ITEMS[0].record(0, 3, W), W)]  # a later part: the rank's items as kept
  assert numbering.take(DcpPart(3, ()), later) == later


@pytest.mark.parametrize("staged, match", [
    (Staged(ITEMS[0].record(0, 4, W), W), r"of rank 4: rank 3's item 0 is 'w'"),
    (Staged(ITEMS[0].record(1, 3, W), W), r"names \['w'\] .* rank 3's item 1 is 'extra'"),
    (Staged(ITEMS[0].record(2, 3, W), W), r"^shard of item 2: rank 3 has 2 items$"),
], ids=["another-rank", "another-item", "past-the-end"])
def test_a_record_that_names_another_item_is_refused(staged, match):
  numbering = ItemNumbering()
  with pytest.raises(errors.InvalidArgumentError, match=match):
    numbering.take(DcpPart(3, ITEMS), [staged])
  assert numbering.items == {}  # nothing recorded
