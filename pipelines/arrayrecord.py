"""ArrayRecord files as a pipeline, with a small pickle-free example format.

An ArrayRecord file holds opaque byte records with random access. How records
become elements is the ``parse`` option; the default, ``"example"``, reads the
format written by :func:`encode_example` (and :func:`write_arrayrecord`):

  ``b"SCX1"`` | header length: uint32 little-endian | header: UTF-8 JSON
  ``{name: {"dtype": numpy dtype str, "shape": [...], "offset": int}}`` padded
  with spaces to a multiple of 8 bytes | each array's raw C-order bytes at its
  ``offset`` from the end of the header, 8-byte aligned.

Nothing is ever unpickled: object and structured dtypes cannot be written.

Example::

  write_arrayrecord("/data/train.array_record",
                    ({"x": np.float32(i), "y": np.int32(i % 2)} for i in range(100)))
  # sidecar serve --import pipelines.arrayrecord
  feed = ctl.feed("arrayrecord", global_batch_size=32, sharding=sharding,
                  kwargs={"paths": "/data/*.array_record"})
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import grain
import numpy as np

import sidecar
from pipelines._files import Holding, expand_paths

try:
  from array_record.python import array_record_module
except ImportError as e:  # Not in the core install: an extra.
  raise ImportError(
      "pipelines.arrayrecord needs array-record: "
      "pip install 'colocated-sidecar[arrayrecord]'") from e

MAGIC = b"SCX1"
_ALIGN = 8
_KINDS = "biufcmMSU"  # numeric, bool, datetime, fixed-width strings: never objects.

Element = dict[str, np.ndarray]


@sidecar.pipeline
def arrayrecord(ctx: sidecar.PipelineContext, *, paths: str | Sequence[str],
                parse: str | Callable[[bytes], Element] = "example") -> grain.MapDataset:
  """The records of ``paths``, in order, parsed into elements.

  Args:
    ctx: where the files may be (``ctx.data_path``); the framework shards, shuffles and
      positions a MapDataset.
    paths: a file, a glob, or a list of them; files are read in the order given
      (each glob's matches sorted).
    parse: ``"example"`` for records written by :func:`encode_example`; the name
      of a ``@sidecar.function`` that takes the record's bytes and returns a dict
      of fixed-shape numpy arrays; or, when called from Python, such a callable.

  Returns:
    A MapDataset of the parsed records (for ``"example"``: the dicts that were
    encoded, as read-only arrays).

  Raises:
    NotFoundError: a path or glob that names no file.
    PermissionDeniedError: in a pool, a path outside the feed's data roots.
    NotRegisteredError: ``parse`` names no registered function.
  """
  files = [path.open() for path in expand_paths(ctx, paths, "ArrayRecord")]
  source = grain.sources.ArrayRecordDataSource([f.library_path for f in files])
  return grain.MapDataset.source(Holding(source, files)).map(_parser(parse))


def _parser(parse: str | Callable[[bytes], Element]) -> Callable[[bytes], Element]:
  if callable(parse):
    return parse
  if parse == "example":
    return decode_example
  if isinstance(parse, str):
    return sidecar.default_registry().get("function", parse).fn
  raise TypeError(f"parse must be 'example', a registered function's name or a callable, "
                  f"got {type(parse).__name__} {parse!r}")


def encode_example(example: Mapping[str, Any]) -> bytes:
  """Serialises a dict of numpy arrays (or scalars) to one record; see the module doc."""
  header, chunks, offset = {}, [], 0
  for name, value in example.items():
    if not isinstance(name, str):
      raise TypeError(f"example keys must be str, got {type(name).__name__} {name!r}")
    array = np.asarray(value)
    if array.dtype.kind not in _KINDS:
      raise TypeError(f"example[{name!r}] has dtype {array.dtype}, which cannot be stored "
                      "without pickle; convert it to a numeric, bool or fixed-width string array")
    pad = -offset % _ALIGN
    chunks.append(b"\0" * pad + array.tobytes())
    offset += pad
    header[name] = {"dtype": array.dtype.str, "shape": list(array.shape), "offset": offset}
    offset += array.nbytes
  text = json.dumps(header).encode()
  text += b" " * (-(len(MAGIC) + 4 + len(text)) % _ALIGN)
  return b"".join([MAGIC, struct.pack("<I", len(text)), text, *chunks])


def decode_example(record: bytes) -> Element:
  """The dict that :func:`encode_example` wrote, as read-only arrays over ``record``."""
  if record[:len(MAGIC)] != MAGIC:
    raise ValueError(f"record does not start with {MAGIC!r}: it was not written by "
                     "encode_example; pass parse=... naming a function that decodes it")
  (length,) = struct.unpack_from("<I", record, len(MAGIC))
  start = len(MAGIC) + 4 + length
  header = json.loads(bytes(record[len(MAGIC) + 4:start]))
  return {name: np.frombuffer(record, dtype=np.dtype(leaf["dtype"]),
                              count=math.prod(leaf["shape"]),
                              offset=start + leaf["offset"]).reshape(tuple(leaf["shape"]))
          for name, leaf in header.items()}


def write_arrayrecord(path: str | os.PathLike, examples: Iterable[Mapping[str, Any]]) -> int:
  """Writes ``examples`` to a new ArrayRecord file at ``path``; returns how many.

  Uses ``group_size:1`` (one record per chunk), which random access needs to be fast.
  """
  writer = array_record_module.ArrayRecordWriter(os.fspath(path), "group_size:1")
  count = 0
  try:
    for example in examples:
      writer.write(encode_example(example))
      count += 1
  finally:
    writer.close()
  return count
