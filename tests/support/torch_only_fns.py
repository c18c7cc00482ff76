"""A pipeline a PyTorch-only install serves: no Grain, no JAX
(``--import tests.support.torch_only_fns``; tests/processes/torch/test_no_jax.py)."""

from typing import NamedTuple

import numpy as np

import sidecar


class Pair(NamedTuple):
  a: np.ndarray
  b: list


def element(i: int) -> dict:
  """Every container the feed carries: a dict (keys out of order), a namedtuple, a list
  with a None, a tuple."""
  return {"z": np.full((3,), i, np.float32), "pair": Pair(np.int32(i), [None, np.int64(-i)]),
          "a": (np.float64(i / 2),)}


@sidecar.pipeline
def nested(ctx: sidecar.PipelineContext, n: int = 64):
  """A plain iterable of this shard's elements, from ``ctx.position``."""
  for i in range(ctx.shard_index, n, ctx.shard_count)[ctx.position:]:
    yield element(i)
