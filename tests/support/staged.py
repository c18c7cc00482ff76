"""Staged shards as tests make them: each a record (``records.ShardRecord``) with its
bytes beside it (``records.Staged``), as a trainer stages them."""

from collections.abc import Sequence

import numpy as np

from sidecar._src.ckptfmt.records import ShardId, ShardRecord, Staged


def staged(key_path: Sequence, leaf: int, index: Sequence, data, *, host: int | None = None,
           rank: int | None = None) -> Staged:
  """Shard ``index`` of leaf number ``leaf`` (named ``key_path``), its bytes ``data``."""
  data = np.asarray(data)
  return Staged(ShardRecord.of(ShardId(tuple(key_path), tuple(index)), leaf, data, host=host,
                               rank=rank), data)
