"""A byte-level language-model corpus as a pipeline: fixed-length token sequences.

The corpus is one long byte string cut into ArrayRecord records of ``record_bytes``
each (the last may be shorter), spread over shard files, with a JSON manifest beside
them; :func:`write_corpus` writes it (``examples/lm/prepare.py`` feeds it the Python
standard library's sources). Tokens are the bytes themselves: vocabulary 256, no
special tokens.

Sequence ``i`` of length ``seq_len`` is bytes ``[i * seq_len, (i + 1) * seq_len + 1)``
of the corpus: ``seq_len + 1`` tokens, so ``tokens[:-1]`` are the inputs and
``tokens[1:]`` the targets, and consecutive sequences overlap by one byte. The pipeline
returns a ``grain.MapDataset`` of them, so the framework shards, shuffles (a seeded
permutation per epoch) and positions it globally: a ``feed.state()`` saved with a
checkpoint resumes at exactly the next batch, on any host count. The state records the
corpus it was made from (:func:`corpus_identity`: its manifest's digest and size), and a
resume on another corpus (re-prepared, or another ``data``) is refused, naming both.

Example::

  # sidecar serve --import pipelines.lm
  feed = ctl.feed("lm", global_batch_size=8, sharding=sharding, seed=0,
                  kwargs={"data": "/data/stdlib", "seq_len": 64})
  # each batch: {"tokens": int32[8, 65]}
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable

import grain
import numpy as np

import sidecar

try:
  from array_record.python import array_record_module
except ImportError as e:  # Not in the core install: an extra.
  raise ImportError(
      "pipelines.lm needs array-record: pip install 'colocated-sidecar[lm]'") from e

MANIFEST = "manifest.json"
# Beside the corpus, text it never holds: what a trainer evaluates on (examples/lm/prepare.py).
HELDOUT = "heldout.bin"
FORMAT = "sidecar-lm-bytes/1"
VOCAB_SIZE = 256


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
  """What :func:`write_corpus` wrote: the corpus's size, record size and shard files."""
  total_bytes: int
  record_bytes: int
  shards: tuple[str, ...]  # file names, relative to the manifest's directory, in order
  records: tuple[int, ...]  # records of each shard
  sources: int = 0  # how many source files were concatenated

  def to_dict(self) -> dict:
    return {"format": FORMAT, "total_bytes": self.total_bytes,
            "record_bytes": self.record_bytes, "shards": list(self.shards),
            "records": list(self.records), "sources": self.sources}

  @classmethod
  def from_dict(cls, d: dict) -> Manifest:
    if d.get("format") != FORMAT:
      raise ValueError(f"manifest format is {d.get('format')!r}, expected {FORMAT!r}: "
                       "write the corpus with pipelines.lm.write_corpus (examples/lm/prepare.py)")
    return cls(total_bytes=int(d["total_bytes"]), record_bytes=int(d["record_bytes"]),
               shards=tuple(d["shards"]), records=tuple(int(r) for r in d["records"]),
               sources=int(d.get("sources", 0)))


def read_manifest(directory: str | os.PathLike | sidecar.DataPath) -> Manifest:
  """The manifest of the corpus in ``directory`` (a pipeline's: ``ctx.data_path(data)``).

  Raises:
    NotFoundError: ``directory`` holds no manifest (the corpus was not prepared).
  """
  path = _data_path(directory) / MANIFEST
  try:
    with path.open() as f:
      return Manifest.from_dict(json.load(f))
  except FileNotFoundError as e:
    raise sidecar.NotFoundError(
        f"no corpus manifest at {path}: run examples/lm/prepare.py --out {directory}") from e


def _data_path(directory: str | os.PathLike | sidecar.DataPath) -> sidecar.DataPath:
  return directory if isinstance(directory, sidecar.DataPath) else sidecar.DataPath(directory)


def write_corpus(directory: str | os.PathLike, chunks: Iterable[bytes], *,
                 record_bytes: int = 64 << 10, shard_bytes: int = 16 << 20,
                 max_bytes: int | None = None, sources: int = 0) -> Manifest:
  """Writes the concatenation of ``chunks`` as a corpus in ``directory``; returns its manifest.

  Args:
    directory: made if missing; its manifest and shards are replaced.
    chunks: the corpus's bytes, in order (a source file each, say).
    record_bytes: bytes of each ArrayRecord record (the last one may be shorter).
    shard_bytes: bytes of each shard file, a multiple of ``record_bytes``.
    max_bytes: stop after this many bytes (None: everything).
    sources: how many sources ``chunks`` holds, recorded in the manifest.
  """
  if record_bytes <= 0 or shard_bytes < record_bytes or shard_bytes % record_bytes:
    raise ValueError(f"shard_bytes must be a positive multiple of record_bytes, got "
                     f"shard_bytes={shard_bytes!r}, record_bytes={record_bytes!r}")
  os.makedirs(directory, exist_ok=True)
  per_shard = shard_bytes // record_bytes
  shards: list[str] = []
  records: list[int] = []
  writer = None
  total = 0
  pending = bytearray()

  def emit(record: bytes) -> None:
    nonlocal writer
    if writer is None or records[-1] == per_shard:
      if writer is not None:
        writer.close()
      shards.append(f"corpus-{len(shards):05d}.array_record")
      records.append(0)
      writer = array_record_module.ArrayRecordWriter(
          os.path.join(directory, shards[-1]), "group_size:1")
    writer.write(record)
    records[-1] += 1

  try:
    for chunk in chunks:
      if max_bytes is not None:
        chunk = chunk[:max_bytes - total]
      pending += chunk
      total += len(chunk)
      while len(pending) >= record_bytes:
        emit(bytes(pending[:record_bytes]))
        del pending[:record_bytes]
      if max_bytes is not None and total >= max_bytes:
        break
    if pending:
      emit(bytes(pending))
  finally:
    if writer is not None:
      writer.close()
  manifest = Manifest(total_bytes=total, record_bytes=record_bytes, shards=tuple(shards),
                      records=tuple(records), sources=sources)
  with open(os.path.join(directory, MANIFEST), "w") as f:
    json.dump(manifest.to_dict(), f, indent=1)
  return manifest


class Sequences:
  """Random access to the corpus's ``seq_len + 1``-token sequences (a Grain data source)."""

  def __init__(self, directory: str | os.PathLike | sidecar.DataPath, seq_len: int):
    if seq_len < 1:
      raise ValueError(f"seq_len must be at least 1, got {seq_len!r}")
    directory = _data_path(directory)
    self._manifest = manifest = read_manifest(directory)
    self._seq_len = seq_len
    self._count = max(0, (manifest.total_bytes - 1) // seq_len)
    if self._count == 0:
      raise ValueError(f"the corpus in {directory} has {manifest.total_bytes} bytes: too few "
                       f"for one sequence of {seq_len + 1} tokens")
    # Each shard a name in the directory (no '..', not absolute), opened beneath it and
    # held open while its reader may open it by ``library_path``.
    self._files = [(directory / name).open() for name in manifest.shards]
    self._source = grain.sources.ArrayRecordDataSource([f.library_path for f in self._files])

  def __len__(self) -> int:
    return self._count

  def span(self, start: int, stop: int) -> bytes:
    """Bytes ``[start, stop)`` of the corpus."""
    size = self._manifest.record_bytes
    first, last = start // size, (stop - 1) // size
    data = b"".join(self._source[r] for r in range(first, last + 1))
    return data[start - first * size:stop - first * size]

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    if not 0 <= i < self._count:
      raise IndexError(f"sequence {i} out of range: the corpus has {self._count}")
    raw = self.span(i * self._seq_len, (i + 1) * self._seq_len + 1)
    return {"tokens": np.frombuffer(raw, np.uint8).astype(np.int32)}


def corpus_identity(ctx: sidecar.PipelineContext, *, data: str, seq_len: int) -> str:
  """What names the corpus in ``data``: its manifest's sha256 (which lists its size, its
  records and shard files) and its size, as a feed's state records it. Read as the
  pipeline reads it: beneath its tenant's data roots, in a pool."""
  del seq_len  # the same corpus, whatever its sequences' length
  path = ctx.data_path(data) / MANIFEST
  try:
    with path.open() as f:
      text = f.read()
  except FileNotFoundError as e:
    raise sidecar.NotFoundError(
        f"no corpus manifest at {path}: run examples/lm/prepare.py --out {data}") from e
  size = Manifest.from_dict(json.loads(text)).total_bytes
  return f"corpus sha256:{hashlib.sha256(text).hexdigest()[:16]} ({size:,} bytes)"


@sidecar.pipeline(identity=corpus_identity)
def lm(ctx: sidecar.PipelineContext, *, data: str, seq_len: int) -> grain.MapDataset:
  """The corpus in ``data`` as sequences of ``seq_len + 1`` byte tokens.

  Args:
    ctx: where the corpus may be (``ctx.data_path``); the framework shards, shuffles and
      positions a MapDataset.
    data: a directory written by :func:`write_corpus`.
    seq_len: tokens each step trains on; each element holds one more (the last target).

  Returns:
    A MapDataset of ``{"tokens": int32[seq_len + 1]}``, values in ``[0, 256)``.

  Raises:
    NotFoundError: ``data`` holds no prepared corpus, or a shard its manifest names.
    PermissionDeniedError: in a pool, ``data`` (or a shard) outside the feed's data roots.
    InvalidArgumentError: a shard name in the manifest that is absolute or holds ``..``.
    ValueError: ``seq_len`` below 1, or a corpus shorter than one sequence.
  """
  return grain.MapDataset.source(Sequences(ctx.data_path(data), int(seq_len)))
