"""The data both digits pipelines read (``pipelines.digits``, ``pipelines.digits_iterable``):
scikit-learn's bundled 8x8 handwritten digits, split by position.

Read from the file scikit-learn ships them in (``sklearn/datasets/data/digits.csv.gz``),
as ``sklearn.datasets.load_digits`` reads it, without importing scikit-learn: that import
took 1.7 s of CPU in every sidecar, feed worker and trainer that imported a digits pipeline,
50 times what reading the file takes (0.03 s). So scikit-learn must be installed, not
imported; ``load_digits`` gives the same arrays (tests/unit/pipelines/test_digits.py).
"""

from __future__ import annotations

import gzip
import importlib.util
import os

import numpy as np

SPLITS = {"train": slice(0, 1500), "test": slice(1500, None)}

_SKLEARN = importlib.util.find_spec("sklearn")  # where it is installed; nothing imported
if _SKLEARN is None or not _SKLEARN.submodule_search_locations:
  raise ImportError("No module named 'sklearn'", name="sklearn")
CSV = os.path.join(list(_SKLEARN.submodule_search_locations)[0], "datasets", "data",
                   "digits.csv.gz")


def _all() -> tuple[np.ndarray, np.ndarray]:
  """Every example, in scikit-learn's order: images (float64 ``[1797, 8, 8]`` in [0, 16]),
  labels (int ``[1797]``); what ``load_digits()`` returns as ``images`` and ``target``."""
  with gzip.open(CSV, mode="rt", encoding="utf-8") as f:
    data = np.loadtxt(f, delimiter=",")
  return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


def load(split: str) -> tuple[np.ndarray, np.ndarray]:
  """``split``'s images (float32 ``[n, 8, 8, 1]`` in [0, 1]) and labels (int32 ``[n]``).

  Raises:
    ValueError: ``split`` is not ``"train"`` or ``"test"``.
  """
  if split not in SPLITS:
    raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
  images, labels = _all()
  return ((images[SPLITS[split], :, :, None] / 16.0).astype(np.float32),
          labels[SPLITS[split]].astype(np.int32))
