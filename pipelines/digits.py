"""The handwritten digits dataset that scikit-learn ships, as a pipeline.

1,797 grey 8x8 images of the digits 0-9, read from the copy bundled inside
scikit-learn (``sklearn.datasets.load_digits``): nothing is downloaded, so it is
the smallest real dataset a sidecar can feed offline. ``pipelines.digits_iterable``
registers the same data under the same name without Grain (and so without JAX), for
PyTorch jobs.

Split: a fixed split by position in scikit-learn's order, which cycles through
the classes, so both parts are balanced (every class has 146-153 train and 27-33
test examples): ``"train"`` is examples ``[0, 1500)``, ``"test"`` is
``[1500, 1797)``.

Licence: scikit-learn, which bundles the data, is BSD-3-Clause. The data is the
test set of the UCI "Optical Recognition of Handwritten Digits" dataset
(E. Alpaydin and C. Kaynak, 1998), which the UCI Machine Learning Repository
distributes under CC BY 4.0: cite it if you publish results.

Example::

  # sidecar serve --import pipelines.digits
  feed = ctl.feed("digits", global_batch_size=64, sharding=sharding, kwargs={"split": "train"},
                  seed=0)
"""

from __future__ import annotations

import grain

import sidecar

try:
  from pipelines import _digits_data
except ImportError as e:  # Not in the core install: an extra.
  raise ImportError(
      "pipelines.digits needs scikit-learn: pip install 'colocated-sidecar[demo]'") from e

SPLITS = _digits_data.SPLITS


@sidecar.pipeline
def digits(ctx: sidecar.PipelineContext, *, split: str = "train") -> grain.MapDataset:
  """The digits ``split`` as a MapDataset; the framework shards and shuffles it.

  Args:
    ctx: unused: the framework shards, shuffles and positions a MapDataset.
    split: ``"train"`` (1,500 examples) or ``"test"`` (297 examples).

  Returns:
    A MapDataset of ``{"image": float32[8, 8, 1] in [0, 1], "label": int32}``.

  Raises:
    ValueError: ``split`` is not ``"train"`` or ``"test"``.
  """
  del ctx
  images, labels = _digits_data.load(split)
  return grain.MapDataset.source(
      [{"image": image, "label": label} for image, label in zip(images, labels)])
