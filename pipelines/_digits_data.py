"""The data both digits pipelines read (``pipelines.digits``, ``pipelines.digits_iterable``):
scikit-learn's bundled 8x8 handwritten digits, split by position."""

from __future__ import annotations

import numpy as np
from sklearn import datasets

SPLITS = {"train": slice(0, 1500), "test": slice(1500, None)}


def load(split: str) -> tuple[np.ndarray, np.ndarray]:
  """``split``'s images (float32 ``[n, 8, 8, 1]`` in [0, 1]) and labels (int32 ``[n]``).

  Raises:
    ValueError: ``split`` is not ``"train"`` or ``"test"``.
  """
  if split not in SPLITS:
    raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
  data = datasets.load_digits()
  images = (data.images[SPLITS[split], :, :, None] / 16.0).astype(np.float32)
  return images, data.target[SPLITS[split]].astype(np.int32)
