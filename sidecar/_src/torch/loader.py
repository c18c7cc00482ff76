"""``sidecar.torch.DataLoader``: a feed's global batches, each rank its contiguous slice.

``batch_size`` is per rank, as in ``torch.utils.data.DataLoader``: the global batch is
``batch_size * WORLD_SIZE`` rows, and rank ``r`` gets rows ``[r * batch_size, (r + 1) *
batch_size)`` of each. The global batches are the controller core's, element for element
those ``ctl.feed`` yields for the same pipeline, arguments, seed and global batch size,
whichever framework reads them and on however many ranks. Each rank's rows are made by
its own node's sidecar straight into that sidecar's arena, and arrive as tensors over
it (no copy): a tensor holds its block until it (and every view of it) is freed.

``state_dict()`` is what the rank consumed, not what was prefetched: JSON, the same on
every rank, as ``torchdata``'s ``StatefulDataLoader`` gives it; ``load_state_dict(sd)``
before iterating resumes there, on this or another world size with the same global
batch; ``seek(sd)`` moves the iteration in progress there (an in-process rollback:
``sidecar.torch.Recovery``).
"""

from __future__ import annotations

import collections
import json
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from sidecar._src.controller import controller as core
from sidecar._src.controller.feed import BatchLayout, Feed, HostRows
from sidecar._src.core import errors, options as options_lib, trees
from sidecar._src.torch import controller as torch_controller, framework

STATE_VERSION = 1
_PINNED: weakref.WeakSet = weakref.WeakSet()  # arenas registered with CUDA (once each)


class RankLayout(BatchLayout):
  """Rank ``r`` takes rows ``[r * batch_size, (r + 1) * batch_size)`` of each global batch,
  from its own node's sidecar (``rank_hosts[r]``). With one rank and several hosts, the
  rows are split evenly among the hosts and concatenated here (a copy)."""

  def __init__(self, batch_size: int, world_size: int, rank_hosts: Mapping[int, int],
               hosts: Sequence[int]):
    self.batch_size, self.world_size = batch_size, world_size
    self.global_batch_size = batch_size * world_size
    if world_size > 1:
      missing = sorted(set(range(world_size)) - set(rank_hosts))
      if missing:
        raise errors.InvalidArgumentError(
            f"ranks {missing} attached to no sidecar; every rank must run sidecar.torch."
            "connect() (each rank's Worker tells its sidecar who it is)")
      self.hosts = [HostRows(rank_hosts[r], ((r * batch_size, (r + 1) * batch_size),), r)
                    for r in range(world_size)]
    else:
      n = len(hosts)
      if batch_size % n:
        raise errors.InvalidArgumentError(
            f"batch_size {batch_size} does not split evenly over this process's {n} hosts")
      part = batch_size // n
      self.hosts = [HostRows(h, ((i * part, (i + 1) * part),)) for i, h in enumerate(hosts)]

  def describe(self) -> Any:
    return {"batch_size": self.batch_size, "world_size": self.world_size}

  def assemble(self, blocks: Sequence[Sequence[Any]], hosts: Sequence[HostRows]) -> Any:
    arrays = [a for host_blocks in blocks for a in host_blocks]
    if len(arrays) == 1:
      return framework.to_tensors(arrays[0])
    return torch.cat([framework.to_tensors(a) for a in arrays])


class DataLoader:
  """Batches of registered pipeline ``pipeline`` for this rank, as torch tensors.

  Example::

    loader = sidecar.torch.DataLoader("images", batch_size=32, seed=0)
    for step, batch in enumerate(loader):   # batch["image"]: a (32, 224, 224, 3) tensor
      loss = model(batch["image"].to(device)).mean()
      if step % 100 == 0:
        torch.save(loader.state_dict(), "data.pt")   # or in a DCP state dict

  Args:
    pipeline: a registered ``@sidecar.pipeline``.
    batch_size: rows per rank; the global batch is ``batch_size * WORLD_SIZE``.
    kwargs: the pipeline's own arguments.
    seed: shuffling seed (for pipelines that return a ``grain.MapDataset``).
    num_epochs: epochs one iteration runs; None: forever.
    prefetch: batches each sidecar makes ahead of this rank.
    workers: processes each sidecar spawns to make batches (0: its own threads).
    device: where batches go (``"cuda:0"``): copied with ``non_blocking=True``; default the
      CPU, as views of the arena.
    pin_memory: register the arena with the CUDA driver once (``cudaHostRegister``) so
      those copies run at full host-to-device speed. Needs CUDA.
    controller: default this rank's, from :func:`sidecar.torch.connect`.

  One iteration runs the whole feed; iterating again starts it from the beginning, or
  from the state :meth:`load_state_dict` gave. ``len()`` is its batches from the start
  where the pipeline has a length (a ``grain.MapDataset`` read for ``num_epochs``).
  """

  def __init__(self, pipeline: str, batch_size: int, *, kwargs: Mapping[str, Any] | None = None,
               seed: int = 0, num_epochs: int | None = None, prefetch: int = 2,
               workers: int = 0, device: Any = None, pin_memory: bool = False,
               controller: core.Controller | None = None):
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
      raise errors.InvalidArgumentError(f"batch_size must be a positive int, got {batch_size!r}")
    self.pipeline, self.batch_size = pipeline, batch_size
    self.kwargs, self.seed, self.num_epochs = dict(kwargs or {}), seed, num_epochs
    self.options = options_lib.FeedOptions(prefetch=prefetch, workers=workers)
    self.device = None if device is None else torch.device(device)
    self.pin_memory = pin_memory
    self._ctl = torch_controller.controller_or_connect(controller)
    self.world_size = max(self._ctl.peers.count, 1)
    self.rank = self._ctl.peers.index
    self._feed: Feed | None = None
    self._resume: dict[str, Any] | None = None
    self._copies: collections.deque = collections.deque()  # (event, host batch) in flight
    self._length: int | None = None  # len(), once asked
    if pin_memory:
      self._pin()

  @property
  def global_batch_size(self) -> int:
    return self.batch_size * self.world_size

  def _pin(self) -> None:
    """Registers the arena of this rank's sidecar with CUDA once (page-locked)."""
    if not torch.cuda.is_available():
      raise errors.InvalidArgumentError(
          "pin_memory=True needs CUDA, which this process does not have; leave it False")
    for host in self._ctl.local_hosts:
      worker = self._ctl.worker(host)
      if worker is None or worker.arena in _PINNED:
        continue
      base = worker.arena.buffer.ctypes.data
      code = torch.cuda.cudart().cudaHostRegister(base, worker.arena.size, 0)
      if int(code) != 0:
        raise errors.ResourceExhaustedError(
            f"cudaHostRegister of host {host}'s arena ({worker.arena.size} bytes) failed: "
            f"{code}; leave pin_memory False or raise the locked-memory limit")
      _PINNED.add(worker.arena)

  def _open(self) -> Feed:
    ctl, rank_state = self._ctl, self._resume
    hosts = list(ctl.local_hosts)

    def layout(g: int, device_hosts: Mapping[int, int], device_processes: Mapping[int, int]
               ) -> BatchLayout:
      del g, device_processes  # a rank's one device id is its rank
      return RankLayout(self.batch_size, self.world_size, device_hosts, hosts)

    return ctl.open_feed(self.pipeline, global_batch_size=self.global_batch_size, layout=layout,
                         kwargs=self.kwargs, seed=self.seed, num_epochs=self.num_epochs,
                         state=rank_state, options=self.options)

  def __iter__(self) -> Iterator[Any]:
    self.close()
    self._feed = self._open()
    return self._batches(self._feed)

  def _batches(self, feed: Feed) -> Iterator[Any]:
    for batch in feed:
      yield self._to_device(batch)
    # The feed ran to its end: the next iteration starts it over. (A loop that breaks
    # leaves it open, so state_dict() says where it stopped.)
    if feed is self._feed:
      self._feed, self._resume = None, None
    feed.close()

  def _to_device(self, batch: Any) -> Any:
    if self.device is None or self.device.type == "cpu":
      return batch
    out = trees.map_leaves(
        lambda t: t.to(self.device, non_blocking=True) if isinstance(t, torch.Tensor) else t,
        batch)
    if self.pin_memory:  # the DMA reads the arena block: hold it until the copy is done
      event = torch.cuda.Event()
      event.record(torch.cuda.current_stream(self.device))
      self._copies.append((event, batch))
      while self._copies and self._copies[0][0].query():
        self._copies.popleft()
    return out

  def state_dict(self) -> dict[str, Any]:
    """Where this rank is: the batches consumed (not those prefetched). JSON; the same on
    every rank (every rank must call it)."""
    feed_state = self._feed.state() if self._feed is not None else self._resume
    # The feed's position as one JSON string: the same keys before the first batch and
    # after, so a DCP state dict made before iterating loads a saved one.
    return {"version": STATE_VERSION, "pipeline": self.pipeline, "seed": self.seed,
            "global_batch_size": self.global_batch_size, "feed": json.dumps(feed_state)}

  def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
    """Resumes at ``state_dict`` (from :meth:`state_dict`) when next iterated.

    Raises:
      InvalidArgumentError: the state is of another pipeline or seed, or of another global
        batch size (``batch_size * WORLD_SIZE`` must stay what it was).
    """
    position = self._position(state_dict)
    self.close()
    self._resume = position

  def seek(self, state_dict: Mapping[str, Any] | None) -> None:
    """Moves the loader to ``state_dict`` (from :meth:`state_dict`; None: the start) now:
    the next batch of the iteration in progress is the one after it, its batches made
    ahead dropped (``Feed.seek``); with none in progress, the next iteration starts there.
    For a rollback inside the process (``sidecar.torch.Recovery``): a ``for`` loop over
    the loader goes on from the position of the step restored. Every rank seeks to the
    same state.

    Raises:
      InvalidArgumentError: as :meth:`load_state_dict`.
    """
    position = None if state_dict is None else self._position(state_dict)
    if self._feed is None:
      self._resume = position
      return
    self._feed.seek(position)

  def _position(self, state_dict: Mapping[str, Any]) -> dict[str, Any] | None:
    """The feed's position ``state_dict`` holds, checked against this loader."""
    if not isinstance(state_dict, Mapping) or state_dict.get("version") != STATE_VERSION:
      raise errors.InvalidArgumentError(
          f"state_dict must come from DataLoader.state_dict() (version {STATE_VERSION}), got "
          f"{state_dict!r:.200}")
    saved = state_dict.get("global_batch_size")
    if saved != self.global_batch_size:
      fix = (f"use batch_size {saved // self.world_size}" if isinstance(saved, int)
             and saved % self.world_size == 0 else
             f"{saved} rows do not split over {self.world_size} ranks: resume on a world size "
             f"that divides it")
      raise errors.InvalidArgumentError(
          f"the state was saved with a global batch of {saved} rows; this loader's is "
          f"{self.batch_size} x {self.world_size} ranks = {self.global_batch_size}: {fix}")
    if state_dict.get("pipeline") != self.pipeline or state_dict.get("seed") != self.seed:
      raise errors.InvalidArgumentError(
          f"the state is of pipeline {state_dict.get('pipeline')!r} with seed "
          f"{state_dict.get('seed')!r}; this loader reads {self.pipeline!r} with seed {self.seed}")
    try:
      return json.loads(state_dict.get("feed") or "null")
    except (TypeError, ValueError) as e:
      raise errors.InvalidArgumentError(f"state_dict['feed'] is not the JSON it was: {e}") from None

  def close(self) -> None:
    """Closes the feed in flight (its prefetched blocks go back); idempotent."""
    feed, self._feed = self._feed, None
    if feed is not None:
      self._resume = feed.state()
      feed.close()

  def __len__(self) -> int:
    """Batches of one iteration from the start, where the pipeline has a length: a
    ``grain.MapDataset`` read for ``num_epochs`` (its sidecar answers without reading)."""
    if self.num_epochs is not None and self._length is None:
      self._length = self._ctl.feed_length(
          self.pipeline, global_batch_size=self.global_batch_size, kwargs=self.kwargs,
          seed=self.seed, num_epochs=self.num_epochs)
    if self._length is None:
      raise TypeError(
          f"this sidecar.torch.DataLoader of {self.pipeline!r} has no len(): " + (
              "num_epochs is None (it reads forever); pass num_epochs"
              if self.num_epochs is None else
              "its pipeline returns an iterable, whose length no sidecar knows without "
              "reading it all. Count the steps yourself (examples // global_batch_size per "
              "epoch, e.g. for an LR schedule) and stop after them: for step, batch in "
              "zip(range(steps), loader); or, with grain installed (pip install grain), "
              "return a grain.MapDataset, whose length is known"))
    return self._length

  def __enter__(self) -> DataLoader:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def __repr__(self) -> str:
    return (f"sidecar.torch.DataLoader({self.pipeline!r}, batch_size={self.batch_size}, "
            f"rank={self.rank} of {self.world_size})")

