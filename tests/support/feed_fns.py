"""Pipelines the feed tests register (``--import tests.support.feed_fns``)."""

import os
import signal
import sys
import time
from typing import NamedTuple

import grain
import numpy as np

import sidecar


@sidecar.pipeline
def ids(ctx: sidecar.PipelineContext, n: int = 1000, width: int = 4):
  """Random access: example i is ``{"id": i, "x": [i] * width}``."""
  return grain.MapDataset.range(n).map(
      lambda i: {"id": np.int64(i), "x": np.full((width,), i, np.float32)})


@sidecar.pipeline
def slow_ids(ctx: sidecar.PipelineContext, n: int = 1 << 16, delay: float = 0.01):
  """As ``ids``, each example taking ``delay`` seconds: a feed's batches are in flight in
  its workers a while."""
  def element(i):
    time.sleep(delay)
    return {"id": np.int64(i), "x": np.full((4,), i, np.float32)}
  return grain.MapDataset.range(n).map(element)


@sidecar.pipeline
def shard_ids(ctx: sidecar.PipelineContext, n: int = 1000):
  """A plain iterable of this shard's ids, from ``ctx.position``."""
  mine = range(ctx.shard_index, n, ctx.shard_count)
  for i in mine[ctx.position:]:
    yield {"id": np.int64(i + 10_000 * ctx.epoch)}


@sidecar.pipeline
def fails_at(ctx: sidecar.PipelineContext, at: int = 5):
  def element(i):
    if i == at:
      raise ValueError(f"bad example {i}")
    return {"id": np.int64(i)}
  return grain.MapDataset.range(100).map(element)


ERRORS = {e.__name__: e for e in (FileNotFoundError, PermissionError, ValueError)}


def in_feed_worker() -> bool:
  """Whether this process is a feed worker (``FeedOptions(workers=N)``), not a sidecar."""
  spec = getattr(sys.modules.get("__main__"), "__spec__", None)
  return getattr(spec, "name", None) == "sidecar._src.server.feeds.child"


@sidecar.pipeline
def raises(ctx: sidecar.PipelineContext, error: str = "ValueError", at: int = -1):
  """As ids, but example ``at`` (never 0, which the sidecar reads itself) raises ``error``
  ("SIGKILL": its process is killed, every time); ``at`` -1: a feed worker raises it while
  it builds the pipeline, which the sidecar builds fine."""
  if at < 0 and in_feed_worker():
    raise ERRORS[error](f"cannot open the data in feed worker {os.getpid()}")

  def element(i):
    if i == at and error == "SIGKILL":
      os.kill(os.getpid(), signal.SIGKILL)
    if i == at:
      raise ERRORS[error](f"example {i} is unreadable")
    return {"id": np.int64(i)}
  return grain.MapDataset.range(100).map(element)


@sidecar.pipeline
def ragged(ctx: sidecar.PipelineContext):
  return grain.MapDataset.range(100).map(lambda i: {"x": np.zeros((1 + i % 2,), np.int8)})


@sidecar.pipeline
def images(ctx: sidecar.PipelineContext, n: int = 256, augment: bool = False):
  """224x224x3 uint8 images: made once, lightly augmented per element if asked."""
  base = np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8)

  def element(i):
    img = base
    if augment:
      img = np.flip(base, axis=int(i) % 2).copy()
      img = np.clip(img.astype(np.int16) + int(i) % 7, 0, 255).astype(np.uint8)
    return {"image": img, "label": np.int32(i % 10)}
  return grain.MapDataset.range(n).map(element)


@sidecar.pipeline
def dies_once(ctx: sidecar.PipelineContext, marker: str, at: int = 20, n: int = 200):
  """Like ids, but the process computing example ``at`` is SIGKILLed the first time."""
  def element(i):
    if i == at and not os.path.exists(marker):
      open(marker, "w").close()
      os.kill(os.getpid(), signal.SIGKILL)
    return {"id": np.int64(i)}
  return grain.MapDataset.range(n).map(element)


@sidecar.function
def sidecar_pid() -> int:
  """Which sidecar process ran the call."""
  return os.getpid()


pulled: list[int] = []  # the elements huge_rows yielded, for the in-process tests


@sidecar.pipeline
def huge_rows(ctx: sidecar.PipelineContext, nbytes: int = 1 << 20):
  """A plain iterable of ``nbytes`` elements, counting what it yields in ``pulled``."""
  while True:
    pulled.append(nbytes)
    yield {"x": np.zeros((nbytes,), np.uint8)}


class Views(NamedTuple):
  crop: np.ndarray
  extra: list


@sidecar.pipeline
def crops(ctx: sidecar.PipelineContext, n: int = 48):
  """Elements with a list of crops and a tuple holding a namedtuple, as Grain takes them."""
  def element(i):
    i = int(i)
    return {"x": [np.full((4,), i, np.float32), np.full((2,), -i, np.float32)],
            "id": np.int64(i), "t": (np.int32(i), Views(np.full((3,), i, np.int16), [None, i]))}
  return grain.MapDataset.range(n).map(element)


def marked_row(i: int, nbytes: int) -> np.ndarray:
  """Row ``i`` of ``marked_rows``: bytes that differ from every other row's at each place."""
  return ((np.arange(nbytes, dtype=np.int64) * 7 + i * 13) % 251).astype(np.uint8)


@sidecar.pipeline
def marked_rows(ctx: sidecar.PipelineContext, nbytes: int = 1 << 20, n: int = 1 << 20):
  """Random access: example i is ``{"i": i, "x": marked_row(i, nbytes)}``."""
  return grain.MapDataset.range(n).map(
      lambda i: {"i": np.int64(i), "x": marked_row(int(i), nbytes)})


@sidecar.pipeline
def slow_while(ctx: sidecar.PipelineContext, marker: str, n: int = 1 << 20, width: int = 4):
  """Like ids, but an example takes a minute while file ``marker`` exists: its feed's
  workers are then busy in a batch, not waiting for the next task."""
  def element(i):
    if os.path.exists(marker):
      time.sleep(60)
    return {"id": np.int64(i), "x": np.full((width,), i, np.float32)}
  return grain.MapDataset.range(n).map(element)


@sidecar.pipeline
def wide_rows(ctx: sidecar.PipelineContext, row_bytes: int = 1 << 20, leaves: int = 1):
  """A plain iterable (its batch's size known only from its first element): rows of
  ``leaves`` leaves of ``row_bytes`` bytes each, row i filled with ``i % 251``."""
  i = ctx.position
  while True:
    yield {f"x{k}": np.full((row_bytes,), i % 251, np.uint8) for k in range(leaves)}
    i += 1


@sidecar.pipeline
def data_roots_seen(ctx: sidecar.PipelineContext, n: int = 64):
  """Random access: each example says how many data roots the context of the process that
  made it held (-1: anywhere, no pool) and that process's pid."""
  roots = -1 if ctx.data_roots.roots is None else len(ctx.data_roots.roots)
  pid = os.getpid()
  return grain.MapDataset.range(n).map(
      lambda i: {"roots": np.int64(roots), "pid": np.int64(pid)})
