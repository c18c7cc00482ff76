"""A feed: global batches, each host's rows made by its sidecar, with no framework.

A :class:`BatchLayout` (a framework adapter's) says which rows of every global batch
each host produces (for JAX, the rows its devices own under a sharding:
``jax/feed.py``; for PyTorch, each rank's slice) and how one leaf's row blocks become
the framework's array. :class:`Feed` opens one stream per host this process drives,
gathers each step's parts and hands them to the layout. ``state()`` is the position
after the last batch handed to the trainer, not after what was prefetched, so a feed
resumed from it continues with exactly the next batch. The batch order is the core's:
it depends only on the pipeline, its arguments, the seed and the batch index.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import enum
import hashlib
import json
import logging
import queue
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from sidecar._src.controller import display
from sidecar._src.controller.connection import HostInfo
from sidecar._src.controller.peers import LocalPeers, Peers
from sidecar._src.core import errors, interrupts, options as options_lib, progress as progress_lib
from sidecar._src.wire import codec, feed_batch
from sidecar._src.wire.protocol import pb

STATE_VERSION = 1
log = logging.getLogger(__name__)


class State(enum.Enum):
  OPEN = "open"
  CLOSED = "closed"


@dataclasses.dataclass(frozen=True, slots=True)
class HostRows:
  """The rows of every global batch that one host produces (one process's part of them,
  where several processes share the host): ``[start, stop)`` ranges, sorted and disjoint."""
  host_id: int
  ranges: tuple[tuple[int, int], ...]
  process: int = -1  # the trainer process that streams this part; -1: whoever drives the host


class BatchLayout(abc.ABC):
  """Where the rows of each global batch go: a framework adapter implements it.

  Attributes:
    global_batch_size: rows of every global batch.
    hosts: every host's rows (a part per process where several share a host), by host
      id then process (the hosts of all processes).
  """

  global_batch_size: int
  hosts: Sequence[HostRows]

  # Batches a feed keeps ahead on the devices when FeedOptions.device_prefetch is None:
  # a framework whose arrays cost a transfer (an accelerator) says how many.
  default_device_prefetch: int = 0

  @abc.abstractmethod
  def describe(self) -> Any:
    """A JSON value that must be the same in every process of a job (say, the device ids that
    take each range)."""

  @abc.abstractmethod
  def assemble(self, blocks: Sequence[Sequence[Any]], hosts: Sequence[HostRows]) -> Any:
    """One leaf of a global batch, from ``blocks[h][r]``: the rows of range ``r`` of
    ``hosts[h]`` (this process's hosts), numpy arrays that may be views of an arena
    (what is made of them must keep them alive)."""

  def release_dropped(self) -> None:  # noqa: B027  (most frameworks need nothing here)
    """Lets go now of the arena views of batches the trainer dropped, where the framework
    defers that (JAX until its next call into XLA): a feed waits for room they hold."""


# Makes a feed's BatchLayout: (global_batch_size, {device id: host id},
# {device id: process index}, known where several processes share hosts) -> layout.
LayoutFactory = Callable[[int, Mapping[int, int], Mapping[int, int]], BatchLayout]


def check_arguments(name: str, options: Any, hosts: Sequence[HostInfo], *,
                    global_batch_size: Any, num_epochs: Any) -> options_lib.FeedOptions:
  """``ctl.feed``'s options (the defaults if None), checked with its batch size, epochs
  and pipeline ``name`` on every host in ``hosts``.

  Raises:
    InvalidArgumentError: a bad option, batch size or epoch count, naming the value.
    NotRegisteredError: a host has no pipeline ``name``.
  """
  if options is None:
    options = options_lib.FeedOptions()
  if not isinstance(options, options_lib.FeedOptions):
    raise errors.InvalidArgumentError(
        f"options must be a sidecar.FeedOptions, got {type(options).__name__}")
  if not isinstance(global_batch_size, int) or global_batch_size < 1:
    raise errors.InvalidArgumentError(
        f"global_batch_size must be a positive int, got {global_batch_size!r}")
  if num_epochs is not None and (not isinstance(num_epochs, int) or num_epochs < 1):
    raise errors.InvalidArgumentError(f"num_epochs must be None or >= 1, got {num_epochs!r}")
  missing = [h.host_id for h in hosts if name not in h.pipelines]
  if missing:
    raise errors.not_registered("pipeline", name, hosts[0].pipelines, where=f" on hosts {missing}")
  return options


def _rows_disjoint_across_hosts(plans: Sequence[HostRows]) -> bool:
  rows = sorted(r for p in plans for r in p.ranges)
  return all(b <= c for (_, b), (c, _) in zip(rows, rows[1:]))


class Feed:
  """An iterator of global batches; use as a context manager. Made by ``Controller.feed``."""

  def __init__(self, *, name: str, layout: BatchLayout, seed: int, num_epochs: int | None,
               prefetch: int, state: dict[str, Any] | None, workers: int,
               open_stream: Callable[[int, pb.FeedSpec], Any], replay: int = 0,
               arena_use: Callable[[], dict[int, float]] = dict,
               local_hosts: Sequence[int] | None = None, peers: Peers | None = None,
               key: str = "feed", device_prefetch: int | None = None,
               on_batch: Callable[[float, float], None] | None = None):
    self.name = name
    # Told of each batch taken: how long next() blocked, and perf_counter() at its end
    # (the goodput ledger client's data wait and steps: controller/goodput.py).
    self._on_batch = on_batch
    self._arena_use = arena_use
    self._layout = layout
    plans = list(layout.hosts)
    self._all_plans = plans
    self._peers = peers if peers is not None else LocalPeers()
    local = {p.host_id for p in plans} if local_hosts is None else set(local_hosts)
    mine = lambda p: p.host_id in local and p.process in (-1, self._peers.index)
    self._plans = [p for p in plans if mine(p)]  # the hosts (parts) this process drives
    self._key = key
    self._g = layout.global_batch_size
    self._seed = seed
    self._state = self._state_before = _check_state(state, name=name, seed=seed,
                                                    num_hosts=len(plans))
    self._open_stream, self._num_epochs, self._workers = open_stream, num_epochs, workers
    self._replay = replay
    self._streams: list[Any] = []
    self._host_batches: list[Any] = []  # of the batch being gathered
    self._kept = interrupts.Kept()  # a batch Ctrl-C left behind, for the next next()
    self._ahead_depth = (layout.default_device_prefetch if device_prefetch is None
                         else device_prefetch)
    self._ahead = _Ahead(self, self._ahead_depth) if self._ahead_depth else None
    self.status = State.OPEN
    self._seeks = 0  # seek() calls so far: each position's keys between processes are new
    try:
      self._open_streams()
    except BaseException:
      self.close()
      raise
    self._waits: list[float] = []
    self._produce: list[float] = []
    self._started = time.perf_counter()
    self._batches = 0
    self._gathered: tuple[int, dict[str, Any]] = (-1, {})  # state() at a batch count

  def _open_streams(self) -> None:
    """Opens a stream on each host this process drives, at the position ``self._state``."""
    plans = self._all_plans
    shardable = _rows_disjoint_across_hosts(plans)
    for i, p in enumerate(plans):
      if p not in self._plans:
        continue
      spec = pb.FeedSpec(
          global_batch_size=self._g, rows=[pb.RowRange(start=a, stop=b) for a, b in p.ranges],
          seed=self._seed, num_epochs=self._num_epochs or 0,
          shard_index=i if shardable else 0, shard_count=len(plans) if shardable else 0,
          state_json=json.dumps(_host_start(self._state, i)), workers=self._workers,
          replay=self._replay)
      self._streams.append(self._open_stream(p.host_id, spec))

  def __iter__(self) -> Feed:
    return self

  def __next__(self) -> Any:
    # Ctrl-C raises only while no host's item is half taken, or after the batch was made,
    # which the next call then returns (``interrupts.Kept``).
    if self._on_batch is None:
      return self._kept.take(self._next)
    t0 = time.perf_counter()
    batch = self._kept.take(self._next)
    t1 = time.perf_counter()
    self._on_batch(t1 - t0, t1)
    return batch

  def _next(self) -> Any:
    if self.status is State.CLOSED:
      raise errors.ClosedError(f"feed {self.name!r} is closed")
    if self._ahead is None:
      made = self._make()
    else:
      t0 = time.perf_counter()
      with (progress_lib.waiting(f"feed {self.name!r}: waiting for the first batch")
            if not self._batches else contextlib.nullcontext()):
        made = self._ahead.take()
      made = made._replace(wait_s=time.perf_counter() - t0)
    self._state_before, self._state = self._state, made.state
    self._waits.append(made.wait_s)
    self._produce.append(made.produce_s)
    self._batches += 1
    return made.batch

  def _make(self, *, ahead: bool = False) -> _Made:
    """The next batch, made in this thread: every host's part, gathered and assembled.

    Raises StopIteration at the end, or the sidecars' errors: the feed is then closed,
    except in the thread that makes batches ahead (``ahead``), whose batches made before
    are still the trainer's to take (it closes the feed when it takes the end).
    """
    t0 = time.perf_counter()
    # A batch's parts, one per host, kept across a KeyboardInterrupt (a notebook cell
    # stopped mid-batch): the next call goes on with the host it stopped at, so no
    # host's part is lost and the hosts stay on the same batch.
    items = self._host_batches
    # The batches the trainer dropped give their blocks back before it waits for the
    # next, whose room they may be (a loop that makes no call into XLA meanwhile).
    self._layout.release_dropped()
    try:
      # The first batch may take a while (a pipeline opening its files): say so after 2 s.
      with (progress_lib.waiting(f"feed {self.name!r}: waiting for the first batch")
            if not self._batches and not ahead else contextlib.nullcontext()):
        while len(items) < len(self._streams):
          items.append(next(self._streams[len(items)]))
    except StopIteration:
      if self.status is State.CLOSED:  # closed under us (Controller.cancel), not the end
        raise errors.ClosedError(f"feed {self.name!r} was closed") from None
      if not ahead:
        self.close()
      raise
    except errors.SidecarError:
      if not ahead:
        self.close()
      raise
    except KeyboardInterrupt as e:
      # Raised from here: the frames below (a half-decoded item's views) would keep
      # their blocks as long as the notebook keeps the traceback.
      raise e.with_traceback(None) from None
    wait = time.perf_counter() - t0
    try:
      batch = self._assemble(items)
    except errors.SidecarError:
      if not ahead:
        self.close()
      raise
    state = self._merge([item.state for item in items])
    self._host_batches = []  # from here on the batch is the trainer's
    return _Made(batch, state, wait, max(item.produce_s for item in items))

  def _assemble(self, batches: list[feed_batch.HostBatch]) -> Any:
    """Every host's part (per leaf, an array per range) into the layout's batch, leaf by
    leaf, in the structure of the pipeline's elements."""
    structure = batches[0].structure
    for p in batches[1:]:
      if len(p.leaves) != len(batches[0].leaves) or p.structure != structure:
        raise errors.InvalidArgumentError(
            f"feed {self.name!r}: hosts' batches differ in structure ({structure!r:.200} and "
            f"{p.structure!r:.200}); every host must run the same pipeline code")
    leaves = [self._layout.assemble([p.leaves[i] for p in batches], self._plans)
              for i in range(len(batches[0].leaves))]
    return feed_batch.fill(structure, leaves)

  def _merge(self, states: list[dict[str, Any]]) -> dict[str, Any]:
    base = {"version": STATE_VERSION, "pipeline": self.name, "seed": self._seed,
            "global_batch_size": self._g}
    if "data" in states[0]:  # what the data was (``@sidecar.pipeline(identity=...)``)
      base["data"] = states[0]["data"]
    if states[0]["kind"] == "map":
      return {**base, "kind": "map", "epoch": states[0]["epoch"],
              "position": states[0]["position"]}
    return {**base, "kind": "iter", "shards": [
        {"epoch": s["epoch"], "position": s["position"]} for s in states]}

  def state(self) -> dict[str, Any]:
    """Where the trainer is: JSON-serialisable; ``ctl.feed(..., state=...)`` resumes there.

    The same in every process of a multi-process job (all of them must call it).
    """
    batches, own = self._batches, self._state
    if self._kept.held:  # the batch a Ctrl-C kept for the next next() is not the trainer's yet
      batches, own = batches - 1, self._state_before
    if self._peers.count == 1 or own.get("kind") != "iter" or not batches:
      return dict(own)
    # A plain iterable's shards are positioned one by one: every process tells its own.
    if self._gathered[0] != batches:
      part = lambda p: f"{p.host_id}/{p.process}"
      mine = {part(p): shard for p, shard in zip(self._plans, own["shards"])}
      shards: dict[str, Any] = {}
      key = f"{self._key}/state/{batches}" + (f"/{self._seeks}" if self._seeks else "")
      for text in self._peers.all_gather(key, json.dumps(mine)):
        shards.update(json.loads(text))
      self._gathered = (batches, {**own, "shards": [shards[part(p)] for p in self._all_plans]})
    return dict(self._gathered[1])

  def seek(self, state: dict[str, Any] | None) -> None:
    """Moves the feed to ``state`` (what :meth:`state` returned, say the ``data_state`` of
    a checkpoint; None: the start): the next batch is the one after it.

    For a rollback inside the process (``sidecar.jax.Recovery``): the feed keeps its layout
    and its arguments, the batches made ahead are dropped and each host's stream starts
    again at ``state``. Works on a feed that an error or its end closed, which it opens
    again. In a job of several processes, every process seeks to the same state.

    Raises:
      InvalidArgumentError: ``state`` is not a position of this feed's pipeline and seed.
    """
    state = _check_state(state, name=self.name, seed=self._seed,
                         num_hosts=len(self._all_plans))
    self.close()
    self._state = self._state_before = state
    self._seeks += 1
    self._gathered = (-1, {})
    self._streams = []
    self._ahead = _Ahead(self, self._ahead_depth) if self._ahead_depth else None
    self.status = State.OPEN
    try:
      self._open_streams()
    except BaseException:
      self.close()
      raise

  def saved(self, data_state: Any) -> None:
    """The trainer saved with ``data_state`` (a checkpointer's ``save(...,
    data_state=...)``): where it is this feed's position, each host's sidecar is told (with
    the next credit), and lets go of the batches it kept from before it (a rollback or a
    restart re-does only the steps after a save). Anything else is not this feed's:
    nothing is told."""
    if not isinstance(data_state, dict) or self.status is not State.OPEN:
      return
    try:
      state = _check_state(data_state, name=self.name, seed=self._seed,
                           num_hosts=len(self._all_plans))
    except errors.InvalidArgumentError:
      return
    if state.get("kind") not in ("map", "iter"):
      return
    # The streams, in the order _open_streams opened them: this process's plans in order.
    mine = [i for i, p in enumerate(self._all_plans) if p in self._plans]
    for stream, i in zip(self._streams, mine):
      stream.tell_saved(json.dumps(_host_start(state, i)))

  def stats(self) -> dict[str, Any]:
    """Batches, batches/s, the trainer's wait for data per step, the sidecars' time per batch,
    and each host's arena occupancy (the fraction of slots in use)."""
    return {**self._own_stats(), "arena_occupancy": self._arena_use()}

  def _own_stats(self) -> dict[str, Any]:
    """What :meth:`stats` says that needs no call to the sidecars."""
    elapsed = time.perf_counter() - self._started
    waits = self._waits or [0.0]
    return {
        "batches": self._batches,
        "batches_per_s": self._batches / elapsed if elapsed > 0 else 0.0,
        "wait_s_mean": statistics.fmean(waits), "wait_s_p50": statistics.median(waits),
        "wait_s_max": max(waits),
        "produce_s_mean": statistics.fmean(self._produce) if self._produce else 0.0,
        "hosts": [p.host_id for p in self._plans],
    }

  def _facts(self) -> list[tuple[str, str]]:
    return display.feed_facts(self._own_stats(), self._state, self.status.value)

  def __repr__(self) -> str:
    return display.text_block(f"sidecar feed {self.name!r}", self._facts())

  def _repr_html_(self) -> str:
    return display.html_block(f"sidecar feed {self.name!r}", self._facts())

  def close(self) -> None:
    """Stops every host's stream (and the thread that puts batches ahead); idempotent."""
    self.status = State.CLOSED
    self._kept.clear()
    for s in self._streams:
      s.close()
    if self._ahead is not None:
      self._ahead.close()  # after the streams: a wait for a host's part ends with them
    self._host_batches.clear()  # also where an interrupt's traceback still holds the list

  def __enter__(self) -> Feed:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class _Made(NamedTuple):
  """A batch made for the trainer, with the feed's position after it."""
  batch: Any
  state: dict[str, Any]
  wait_s: float  # how long the hosts' parts were waited for
  produce_s: float  # the slowest host's time to produce its part


_END = object()  # the thread's last queue entry where the feed ended


class _Ahead:
  """A thread that makes a feed's next batches while the trainer computes, so their
  transfers to the devices overlap its steps: ``depth`` batches wait in a queue (each
  holding its arena blocks until its device copies are done: the arrays keep the views
  they were made of), and :meth:`take` hands the oldest over.

  The thread is the feed's: :meth:`close` (called by ``Feed.close``, after the streams
  are closed, so a wait for a host's part ends) stops and joins it, dropping what is
  queued.
  """

  def __init__(self, feed: Feed, depth: int):
    self._feed = feed
    self._queue: queue.Queue = queue.Queue(maxsize=depth)
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def take(self) -> _Made:
    """The oldest batch made (starting the thread at the first call); raises where the
    thread ended: StopIteration at the feed's end, or the error it met (the feed then
    closes). Ctrl-C raises while the wait goes on (no batch is half taken)."""
    if self._thread is None:
      self._thread = threading.Thread(target=self._run, daemon=True,
                                      name=f"sidecar-feed-{self._feed.name}")
      self._thread.start()
    while True:
      try:
        made = self._queue.get(timeout=interrupts.POLL_S)
        break
      except queue.Empty:
        interrupts.check()
        if self._stop.is_set():
          raise errors.ClosedError(f"feed {self._feed.name!r} was closed") from None
    if isinstance(made, _Made):
      return made
    self._feed.close()
    if made is _END:
      raise StopIteration
    raise made

  def _run(self) -> None:
    try:
      while not self._stop.is_set():
        if not self._put(self._feed._make(ahead=True)):
          return
    except StopIteration:
      self._put(_END)
    except BaseException as e:  # the trainer's next take() raises it; this thread's
      self._put(e.with_traceback(None))  # frames would hold the parts' blocks

  def _put(self, entry: Any) -> bool:
    """Queues ``entry`` once there is room; False if the feed closed meanwhile."""
    while not self._stop.is_set():
      try:
        self._queue.put(entry, timeout=interrupts.POLL_S)
        return True
      except queue.Full:
        pass
    return False

  def close(self) -> None:
    self._stop.set()
    if self._thread is not None and self._thread is not threading.current_thread():
      self._thread.join(timeout=30.0)
      if self._thread.is_alive():
        log.warning("feed %r: its device-prefetch thread did not stop in 30 s",
                    self._feed.name)
    while True:  # the batches made ahead, with their blocks
      try:
        self._queue.get_nowait()
      except queue.Empty:
        break


def _check_state(state: dict[str, Any] | None, *, name: str, seed: int, num_hosts: int
                 ) -> dict[str, Any]:
  if state is None:
    return {"version": STATE_VERSION, "pipeline": name, "seed": seed, "kind": "start"}
  if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
    raise errors.InvalidArgumentError(
        f"state must be a dict from feed.state() (version {STATE_VERSION}), got {state!r:.200}")
  if state.get("pipeline") != name or state.get("seed") != seed:
    raise errors.InvalidArgumentError(
        f"state is for pipeline {state.get('pipeline')!r} with seed {state.get('seed')!r}, "
        f"but this feed is {name!r} with seed {seed!r}; resume with the same pipeline and seed")
  if state.get("kind") == "iter" and len(state["shards"]) != num_hosts:
    raise errors.InvalidArgumentError(
        f"state was saved with {len(state['shards'])} hosts and this feed has {num_hosts}; "
        "a pipeline that returns a plain iterable resumes only on the same host count: "
        "return a grain.MapDataset to resume on any")
  return dict(state)


def _host_start(state: dict[str, Any], i: int) -> dict[str, Any]:
  """Host ``i``'s start: its position, and what the data was (the sidecar refuses a
  resume on other data)."""
  data = {"data": state["data"]} if isinstance(state.get("data"), str) else {}
  kind = state.get("kind")
  if kind == "map":
    return {"kind": "map", "epoch": state["epoch"], "position": state["position"], **data}
  if kind == "iter":
    return {"kind": "iter", **state["shards"][i], **data}
  return {}


def check_and_open(name: str, number: int, *, global_batch_size: int, layout: BatchLayout,
                   kwargs: Mapping[str, Any], seed: int, num_epochs: int | None,
                   state: dict[str, Any] | None, options: options_lib.FeedOptions,
                   peers: Peers, open_call: Callable[[int, pb.CallRequest], Any],
                   session: Callable[[int], str], local_hosts: Sequence[int],
                   arena_use: Callable[[], dict[int, float]],
                   on_batch: Callable[[float, float], None] | None = None) -> Feed:
  """Feed ``number`` of a controller, of registered pipeline ``name``, once every process
  of the job has checked that its arguments are the same everywhere: each of
  ``local_hosts`` streams its rows, ``open_call(host_id, request)`` opening the stream with
  that host's worker ``session(host_id)``."""
  key = f"feed/{number}"
  encoded, no_args = codec.encode(dict(kwargs), where="kwargs"), codec.encode(())
  peers.check_same(f"{key}/open", {
      "pipeline": name, "global_batch_size": global_batch_size, "seed": seed,
      "num_epochs": num_epochs, "workers": options.workers, "state": state,
      "kwargs": hashlib.sha256(encoded.SerializeToString(deterministic=True)).hexdigest()[:16],
      "mesh": layout.describe()}, what=f"the arguments of feed {number} ({name!r})")

  def open_stream(host_id: int, spec: pb.FeedSpec):
    request = pb.CallRequest(name=name, args=no_args, kwargs=encoded, feed=spec,
                             worker_session=session(host_id))
    return open_call(host_id, request)

  return Feed(name=name, layout=layout, seed=seed, num_epochs=num_epochs,
              prefetch=options.prefetch, state=state, workers=options.workers,
              open_stream=open_stream, local_hosts=local_hosts, peers=peers, key=key,
              arena_use=arena_use, device_prefetch=options.device_prefetch,
              replay=options.replay,
              on_batch=on_batch)


def length(name: str, *, global_batch_size: int, kwargs: Mapping[str, Any], seed: int,
           num_epochs: int | None, open_call: Callable[[pb.CallRequest], Any]) -> int | None:
  """Global batches a feed of pipeline ``name`` yields from its start to its end, as one
  sidecar (``open_call``) answers without reading a row: None for a pipeline that returns
  an iterable (no length), or with ``num_epochs`` None (endless)."""
  spec = pb.FeedSpec(global_batch_size=global_batch_size,
                     rows=[pb.RowRange(start=0, stop=global_batch_size)], seed=seed,
                     num_epochs=num_epochs or 0, shard_index=0, shard_count=1,
                     length_only=True)
  request = pb.CallRequest(name=name, args=codec.encode(()),
                           kwargs=codec.encode(dict(kwargs), where="kwargs"), feed=spec)
  with contextlib.closing(open_call(request)) as stream:
    answer = next(iter(stream))
  return answer.state.get("length")
