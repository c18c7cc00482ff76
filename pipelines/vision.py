"""Image classification over JPEG files as a pipeline: decode, random-resized crop, flip.

The data is a directory of ArrayRecord shards whose records are ``label`` (uint32,
little-endian) then a JPEG file's bytes, with a JSON manifest beside them;
:func:`write_images` writes one (``examples/vision/prepare.py`` fills it with synthetic
images whose label is learnable: a class is a shape and a colour, drawn at random
places and sizes over a noisy background, then encoded as real JPEGs). Each element is
decoded and augmented on the host's CPUs by ``pipelines.images.decode_augment`` with a
generator seeded by (the feed's seed, the image's index): the same crop and flip for the
same image on any host and in any feed worker, before and after a restart. The pipeline
returns a ``grain.MapDataset``, so the framework shards, shuffles and positions it
(``workers=N`` decodes in N processes), and a feed's state records the data it was made
from (:func:`images_identity`: the manifest's digest).

Example::

  # sidecar serve --import pipelines.vision
  feed = ctl.feed("vision", global_batch_size=128, sharding=sharding, seed=0,
                  kwargs={"data": "/data/shapes", "image_size": 224},
                  options=sidecar.FeedOptions(workers=8))
  # each batch: {"image": uint8[128, 224, 224, 3], "label": int32[128]}
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from collections.abc import Iterable

import grain
import numpy as np

import sidecar
from pipelines import images

try:
  from array_record.python import array_record_module
except ImportError as e:  # Not in the core install: an extra.
  raise ImportError(
      "pipelines.vision needs array-record: pip install 'colocated-sidecar[vision]'") from e

MANIFEST = "manifest.json"
FORMAT = "sidecar-jpeg-labels/1"
_LABEL = struct.Struct("<I")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
  """What :func:`write_images` wrote: how many images, their classes, size and shards."""
  count: int
  num_classes: int
  image_size: int  # the side of every stored JPEG
  shards: tuple[str, ...]  # file names, relative to the manifest's directory, in order
  records: tuple[int, ...]  # records of each shard
  jpeg_bytes: int = 0  # the JPEGs' bytes, in all

  def to_dict(self) -> dict:
    return {"format": FORMAT, "count": self.count, "num_classes": self.num_classes,
            "image_size": self.image_size, "shards": list(self.shards),
            "records": list(self.records), "jpeg_bytes": self.jpeg_bytes}

  @classmethod
  def from_dict(cls, d: dict) -> Manifest:
    if d.get("format") != FORMAT:
      raise ValueError(f"manifest format is {d.get('format')!r}, expected {FORMAT!r}: write "
                       "the images with pipelines.vision.write_images "
                       "(examples/vision/prepare.py)")
    return cls(count=int(d["count"]), num_classes=int(d["num_classes"]),
               image_size=int(d["image_size"]), shards=tuple(d["shards"]),
               records=tuple(int(r) for r in d["records"]),
               jpeg_bytes=int(d.get("jpeg_bytes", 0)))


def write_images(directory: str | os.PathLike, examples: Iterable[tuple[bytes, int]], *,
                 num_classes: int, image_size: int, per_shard: int = 4096) -> Manifest:
  """Writes ``(jpeg bytes, label)`` pairs as ArrayRecord shards of ``per_shard`` records,
  with the manifest, into ``directory`` (made if missing; its manifest and shards are
  replaced); returns the manifest."""
  if per_shard < 1:
    raise ValueError(f"per_shard must be at least 1, got {per_shard!r}")
  os.makedirs(directory, exist_ok=True)
  shards: list[str] = []
  records: list[int] = []
  writer = None
  total = 0
  try:
    for jpeg, label in examples:
      if not 0 <= label < num_classes:
        raise ValueError(f"label {label!r} is not in [0, num_classes={num_classes})")
      if writer is None or records[-1] == per_shard:
        if writer is not None:
          writer.close()
        shards.append(f"images-{len(shards):05d}.array_record")
        records.append(0)
        writer = array_record_module.ArrayRecordWriter(
            os.path.join(directory, shards[-1]), "group_size:1")
      writer.write(_LABEL.pack(label) + jpeg)
      records[-1] += 1
      total += len(jpeg)
  finally:
    if writer is not None:
      writer.close()
  manifest = Manifest(count=sum(records), num_classes=num_classes, image_size=image_size,
                      shards=tuple(shards), records=tuple(records), jpeg_bytes=total)
  with open(os.path.join(directory, MANIFEST), "w") as f:
    json.dump(manifest.to_dict(), f, indent=1)
  return manifest


def _data_path(directory: str | os.PathLike | sidecar.DataPath) -> sidecar.DataPath:
  return directory if isinstance(directory, sidecar.DataPath) else sidecar.DataPath(directory)


def read_manifest(directory: str | os.PathLike | sidecar.DataPath) -> tuple[Manifest, bytes]:
  """The manifest of the images in ``directory``, and its bytes.

  Raises:
    NotFoundError: ``directory`` holds no manifest (the images were not prepared).
  """
  path = _data_path(directory) / MANIFEST
  try:
    with path.open() as f:
      text = f.read()
  except FileNotFoundError as e:
    raise sidecar.NotFoundError(
        f"no image manifest at {path}: run examples/vision/prepare.py --out {directory}"
    ) from e
  return Manifest.from_dict(json.loads(text)), text


class Records:
  """Random access to ``(jpeg bytes, label)`` records (a Grain data source)."""

  def __init__(self, directory: str | os.PathLike | sidecar.DataPath):
    directory = _data_path(directory)
    self.manifest, _ = read_manifest(directory)
    # Each shard a name in the directory (no '..', not absolute), opened beneath it and
    # held open while its reader may open it by ``library_path``.
    self._files = [(directory / name).open() for name in self.manifest.shards]
    self._source = grain.sources.ArrayRecordDataSource([f.library_path for f in self._files])

  def __len__(self) -> int:
    return self.manifest.count

  def __getitem__(self, i: int) -> tuple[bytes, int]:
    record = self._source[i]
    return record[_LABEL.size:], _LABEL.unpack_from(record)[0]


def example(record: tuple[bytes, int], *, index: int, seed: int, image_size: int,
            train: bool) -> dict[str, np.ndarray]:
  """One element: the record's JPEG decoded and augmented (``pipelines.images``), with its
  label; the randomness from (``seed``, ``index``)."""
  jpeg, label = record
  rng = np.random.default_rng([seed, index])
  return {"image": images.decode_augment(jpeg, rng, size=image_size, train=train),
          "label": np.asarray(label, np.int32)}


def images_identity(ctx: sidecar.PipelineContext, *, data: str, image_size: int,
                    train: bool = True) -> str:
  """What names the images in ``data``: its manifest's sha256 and count, as a feed's state
  records it. Read as the pipeline reads it: beneath its tenant's data roots, in a pool."""
  del image_size, train  # the same images, however they are cropped
  manifest, text = read_manifest(ctx.data_path(data))
  return (f"images sha256:{hashlib.sha256(text).hexdigest()[:16]} "
          f"({manifest.count:,} images)")


@sidecar.pipeline(identity=images_identity)
def vision(ctx: sidecar.PipelineContext, *, data: str, image_size: int,
           train: bool = True) -> grain.MapDataset:
  """The images in ``data``, decoded and augmented to ``image_size`` x ``image_size``.

  Args:
    ctx: where the images may be (``ctx.data_path``) and the feed's seed (the crops').
    data: a directory written by :func:`write_images`.
    image_size: the side of each element's image.
    train: random-resized crops and flips; False: each image's centre square, resized.

  Returns:
    A MapDataset of ``{"image": uint8[image_size, image_size, 3], "label": int32}``.

  Raises:
    NotFoundError: ``data`` holds no prepared images, or a shard its manifest names.
    PermissionDeniedError: in a pool, ``data`` (or a shard) outside the feed's data roots.
    ValueError: ``image_size`` below 1.
  """
  image_size = int(image_size)
  if image_size < 1:
    raise ValueError(f"image_size must be at least 1, got {image_size!r}")
  seed, train = int(ctx.seed), bool(train)
  return grain.MapDataset.source(Records(ctx.data_path(data))).map_with_index(
      lambda i, record: example(record, index=i, seed=seed, image_size=image_size,
                                train=train))
