"""A TensorFlow Datasets dataset as a pipeline, read without TensorFlow.

Reads through ``tfds.data_source``: random access to a dataset prepared in the
``array_record`` format, which needs no TensorFlow. Prepare it once, where the
sidecars can read it::

  tfds build mnist --file_format=array_record --data_dir=/data/tfds

The sidecar never downloads or prepares anything (``download=False``): a
dataset that is missing, or prepared only as TFRecord, fails at once.

Example::

  # sidecar serve --import pipelines.tfds
  feed = ctl.feed("tfds", global_batch_size=128, sharding=sharding,
                  kwargs={"name": "mnist", "split": "train", "data_dir": "/data/tfds"})
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

import sidecar

try:
  import tensorflow_datasets as tfds_lib
except ImportError as e:  # Not in the core install: an extra.
  raise ImportError(
      "pipelines.tfds needs tensorflow-datasets: pip install 'colocated-sidecar[tfds]'") from e


@sidecar.pipeline
def tfds(ctx: sidecar.PipelineContext, *, name: str, split: str, data_dir: str | None = None,
         keys: Sequence[str] | None = None) -> grain.MapDataset:
  """The examples of one split of a TFDS dataset, as dicts of numpy arrays.

  Args:
    ctx: unused: the framework shards, shuffles and positions a MapDataset.
    name: the TFDS name, optionally with config and version (``"mnist:3.0.1"``).
    split: a TFDS split, slices included (``"train"``, ``"train[:90%]"``).
    data_dir: where the dataset was prepared; TFDS's default if None.
    keys: the features to keep (all if None); leave out strings and
      variable-shaped features, which cannot be batched.

  Returns:
    A MapDataset of ``{key: numpy array}``, shapes and dtypes as TFDS decodes them.

  Raises:
    FileNotFoundError: the dataset is not prepared in ``array_record`` format.
    ValueError: an unknown dataset, split or key.
    TypeError: a kept feature decodes to strings or objects.
  """
  del ctx
  try:
    source = tfds_lib.data_source(name, split=split, data_dir=data_dir, download=False)
  except NotImplementedError as e:  # What TFDS raises when no array_record files exist.
    raise FileNotFoundError(
        f"TFDS dataset {name!r} has no array_record files under data_dir={data_dir!r}: "
        f"prepare it with `tfds build {name} --file_format=array_record "
        "--data_dir=DIR` and pass data_dir=DIR") from e
  keys = list(keys) if keys is not None else None
  if len(source):
    _to_numpy(keys, source[0])  # Fail now, not in the middle of a feed.
  return grain.MapDataset.source(source).map(functools.partial(_to_numpy, keys))


def _to_numpy(keys: list[str] | None, example: Mapping[str, Any]) -> dict[str, np.ndarray]:
  if keys is not None:
    unknown = [k for k in keys if k not in example]
    if unknown:
      raise ValueError(f"keys {unknown} are not features of this dataset; "
                       f"its features are {sorted(example)}")
  element = {}
  for key in keys if keys is not None else example:
    value = np.asarray(example[key])
    if value.dtype.kind in "OSUV":
      raise TypeError(f"feature {key!r} decodes to {value.dtype} values, which cannot be "
                      f"batched into fixed-size buffers; leave it out with keys=[...]")
    element[key] = value
  return element
