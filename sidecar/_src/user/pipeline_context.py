"""What a registered pipeline is told about its place in the job."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PipelineContext:
  """Passed as the first argument of every ``@sidecar.pipeline`` function.

  A pipeline that returns a Grain ``MapDataset`` can ignore the shard fields: the
  framework then shards, shuffles (by ``seed`` and ``epoch``) and positions it
  globally itself. A pipeline that returns any other iterable must yield only its
  own shard's elements (``shard_index`` of ``shard_count``) starting after the
  first ``position`` of them, so that it can resume.

  Attributes:
    shard_index: which shard of the data this pipeline instance produces.
    shard_count: how many shards there are in all.
    seed: the feed's seed; equal seeds give equal streams.
    epoch: the epoch being produced, from 0.
    position: elements of this shard (in this epoch) already consumed; start after them.
  """
  shard_index: int
  shard_count: int
  seed: int = 0
  epoch: int = 0
  position: int = 0

  def __post_init__(self):
    if not 0 <= self.shard_index < self.shard_count:
      raise ValueError(f"shard_index must be in [0, shard_count={self.shard_count}), "
                       f"got {self.shard_index!r}")
    if self.position < 0 or self.epoch < 0:
      raise ValueError(f"position and epoch must be >= 0, got {self.position!r}, {self.epoch!r}")
