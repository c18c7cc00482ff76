"""The handwritten digits of ``pipelines.digits``, as a plain iterable: no Grain, no JAX.

The same data, splits and element specs as ``pipelines.digits``, registered under the same
name, ``digits`` (a sidecar imports one of the two), for a sidecar beside a PyTorch job
installed without JAX (``pip install 'colocated-sidecar[torch,digits]'``). It does what the
framework does for a Grain ``MapDataset`` itself: each epoch is a permutation of the
split drawn from ``(seed, epoch)``, dealt round-robin to the shards, and a shard resumes
after its first ``position`` elements. Unlike a MapDataset's, the position is per shard, so
a feed resumes exactly on the same number of hosts.

Example::

  # sidecar serve --import pipelines.digits_iterable
  loader = sidecar.torch.DataLoader("digits", batch_size=32, kwargs={"split": "train"}, seed=0)
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

import sidecar

try:
  from pipelines import _digits_data
except ImportError as e:  # Not in the core install: an extra.
  raise ImportError(
      "pipelines.digits_iterable needs scikit-learn: pip install "
      "'colocated-sidecar[digits]'") from e


@sidecar.pipeline(name="digits")
def digits(ctx: sidecar.PipelineContext, *, split: str = "train",
           shuffle: bool = True) -> Iterator[dict[str, np.ndarray]]:
  """This shard's digits of ``split`` in epoch ``ctx.epoch``, after ``ctx.position`` of them.

  Args:
    ctx: which shard, which epoch, and where in it to start.
    split: ``"train"`` (1,500 examples) or ``"test"`` (297 examples).
    shuffle: each epoch in an order drawn from ``(ctx.seed, ctx.epoch)``; else in
      scikit-learn's order.

  Returns:
    An iterator of ``{"image": float32[8, 8, 1] in [0, 1], "label": int32}``.

  Raises:
    ValueError: ``split`` is not ``"train"`` or ``"test"``.
  """
  images, labels = _digits_data.load(split)
  order = (np.random.default_rng([ctx.seed, ctx.epoch]).permutation(len(labels)) if shuffle
           else np.arange(len(labels)))
  mine = order[ctx.shard_index::ctx.shard_count][ctx.position:]
  return ({"image": images[i], "label": labels[i]} for i in mine)
