"""A host's part of a feed: run a registered pipeline, batch its rows into the arena.

For each global batch this host produces the rows the controller assigned it
(``FeedSpec.rows``), one array per row range and leaf, each in its own arena
block: page-aligned, so every device's shard becomes a ``jax.Array`` without a
copy. Elements are written straight into those blocks; batching is the copy.

Two kinds of pipeline:
- a Grain ``MapDataset`` (random access): this module shards, shuffles (one
  permutation per epoch, from the seed) and positions it globally, so a feed
  resumes exactly on any host count. State: ``epoch`` and ``position``, the
  examples of the epoch consumed by every host together.
- any other iterable: it yields its own shard's elements from ``ctx.position``.
  State: this shard's ``epoch`` and ``position``.
Batches never straddle epochs: an epoch's last partial batch is dropped.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import sys
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import numpy as np

from sidecar._src.core import errors, trees
from sidecar._src.server.tenancy import quotas as quotas_lib
from sidecar._src.user import data_paths, data_roots, registry as registry_lib
from sidecar._src.user.pipeline_context import PipelineContext
from sidecar._src.wire import codec, feed_batch
from sidecar._src.wire.protocol import pb

Alloc = Callable[[tuple[int, ...], np.dtype], np.ndarray]
# Told a batch's block sizes once the first element gave them; raises where one batch can
# never fit (``arena_io.BatchBlocks.check_batch``).
Check = Callable[[list[int]], None]
# Whether the feed's client is still there (a stream's ``alive``).
Alive = Callable[[], bool]
# A grain.MapDataset. Grain (which brings JAX, Orbax and TensorStore) is never imported
# here: a pipeline that returns one has imported it, and a sidecar that serves none
# starts without it.
MapDataset = Any
# Each feed worker is a Python interpreter with the user's modules (~250 MiB here):
# one request may start at most as many as this host has CPUs (at least 2, at most 64).
MAX_WORKERS = quotas_lib.CPUS
# A feed state is a few numbers and names (epoch, position, kind, an iterator's own state):
# far less than this.
MAX_STATE_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class Spec:
  """A decoded ``pb.FeedSpec``."""
  global_batch_size: int
  ranges: tuple[tuple[int, int], ...]
  seed: int
  num_epochs: int | None
  shard_index: int
  shard_count: int
  start: dict[str, Any]
  workers: int
  length_only: bool = False

  @classmethod
  def from_proto(cls, p: pb.FeedSpec) -> Spec:
    ranges = tuple((r.start, r.stop) for r in p.rows)
    if not ranges or any(a >= b or b > p.global_batch_size for a, b in ranges) or any(
        ranges[i][1] > ranges[i + 1][0] for i in range(len(ranges) - 1)):
      raise errors.InvalidArgumentError(
          f"feed rows {ranges} must be sorted, disjoint, non-empty ranges within the global "
          f"batch of {p.global_batch_size}")
    if p.workers > MAX_WORKERS:
      raise errors.InvalidArgumentError(
          f"feed workers must be at most {MAX_WORKERS} (this host's CPUs, at most 64), got "
          f"{p.workers}; lower workers=")
    if not p.shard_index < p.shard_count:
      raise errors.InvalidArgumentError(
          f"feed shard_index must be in [0, shard_count={p.shard_count}), got {p.shard_index}")
    return cls(p.global_batch_size, ranges, p.seed, p.num_epochs or None, p.shard_index,
               p.shard_count, _start_state(p.state_json), p.workers, p.length_only)

  @property
  def rows(self) -> int:
    return sum(b - a for a, b in self.ranges)


def _start_state(text: str) -> dict[str, Any]:
  """The feed state in ``FeedSpec.state_json``, checked: a JSON object whose
  ``epoch`` and ``position`` are ints >= 0 and ``kind`` a str, where present."""
  if len(text) > MAX_STATE_BYTES:
    raise errors.InvalidArgumentError(
        f"feed state_json holds {len(text)} characters, more than a feed state's "
        f"{MAX_STATE_BYTES} (MAX_STATE_BYTES); pass the state a feed's state() returned")
  try:
    start = json.loads(text) if text else {}
  except (ValueError, RecursionError) as e:  # ValueError: an int of over 4300 digits too
    raise errors.InvalidArgumentError(
        f"feed state_json is not the JSON of a feed state(): {type(e).__name__}: {e}"[:300]
    ) from None
  if not isinstance(start, dict):
    raise errors.InvalidArgumentError(
        f"feed state_json must be a JSON object, got {type(start).__name__}")
  for key in ("epoch", "position"):
    v = start.get(key, 0)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
      raise errors.InvalidArgumentError(
          f"feed state_json {key!r} must be an int >= 0, got {v!r:.40}")
  for key in ("kind", "data"):
    if not isinstance(start.get(key, ""), str):
      raise errors.InvalidArgumentError(
          f"feed state_json {key!r} must be a str, got {start[key]!r:.40}")
  return start


def _is_map_dataset(x: Any) -> bool:
  grain = sys.modules.get("grain")  # loaded by the pipeline's module if it made one
  return grain is not None and isinstance(x, grain.MapDataset)


def epoch_seed(seed: int, epoch: int) -> int:
  """The shuffle seed of one epoch: independent permutations, reproducible."""
  digest = hashlib.sha256(f"{seed}/{epoch}".encode()).digest()
  return int.from_bytes(digest[:4], "little")


def open_source(entry: registry_lib.Entry, kwargs: dict, spec: Spec, epoch: int,
                position: int, roots: data_roots.DataRoots = data_roots.ANYWHERE,
                alive: Alive | None = None) -> Any:
  """What the pipeline returns for this shard at ``(epoch, position)``; its files only
  beneath ``roots`` (its tenant's data roots, in a pool); a glob it walks stops once
  ``alive()`` is false (its feed's client gone: ``data_paths.while_alive``)."""
  ctx = PipelineContext(shard_index=spec.shard_index, shard_count=spec.shard_count,
                        seed=spec.seed, epoch=epoch, position=position, data_roots=roots)
  with allowing(roots), data_paths.while_alive(alive):
    return entry.fn(ctx, **kwargs)


def allowing(roots: data_roots.DataRoots) -> contextlib.AbstractContextManager[None]:
  """While a pipeline opens: a function it looks up by a name from its arguments (a
  client's) is one its tenant may run (``roots.functions``, its allowlist)."""
  if roots.functions is None:
    return contextlib.nullcontext()
  return registry_lib.allowing(registry_lib.Allowlist(
      frozenset(roots.functions), tenant=roots.tenant, where=roots.where))


@dataclasses.dataclass(frozen=True, slots=True)
class Batch:
  """One batch of this host's rows: the element's structure and, per leaf, its arrays."""
  structure: pb.Value  # encoded: the element's tree, each leaf its index in ``leaves``
  leaves: list[list[np.ndarray]]  # [leaf][row range]


class Batcher:
  """Writes elements into per-range, per-leaf output arrays of one batch."""

  def __init__(self, spec: Spec, alloc: Alloc, name: str, check: Check | None = None):
    self._spec = spec
    self._alloc = alloc
    self._check = check
    self._name = name
    self._treedef: trees.TreeDef | None = None
    self._structure: pb.Value | None = None
    self._leaf_specs: list[tuple[tuple[int, ...], np.dtype]] = []

  def new_batch(self) -> list[list[np.ndarray]] | None:
    """Output arrays ``[leaf][range]``, or None before the first element set the spec."""
    if self._treedef is None:
      return None
    return [[self._alloc((b - a, *shape), dtype) for a, b in self._spec.ranges]
            for shape, dtype in self._leaf_specs]

  def learn(self, element: Any) -> None:
    """Takes the batch layout (structure, leaf shapes and dtypes) from ``element``.

    Raises:
      InvalidArgumentError: a container the codec cannot carry (a registered pytree
        node of the user's) or a leaf of a dtype it cannot, naming its path.
    """
    leaves, treedef = trees.flatten_with_path(element)
    where = f"pipeline {self._name!r}: element"
    self._structure = feed_batch.structure(
        trees.unflatten(treedef, list(range(len(leaves)))), where=where)
    self._leaf_specs = []
    for path, leaf in leaves:
      a = np.asarray(leaf)
      codec.dtype_of(a.dtype.name, f"{where}{trees.keystr(path)}")
      self._leaf_specs.append((a.shape, a.dtype))
    if self._check is not None:  # before any block of a batch that can never fit
      self._check([(b - a) * math.prod(shape) * dtype.itemsize
                   for shape, dtype in self._leaf_specs for a, b in self._spec.ranges])
    self._treedef = treedef

  @property
  def learned(self) -> bool:
    """Whether the layout is known (from a first element)."""
    return self._treedef is not None

  @property
  def leaf_specs(self) -> list[tuple[tuple[int, ...], np.dtype]]:
    return list(self._leaf_specs)

  def write(self, out: list[list[np.ndarray]] | None, elements: list[Any]
            ) -> list[list[np.ndarray]]:
    """Writes one batch's ``elements`` (this host's rows, in order) into ``out``.

    ``out`` None: allocates it, taking the layout from the first element.
    """
    if self._treedef is None:
      self.learn(elements[0])
    if out is None:
      out = self.new_batch()
      assert out is not None  # learn() has set the layout
    flat = []
    for element in elements:
      leaves, treedef = trees.flatten(element)
      if treedef != self._treedef:
        raise errors.InvalidArgumentError(
            f"pipeline {self._name!r} yielded an element of structure {treedef}, unlike the "
            f"first element's {self._treedef}; every element must have the same structure")
      flat.append(leaves)
    for i, (shape, _) in enumerate(self._leaf_specs):
      start = 0
      for k, (a, b) in enumerate(self._spec.ranges):
        rows = [leaves[i] for leaves in flat[start:start + b - a]]
        start += b - a
        try:
          np.stack(rows, out=out[i][k], casting="same_kind")
        except (ValueError, TypeError):  # TypeError: a dtype that cannot be cast
          self._raise_shape(elements, i, shape)
    return out

  def put(self, out: list[list[np.ndarray]], row: int, element: Any) -> None:
    """Writes ``element`` as row ``row`` (of this host's rows, in order) of ``out``."""
    leaves, treedef = trees.flatten(element)
    if treedef != self._treedef:
      raise errors.InvalidArgumentError(
          f"pipeline {self._name!r} yielded an element of structure {treedef}, unlike the "
          f"first element's {self._treedef}; every element must have the same structure")
    k = 0
    for a, b in self._spec.ranges:
      if row < b - a:
        break
      row -= b - a
      k += 1
    for i, (shape, _) in enumerate(self._leaf_specs):
      if np.shape(leaves[i]) != shape:  # copyto would broadcast where stacking refuses
        self._raise_shape([element], i, shape)
      try:
        np.copyto(out[i][k][row, ...], leaves[i], casting="same_kind")
      except (TypeError, ValueError):
        raise errors.InvalidArgumentError(
            f"pipeline {self._name!r}: cannot write leaf {i} of dtype "
            f"{np.asarray(leaves[i]).dtype} into the batch's {out[i][k].dtype}") from None

  def _raise_shape(self, elements: list[Any], i: int, shape: tuple[int, ...]):
    for element in elements:
      path, leaf = trees.flatten_with_path(element)[0][i]
      if np.shape(leaf) != shape:
        raise errors.InvalidArgumentError(
            f"pipeline {self._name!r}: element leaf {trees.keystr(path)} has shape "
            f"{np.shape(leaf)}, but the first element's had {shape}; pad or crop to a fixed "
            "shape before batching")
    dtypes = sorted({str(np.asarray(trees.leaves(e)[i]).dtype) for e in elements})
    raise errors.InvalidArgumentError(
        f"pipeline {self._name!r}: cannot batch leaf {i} of dtypes {dtypes} as the first "
        f"element's {self._leaf_specs[i][1]}; yield one dtype for each leaf")

  def batch(self, out: list[list[np.ndarray]]) -> Batch:
    """The batch of arrays ``out``: ``[leaf][range]``."""
    assert self._structure is not None  # learn() has set the layout
    return Batch(self._structure, out)


PERMUTATION_LIMIT = 1 << 24  # Up to 16M examples a permutation costs <= 64 MiB an epoch.


class Order:
  """Random access to one epoch-shuffled ``MapDataset``, a batch of rows at a time."""

  def __init__(self, ds: MapDataset, seed: int):
    self._ds, self._seed = ds, seed
    self._epoch: int | None = None
    self._perm: np.ndarray | None = None
    self._shuffled: Any = None  # a grain.MapDataset

  def _set_epoch(self, epoch: int) -> None:
    if epoch == self._epoch:
      return
    seed, self._epoch = epoch_seed(self._seed, epoch), epoch
    if len(self._ds) <= PERMUTATION_LIMIT:
      self._perm = np.random.default_rng(seed).permutation(len(self._ds)).astype(np.uint32)
    else:  # Grain's O(1)-memory index shuffle
      self._shuffled = self._ds.shuffle(seed=seed)

  def rows(self, epoch: int, position: int, ranges: tuple[tuple[int, int], ...]) -> list[Any]:
    """The elements at ``position + r`` of the epoch's order, for each row r in ``ranges``."""
    self._set_epoch(epoch)
    at = [position + r for a, b in ranges for r in range(a, b)]
    ds = self._ds if self._perm is not None else self._shuffled
    if self._perm is not None:
      at = self._perm[at].tolist()
    getitems = getattr(ds, "_getitems", None)  # Grain's batched read, where there is one
    return getitems(at) if getitems is not None else [ds[i] for i in at]


def map_steps(n: int, spec: Spec) -> Iterator[tuple[int, int]]:
  """``(epoch, position)`` of every global batch from the start state on."""
  epoch, position = int(spec.start.get("epoch", 0)), int(spec.start.get("position", 0))
  while spec.num_epochs is None or epoch < spec.num_epochs:
    while position + spec.global_batch_size <= n:
      yield epoch, position
      position += spec.global_batch_size
    epoch, position = epoch + 1, 0


def length(entry: registry_lib.Entry, kwargs: dict, spec: Spec,
           roots: data_roots.DataRoots = data_roots.ANYWHERE,
           alive: Alive | None = None) -> int | None:
  """Global batches of the feed from its start state to its end: known for a
  ``grain.MapDataset`` read for ``num_epochs``, else None (an iterable, or forever)."""
  source = open_source(entry, kwargs, spec, 0, 0, roots, alive)
  if not _is_map_dataset(source):
    return None
  _check_map(source, entry.name, spec)
  if spec.num_epochs is None:
    return None
  return sum(1 for _ in map_steps(len(source), spec))


def produce(entry: registry_lib.Entry, kwargs: dict, spec: Spec, alloc: Alloc,
            make_workers: Callable[[], Any] | None = None, check: Check | None = None,
            roots: data_roots.DataRoots = data_roots.ANYWHERE, alive: Alive | None = None
            ) -> Generator[tuple[Batch, dict[str, Any], float], None, None]:
  """Yields ``(batch, state after it, seconds spent producing it)`` per step.

  With ``spec.workers``, ``make_workers()`` gives the worker processes that fill batches
  (a context manager: new ones, or those of an ended feed of the same work, ``idle.py``).
  ``check`` is told a batch's block sizes once known, before any is allocated. The
  pipeline reads files only beneath ``roots`` (each time it is opened), and a glob it
  walks as it opens stops once ``alive()`` is false (its feed's client gone).
  """
  data = data_identity(entry, kwargs, spec, roots, alive)
  first = open_source(entry, kwargs, spec, int(spec.start.get("epoch", 0)),
                      int(spec.start.get("position", 0)), roots, alive)
  if _is_map_dataset(first):
    if spec.workers:
      made = _from_map_workers(first, entry.name, spec, alloc, make_workers, check)
    else:
      made = _from_map(first, entry.name, spec, alloc, check)
  elif spec.workers:
    raise errors.InvalidArgumentError(
        f"pipeline {entry.name!r} returns a plain iterable; workers=N needs random access: "
        "return a grain.MapDataset, or use workers=0")
  else:
    made = _from_iterable(first, entry, kwargs, spec, alloc, check, roots, alive)
  if data is None:
    yield from made
    return
  for batch, state, seconds in made:  # each state says what it was made from
    yield batch, {**state, "data": data}, seconds


def data_identity(entry: registry_lib.Entry, kwargs: dict, spec: Spec,
                  roots: data_roots.DataRoots = data_roots.ANYWHERE,
                  alive: Alive | None = None) -> str | None:
  """What names the data the pipeline reads (``@sidecar.pipeline(identity=...)``), checked
  against the state the feed resumes from: InvalidArgumentError naming both where that
  state was made from other data. None where the pipeline names none. The identity is
  given the pipeline's context, so it reads files only beneath ``roots`` as the
  pipeline does."""
  if entry.identity is None:
    return None
  ctx = PipelineContext(shard_index=spec.shard_index, shard_count=spec.shard_count,
                        seed=spec.seed, epoch=int(spec.start.get("epoch", 0)),
                        position=int(spec.start.get("position", 0)), data_roots=roots)
  with allowing(roots), data_paths.while_alive(alive):
    data = str(entry.identity(ctx, **kwargs))
  made_from = spec.start.get("data")
  if made_from is not None and made_from != data:
    raise errors.InvalidArgumentError(
        f"feed {entry.name!r}: the state it resumes from was made from {made_from!r:.300}, "
        f"but with kwargs {sorted(kwargs)} it now reads {data!r:.300}: the data changed "
        "since the checkpoint (re-prepared, or another path). Resume on the data the "
        "checkpoint was made from, or start the feed anew (state=None), knowingly")
  return data


def _check_kind(spec: Spec, kind: str, name: str) -> None:
  have = spec.start.get("kind", kind)
  if have != kind:
    raise errors.InvalidArgumentError(
        f"the feed state is for a {have!r} pipeline, but {name!r} is a {kind!r} pipeline now; "
        "resume with the pipeline that made the state")


def _check_map(ds: MapDataset, name: str, spec: Spec) -> None:
  _check_kind(spec, "map", name)
  if len(ds) < spec.global_batch_size:
    raise errors.InvalidArgumentError(
        f"global_batch_size {spec.global_batch_size} exceeds the {len(ds)} examples of "
        f"pipeline {name!r}")


def _from_map(ds: MapDataset, name: str, spec: Spec, alloc: Alloc, check: Check | None = None):
  _check_map(ds, name, spec)
  batcher, order = Batcher(spec, alloc, name, check), Order(ds, spec.seed)
  # The layout from one element, so that every batch's blocks are allocated before its rows
  # are read: one that cannot fit the arena fails at once, not after reading all of them.
  batcher.learn(ds[0])
  for epoch, position in map_steps(len(ds), spec):
    t0 = time.perf_counter()
    out = batcher.write(batcher.new_batch(), order.rows(epoch, position, spec.ranges))
    state = {"kind": "map", "epoch": epoch, "position": position + spec.global_batch_size}
    yield batcher.batch(out), state, time.perf_counter() - t0


def _from_map_workers(ds: MapDataset, name: str, spec: Spec, alloc: Alloc, make_workers,
                      check: Check | None = None):
  """As ``_from_map``, with batches filled by worker processes, in order."""
  _check_map(ds, name, spec)
  batcher = Batcher(spec, alloc, name, check)
  steps = map_steps(len(ds), spec)
  first = next(steps, None)
  if first is None:
    return
  batcher.learn(ds[0])  # Every element has the same layout; the workers fill the rest.
  in_flight: collections.deque = collections.deque()
  with make_workers() as workers:
    pending = itertools.chain([first], steps)
    while True:
      # Keep every worker busy, one task queued; past its tenant's fair share of the
      # sidecar's workers, collect its own batches first (Pool.free).
      while len(in_flight) < 2 * workers.size and (not in_flight or workers.free()):
        step = next(pending, None)
        if step is None:
          break
        out = batcher.new_batch()
        in_flight.append((workers.submit(step, out), out, step))
      if not in_flight:
        return
      ticket, out, (epoch, position) = in_flight.popleft()
      seconds = workers.wait(ticket)
      state = {"kind": "map", "epoch": epoch, "position": position + spec.global_batch_size}
      yield batcher.batch(out), state, seconds


def _from_iterable(source: Any, entry: registry_lib.Entry, kwargs: dict, spec: Spec,
                   alloc: Alloc, check: Check | None = None,
                   roots: data_roots.DataRoots = data_roots.ANYWHERE,
                   alive: Alive | None = None):
  _check_kind(spec, "iter", entry.name)
  epoch, position = int(spec.start.get("epoch", 0)), int(spec.start.get("position", 0))
  batcher = Batcher(spec, alloc, entry.name, check)
  spare = None  # the blocks of a batch an epoch's end left unfilled: the next one's
  while spec.num_epochs is None or epoch < spec.num_epochs:
    batches = 0
    try:
      iterator = iter(source)
    except TypeError:
      raise errors.InvalidArgumentError(
          f"pipeline {entry.name!r} returned {type(source).__name__}: return a "
          "grain.MapDataset or an iterable of elements") from None
    while True:
      t0 = time.perf_counter()
      out, spare = _fill(batcher, iterator, spec.rows, spare)
      if out is None:
        break  # the shard ran out: the partial batch is dropped, the epoch ends
      position += spec.rows
      batches += 1
      yield batcher.batch(out), {"kind": "iter", "epoch": epoch, "position": position}, (
          time.perf_counter() - t0)
    if batches == 0 and position == 0:
      raise errors.InvalidArgumentError(
          f"pipeline {entry.name!r} shard {spec.shard_index} of {spec.shard_count} yielded "
          f"fewer than the {spec.rows} elements of one batch in epoch {epoch}; lower "
          "global_batch_size or give every shard more data")
    epoch, position = epoch + 1, 0
    if spec.num_epochs is None or epoch < spec.num_epochs:
      source = open_source(entry, kwargs, spec, epoch, 0, roots, alive)


def _fill(batcher: Batcher, iterator: Iterator[Any], rows: int, spare: Any) -> tuple[Any, Any]:
  """The next batch of ``rows`` elements, written into its blocks as they come.

  The blocks are allocated once the first element gave the layout, before any other is
  read: a batch too big for the arena fails at once, having held one element, never
  the whole batch. Returns ``(batch, None)``, or ``(None, blocks)`` when the iterator
  ran out first: the blocks, allocated already, serve the next batch.
  """
  first = next(iterator, _END)
  if first is _END:
    return None, spare
  if not batcher.learned:
    batcher.learn(first)
  out = spare if spare is not None else batcher.new_batch()
  assert out is not None  # learn() has set the layout
  batcher.put(out, 0, first)
  del first
  for row in range(1, rows):
    element = next(iterator, _END)
    if element is _END:
      return None, out
    batcher.put(out, row, element)
  return out, None


_END = object()
