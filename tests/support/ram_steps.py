"""Sidecar steps (``server/checkpoint/step.Step``) as tests make them: driven through their
transitions to the phase a test needs, as the sidecar's stage, writer and RAM tier drive
them, with no writer thread or format."""

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sidecar._src.ckptfmt.format import Numbering
from sidecar._src.ckptfmt.records import ShardId, ShardRecord, Staged
from sidecar._src.server.checkpoint import step as step_lib


class AsStaged(Numbering):
  """Takes each Stage's shards as they are (a format whose numbering checks nothing)."""

  def take(self, extra: Any, shards: Sequence[Staged]) -> list[Staged]:
    return list(shards)


def shards_of(data: Mapping[ShardId, np.ndarray]) -> list[Staged]:
  """Each array of ``data`` as a staged shard of leaf 0, its record made from it."""
  return [Staged(ShardRecord.of(key, 0, value), value) for key, value in data.items()]


def make_step(directory: str, step: int, final_dir: str,
              data: Mapping[ShardId, np.ndarray] | None = None, *, written: bool = True,
              staged: bool = True, owner: str = "a") -> step_lib.Step:
  """A step of ``data`` (staged whole unless ``staged=False``; its write ended unless
  ``written=False``, its shards taken from the writer's queue as a writer would)."""
  own = step_lib.Step(directory, step, final_dir, tmp_dir=f"{final_dir}.tmp",
                      numbering=AsStaged())
  own.take(owner, None, shards_of(data or {}), last=staged, writers=1)
  if written:
    shards = list(own.arrivals(0.0))
    own.end_write([s.record for s in shards])
    del shards
  return own
