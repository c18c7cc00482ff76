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
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

import sidecar
from pipelines._files import Holding

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
    ctx: where the data may be (``ctx.data_path``); the framework shards, shuffles and
      positions a MapDataset.
    name: the TFDS name, optionally with config and version (``"mnist:3.0.1"``).
    split: a TFDS split, slices included (``"train"``, ``"train[:90%]"``).
    data_dir: where the dataset was prepared; TFDS's default if None.
    keys: the features to keep (all if None); leave out strings and
      variable-shaped features, which cannot be batched.

  Returns:
    A MapDataset of ``{key: numpy array}``, shapes and dtypes as TFDS decodes them.

  Raises:
    NotFoundError: the dataset is not prepared in ``array_record`` format.
    PermissionDeniedError: in a pool, ``data_dir`` outside the feed's data roots (or
      none given: TFDS's default is no tenant's).
    ValueError: an unknown dataset, split or key.
    TypeError: a kept feature decodes to strings or objects.
  """
  prepare = (f"prepare it with `tfds build {name} --file_format=array_record "
             "--data_dir=DIR` and pass data_dir=DIR")
  view = None  # TFDS's own default data_dir, as always outside a pool
  checked = None  # in a pool: the dataset's directory, whose view alone TFDS may read
  if data_dir is not None or ctx.data_roots.roots is not None:
    # TFDS opens its files by path: it reads a view of the dataset's directory (in a pool,
    # a private tree of its files opened beneath the feed's data roots), held by the source.
    directory = ctx.data_path(data_dir or _default_data_dir()) / _dataset_dir(name)
    if ctx.data_roots.roots is not None:
      checked = str(directory)
    try:
      view = directory.view()
    except sidecar.NotFoundError as e:
      raise sidecar.NotFoundError(f"TFDS dataset {name!r} is not prepared: {e}; {prepare}") \
          from e
  try:
    source = _source(name, split, data_dir, None if view is None else view.path, prepare)
    if view is not None and checked is not None:
      _check_shards(name, split, source, os.path.dirname(view.path), checked)
    keys = list(keys) if keys is not None else None
    if len(source):
      _to_numpy(keys, source[0])  # Fail now, not in the middle of a feed.
  except BaseException:
    if view is not None:
      view.close()  # its files, counted against the tenant, go now
    raise
  return grain.MapDataset.source(Holding(source, view)).map(functools.partial(_to_numpy, keys))


def _source(name: str, split: str, data_dir: str | None, view: str | None,
            prepare: str) -> Any:
  """TFDS's data source of the split, read from the view at ``view`` (a path).

  Loaded in a thread of its own: TFDS keeps an exception it caught (for a name it has no
  builder class of) in a cycle through its traceback, whose frames lead to the bottom of
  the stack it ran on, each keeping its locals; on the feed's own thread those would hold
  the dataset, its view's files (counted against the tenant) and its readers' files until
  the collector found the cycle, long after the feed ended.
  """
  box: list[Any] = []

  def load() -> None:
    try:
      box.append(tfds_lib.data_source(
          name, split=split, download=False,
          data_dir=None if view is None else os.path.dirname(view)))
    except BaseException as e:  # raised on the caller's thread, below
      box.append(e)

  loader = threading.Thread(target=load, name=f"tfds-load-{name}")
  loader.start()
  loader.join()
  result = box.pop()
  if isinstance(result, NotImplementedError):  # What TFDS raises with no array_record files.
    raise sidecar.NotFoundError(
        f"TFDS dataset {name!r} has no array_record files under data_dir={data_dir!r}: "
        f"{prepare}") from result
  if isinstance(result, BaseException):
    raise result
  return result


def _check_shards(name: str, split: str, source: Any, data_dir: str, directory: str) -> None:
  """Refuses a dataset whose metadata names a shard outside its view (``data_dir``), before
  any shard is opened: TFDS formats each shard's path from its ``dataset_info.json``
  (``splits[].filepathTemplate``) and joins it to the data_dir, so an absolute template,
  or one that climbs with ``..``, would open files the view never checked (another
  tenant's). The paths checked are those its reader will open, as TFDS computed them.

  Raises:
    PermissionDeniedError: naming the shard, its split's template and the fix.
  """
  inside = [p for p in data_dir.split("/") if p]
  info = source.dataset_info
  asked = info.splits[split]  # what its reader opens; every split's template besides
  named = [(split, getattr(asked, "filename_template", None), os.fspath(f.filename))
           for f in asked.file_instructions]
  for split_info in info.splits.values():
    template = split_info.filename_template
    if template is not None and split_info.num_shards:
      named += [(split_info.name, template, os.fspath(f))
                for f in template.sharded_filepaths(split_info.num_shards)]
  for which, template, path in named:
    parts = path.split("/")
    if (path.startswith("/") and [p for p in parts if p][:len(inside)] == inside
        and ".." not in parts):
      continue
    shown = path.replace(data_dir, os.path.dirname(directory), 1)
    raise sidecar.PermissionDeniedError(
        f"TFDS dataset {name!r} in {directory!r:.300}: its dataset_info.json has split "
        f"{which!r} read from {shown!r:.300} (its filepathTemplate "
        f"{getattr(template, 'template', None)!r:.200}), outside the dataset's own "
        "directory; a pool tenant's TFDS datasets read only the files in their directory: "
        "prepare it again (`tfds build`), or give each split a filepathTemplate relative to "
        "its version's directory, with no '..'")


def _default_data_dir() -> str:
  return os.path.expanduser(tfds_lib.core.constants.DATA_DIR)


def _dataset_dir(name: str) -> str:
  """The directory of dataset ``name`` (``"mnist/config:1.0.0"``: ``mnist``) in a data_dir."""
  dataset, _ = tfds_lib.core.naming.parse_builder_name_kwargs(name)
  return dataset.name


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
