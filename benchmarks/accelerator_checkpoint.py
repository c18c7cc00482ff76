"""The checkpoint part of ``benchmarks.accelerator``: Orbax's async save and restore beside
``ctl.checkpointer``'s, of one state on the device JAX picks, in the trainer process.

Every save is of fresh arrays (a donating jitted ``x + 1`` before it), as in training: a
``jax.Array`` read once keeps its host copy, and a later save of it would copy nothing.
Each restore is compared bit for bit, on the device, with a copy taken before the save.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import SingleDeviceSharding

from benchmarks import checkpoint as ckpt_bench
from benchmarks.accelerator_rows import Row
from benchmarks.common import rate
from sidecar._src.jax import checkpoint as jax_checkpoint

ROW_WIDTH = 4096  # float32 elements per row of a leaf: 16 KiB
DONATING_STEPS = 3  # jitted donating steps run at once after save(), as in the issue
PIECE_MIB = (4, 16, 64)  # the chip's device-to-host of the state by pieces of these sizes
PIECES_IN_FLIGHT = 4
LOOPS = (1, 8)  # the training loops: steps per dispatch


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
  leaves: int  # arrays in the state, each state_bytes / leaves
  state_bytes: int
  saves: int  # later saves per saver with the trainer idle (after each one's first)
  busy_saves: int  # saves per saver with the training loop running
  window_s: float  # the training loop's rate with no save in flight, before each busy save
  matmul: int  # the training loop's square bf16 matrices

  @property
  def leaf_shape(self) -> tuple[int, int]:
    return (max(self.state_bytes // self.leaves // 4 // ROW_WIDTH, 1), ROW_WIDTH)


@dataclasses.dataclass(frozen=True, slots=True)
class ChipLimits:
  """The chip's own figures for the state, from the chip part of the run."""
  d2h_s: float  # device-to-host of the state: copy_to_host_async on all, then np.asarray
  h2d_s: float  # host-to-device of the state, a put per leaf, all in flight
  memcpy_s: float  # one memcpy of the state, one thread
  d2h_pieces_s: dict[int, float] = dataclasses.field(default_factory=dict)  # MiB: s
  # By PIECE_MIB[0] pieces on one thread kept from run to run (not the main thread), each
  # timed run: the runtime allocates each piece's host buffer from the taking thread's
  # malloc arena, and one thread's may be warm where another's faults every piece in anew.
  kept_thread: tuple[float, ...] = ()
  kept_thread_arena: tuple[float, ...] = ()  # the same into a memfd arena, as a save's
  # The library's own D2H (a save's split and piece transfers, each into its rows) on that
  # thread into that arena: the stager's copy without the sidecar.
  library: tuple[float, ...] = ()
  # By PIECE_MIB[0] pieces into pre-faulted host arrays, one run after each round of the
  # idle saves (the first round's dropped), on the main thread and on a kept thread: the
  # D2H in the process's state that the saves' staged figures see.
  main_beside_saves: tuple[float, ...] = ()
  kept_beside_saves: tuple[float, ...] = ()

  @property
  def fastest_d2h_s(self) -> float:
    """The fastest device-to-host of the state by pieces, on either thread, into either
    memory (issue 44 target 2's baseline: whole arrays are no way for a save, they nearly
    stop a loop beside them); whole arrays' where none was measured."""
    kept = [statistics.median(r) for r in (self.kept_thread, self.kept_thread_arena,
                                           self.main_beside_saves, self.kept_beside_saves) if r]
    return min([*kept, *self.d2h_pieces_s.values()], default=self.d2h_s)


# ---- the chip's device-to-host, whole and by pieces ---------------------------------


def piece_rows(shape: tuple[int, ...], itemsize: int, piece_bytes: int
               ) -> tuple[tuple[int, int], ...]:
  """Leading-axis rows of each piece (a multiple of 8 rows where pieces hold more)."""
  row = int(np.prod(shape[1:], dtype=np.int64)) * itemsize
  rows = max(piece_bytes // row, 1)
  rows -= rows % 8 if rows >= 8 else 0
  return tuple((a, min(a + rows, shape[0])) for a in range(0, shape[0], rows))


@functools.partial(jax.jit, static_argnums=1)
def split(arrays, rows):
  """One program: every array's pieces, new buffers."""
  return [[jax.lax.slice_in_dim(a, s, e, axis=0) for s, e in r] for a, r in zip(arrays, rows)]


def d2h_whole(leaves: list[jax.Array], dst: list[np.ndarray]) -> None:
  """copy_to_host_async on every array, then each into its host array."""
  for a in leaves:
    a.copy_to_host_async()
  for d, a in zip(dst, leaves):
    np.copyto(d, np.asarray(a))


def d2h_pieces(leaves: list[jax.Array], dst: list[np.ndarray], piece_bytes: int) -> None:
  """One jitted split into pieces, their transfers in order with ``PIECES_IN_FLIGHT`` in
  flight, each piece into its rows of the host array (issue 44's probe)."""
  rows = tuple(piece_rows(a.shape, a.dtype.itemsize, piece_bytes) for a in leaves)
  pieces = [(d[s:e], p) for d, r, ps in zip(dst, rows, split(leaves, rows))
            for (s, e), p in zip(r, ps)]
  for _, p in pieces[:PIECES_IN_FLIGHT]:
    p.copy_to_host_async()
  for i, (d, p) in enumerate(pieces):
    if i + PIECES_IN_FLIGHT < len(pieces):
      pieces[i + PIECES_IN_FLIGHT][1].copy_to_host_async()
    np.copyto(d, np.asarray(p))
    pieces[i] = None  # the device's piece goes


def d2h_library(leaves: list[jax.Array], dst: list[np.ndarray], piece_bytes: int) -> None:
  """The library's device-to-host of a save (its jitted split, its pieces' transfers in
  flight, each piece into its rows of the host array), as its stager runs it, into ``dst``
  instead of a sidecar's arena blocks."""
  splits_compiled()
  copies = jax_checkpoint._off_device([([], i, a) for i, a in enumerate(leaves)],
                                       piece_bytes=piece_bytes)
  for _, i, c in copies:
    if isinstance(c, np.ndarray):  # a device without room for the pieces: whole
      np.copyto(dst[i], c)
    else:
      c.copy_into(dst[i])


def make_state(device, plan: Plan) -> dict[str, jax.Array]:
  """``plan.leaves`` float32 arrays of random normals, made on ``device``."""
  make = jax.jit(lambda k: jax.random.normal(k, plan.leaf_shape, jnp.float32),
                 out_shardings=SingleDeviceSharding(device))
  keys = jax.random.split(jax.random.key(0), plan.leaves)
  return jax.block_until_ready({f"layer{i}": make(k) for i, k in enumerate(keys)})


# The state's programs, each compiled at its first call (before any timing).
bump = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)
copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))


def timed_d2h(state, dst: list[np.ndarray], *, run: Callable = lambda f: f(),
              how: Callable = d2h_pieces, piece_bytes: int = PIECE_MIB[0] << 20
              ) -> tuple[Any, float]:
  """The state bumped (fresh arrays, no host copy), and the seconds of one device-to-host
  of it by pieces (``how``) into the pre-faulted host arrays ``dst``, made by ``run`` (on
  this thread, or handed to another)."""
  state = jax.block_until_ready(bump(state))
  t0 = time.perf_counter()
  run(functools.partial(how, jax.tree.leaves(state), dst, piece_bytes))
  return state, time.perf_counter() - t0


@jax.jit
def same_bits(a, b) -> jax.Array:
  """Whether two trees of float32 arrays are bit for bit the same (NaNs and -0.0 too)."""
  bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jnp.all(jnp.stack([jnp.all(bits(x) == bits(y))
                            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]))


@functools.partial(jax.jit, static_argnums=2)
def _chip_steps(x, w, steps: int):
  for _ in range(8 * steps):
    x = jnp.tanh(x @ w)
  return x


class Trainer:
  """A chip-bound training loop: steps of 8 bf16 matmuls of ``n`` x ``n``, ``steps``
  of them a dispatch (one jitted call, waited for): a loop that dispatches every step
  holds the GIL often, one that dispatches every 8 steps seldom."""

  def __init__(self, device, n: int, steps: int = 1):
    put = lambda a: jax.device_put(a.astype(jnp.bfloat16), device)
    self.x = put(jnp.ones((n, n)))
    self.w = put(jax.random.normal(jax.random.key(1), (n, n)) / n ** 0.5)
    self.steps = steps

  def __call__(self) -> None:
    self.x = _chip_steps(self.x, self.w, self.steps)
    self.x.block_until_ready()

  def idle_rate(self, seconds: float) -> float:
    """Steps per second with nothing beside the loop."""
    return rate(self, seconds=seconds, warmup=2)[0] * self.steps

  def lost_beside(self, done: Callable[[], bool], idle: float, t0: float) -> tuple[float, float]:
    """Runs the loop until ``done()``; returns (the training time lost from ``t0``: the
    window less the steps run at the idle rate, the window)."""
    n = 0
    while not done():
      self()
      n += self.steps
    window = time.perf_counter() - t0
    return window - n / idle, window


def lost_beside_d2h(train: Trainer, idle: float, work: Callable[[], None]) -> float:
  """The training time lost while ``work`` runs on a thread beside the loop."""
  thread = threading.Thread(target=work, name="bench-d2h")
  t0 = time.perf_counter()
  thread.start()
  lost, _ = train.lost_beside(lambda: not thread.is_alive(), idle, t0)
  thread.join()
  return lost


# ---- savers ------------------------------------------------------------------------


class Ours:
  """``ctl.checkpointer``; records when each save was staged."""
  name = "ctl.checkpointer"

  def __init__(self, ctl, directory: str, *, ram_steps: int = 1):
    self.ckpt = ctl.checkpointer(directory, max_to_keep=2, ram_steps=ram_steps)
    self.staged_at: dict[int, float] = {}

  def save(self, step: int, tree) -> ckpt_bench.Durable:
    handle = self.ckpt.save(step, tree)
    durable = ckpt_bench.Durable()
    handle.staged.add_done_callback(
        lambda f: self.staged_at.__setitem__(step, time.perf_counter()))
    handle.durable.add_done_callback(lambda f: durable.set(f.exception()))
    return durable

  def restore(self, step: int, target) -> Any:
    return self.ckpt.restore(step, target=target)

  def prune(self, keep: int) -> None:
    del keep  # max_to_keep does it

  def close(self) -> None:
    self.ckpt.close()


class Orbax(ckpt_bench.OrbaxSaver):
  """Orbax's async CheckpointManager, no compression (the sidecar compresses nothing)."""
  name = "Orbax"

  def __init__(self, directory: str):
    super().__init__(directory, compress=False)
    self.name = "Orbax"  # the base class names its compression

  def restore(self, step: int, target) -> Any:
    mngr = ocp.CheckpointManager(self.directory)  # as a restarted trainer restores
    try:
      return mngr.restore(step, args=ocp.args.StandardRestore(target))
    finally:
      mngr.close()


@dataclasses.dataclass(frozen=True, slots=True)
class Saved:
  step: int
  returned: float  # seconds from the call until save() returned
  staged: float | None  # ours: until handle.staged
  durable: float
  busy: float | None = None  # the loop's steps/s while the save was in flight, / idle
  lost: float | None = None  # training seconds lost from the call until durable
  loop: int | None = None  # the loop's steps per dispatch


def splits_compiled() -> None:
  """Waits for the splits that first saves started compiling (a library without them:
  nothing to wait for)."""
  wait = getattr(jax_checkpoint, "wait_for_splits", None)
  if wait is not None:
    wait()


def timed_save(saver, step: int, state, train: Trainer | None = None,
               idle_steps: float | None = None) -> Saved:
  """One save; with ``train``, the training loop runs from the call until durable."""
  t0 = time.perf_counter()
  durable = saver.save(step, state)
  returned = time.perf_counter() - t0
  busy = lost = None
  if train is not None:  # the steps the loop ran from the call on, against its idle rate
    lost, window = train.lost_beside(durable.is_set, idle_steps, t0)
    busy = 1 - lost / window
  durable.wait()
  staged = getattr(saver, "staged_at", {}).get(step)
  saver.prune(step)
  return Saved(step, returned, None if staged is None else staged - t0, durable.at - t0, busy,
               lost, None if train is None else train.steps)


# ---- the run -----------------------------------------------------------------------


@dataclasses.dataclass
class Run:
  """The state and the savers of one run, and what they measured."""
  state: dict[str, jax.Array]
  savers: list
  progress: Callable[[str], None]
  steps: itertools.count = dataclasses.field(default_factory=lambda: itertools.count(1))
  saved: dict[str, list[Saved]] = dataclasses.field(default_factory=dict)
  refs: dict[str, tuple[int, Any]] = dataclasses.field(default_factory=dict)

  def save(self, saver, **busy) -> Saved:
    self.state = jax.block_until_ready(bump(self.state))  # fresh arrays, no host copy
    step = next(self.steps)
    if not busy:  # the values of the saver's latest idle save, for its restores
      self.refs[saver.name] = (step, jax.block_until_ready(copy(self.state)))
    record = timed_save(saver, step, self.state, **busy)
    splits_compiled()  # a first save's split compiled: later ones go in pieces
    self.saved.setdefault(saver.name, []).append(record)
    self.progress(f"  {saver.name} step {step}: returned {record.returned:.3f} s, durable "
                  f"{record.durable:.3f} s" + (f", loop of {record.loop}: {record.busy:.0%} of"
                                              f" idle, {record.lost:.3f} s lost"
                                              if record.busy is not None else ""))
    return record


def timed_restores(restore: Callable[[], Any], ref, repeats: int) -> tuple[float, bool]:
  """(median seconds until the restored arrays are on the device, all bit-exact)."""
  took, exact = [], True
  for _ in range(repeats):
    t0 = time.perf_counter()
    restored = jax.block_until_ready(restore())
    took.append(time.perf_counter() - t0)
    exact = exact and bool(same_bits(restored, ref))
    del restored
  return statistics.median(took), exact


def donation_check(run: Run, saver) -> tuple[bool, str]:
  """save(), then at once jitted donating steps; whether the restore is bit-exact."""
  run.state = jax.block_until_ready(bump(run.state))
  ref, step = jax.block_until_ready(copy(run.state)), next(run.steps)
  try:
    durable = saver.save(step, run.state)
    for _ in range(DONATING_STEPS):
      run.state = bump(run.state)  # donates the arrays save() was given
    durable.wait()
    return bool(same_bits(saver.restore(step, ckpt_bench.abstract(ref)), ref)), ""
  except Exception as e:  # the row says what failed; the run goes on
    return False, f"{type(e).__name__}: {str(e)[:120]}"
  finally:
    jax.block_until_ready(run.state)


def measure(ctl, device, state, chip: ChipLimits, base: str, plan: Plan,
            progress: Callable[[str], None]) -> list[Row]:
  ours, orbax = Ours(ctl, os.path.join(base, "ours")), Orbax(os.path.join(base, "orbax"))
  store = Ours(ctl, os.path.join(base, "ours-storage"), ram_steps=0)  # restores from storage
  run = Run(state, [orbax, ours], progress)
  try:
    jax.block_until_ready((copy(state), same_bits(state, state)))  # compiled before timings
    progress("saves, the trainer idle: each saver's first of the process, then later ones; "
             "after each round a bare D2H by pieces on the main thread and on a kept one")
    dst = [np.ones(a.shape, a.dtype) for a in jax.tree.leaves(state)]  # pre-faulted
    beside: dict[str, list[float]] = {"main": [], "kept": []}
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bench-d2h") as thread:
      ways = {"main": lambda f: f(), "kept": lambda f: thread.submit(f).result()}
      for r in range(1 + plan.saves):
        for saver in run.savers[r % 2:] + run.savers[:r % 2]:
          run.save(saver)
        for name, way in ways.items():
          run.state, took = timed_d2h(run.state, dst, run=way)
          beside[name].append(took)
    del dst
    chip = dataclasses.replace(chip, main_beside_saves=tuple(beside["main"][1:]),
                               kept_beside_saves=tuple(beside["kept"][1:]))
    progress("restores onto the device")
    restores = {}
    for saver in run.savers:
      step, ref = run.refs[saver.name]
      restores[saver.name] = timed_restores(
          lambda s=saver, st=step, r=ref: s.restore(st, ckpt_bench.abstract(r)), ref, 2)
    step, ref = run.refs[ours.name]
    store.save(step, ref).wait()
    restores["storage"] = timed_restores(lambda: store.restore(step, ckpt_bench.abstract(ref)),
                                         ref, 2)
    sources = sorted(store.ckpt.last_restore_stats().shards)
    run.refs.clear()
    progress("save(), then donating steps at once")
    donation = {s.name: donation_check(run, s) for s in run.savers}
    progress("the training loops, without and with a save in flight")
    idle: dict[int, list[float]] = {}
    for steps in LOOPS:
      train = Trainer(device, plan.matmul, steps)
      for _ in range(plan.busy_saves):
        for saver in run.savers:
          idle.setdefault(steps, []).append(train.idle_rate(plan.window_s))
          run.save(saver, train=train, idle_steps=idle[steps][-1])
    sweep = piece_sweep(run, ours, Trainer(device, plan.matmul, 1), plan)
    progress("the loop of 1 step a dispatch beside a bare device-to-host of the state")
    bare = bare_d2h_lost(run.state, Trainer(device, plan.matmul, 1), plan)
  finally:
    for saver in (*run.savers, store):
      saver.close()
  return rows(run, chip, restores, sources, donation,
              {k: statistics.median(v) for k, v in idle.items()}, bare | sweep,
              plan.state_bytes / 2**30)


def piece_sweep(run: Run, ours: Ours, train: Trainer, plan: Plan) -> dict[str, float]:
  """Training time lost per save of ours, 1 step a dispatch, with each piece size of
  ``PIECE_MIB`` (median of 2 each); none where this tree's saves go in no pieces."""
  module = jax_checkpoint
  if not hasattr(module, "PIECE_BYTES"):
    return {}
  default, out = module.PIECE_BYTES, {}
  try:
    for mib in PIECE_MIB:
      module.PIECE_BYTES = mib << 20
      lost = []
      for i in range(3):  # the first goes whole while this size's split compiles: not counted
        run.state = jax.block_until_ready(bump(run.state))
        busy = {"train": train, "idle_steps": train.idle_rate(plan.window_s)} if i else {}
        record = timed_save(ours, next(run.steps), run.state, **busy)
        splits_compiled()
        if i:
          lost.append(record.lost)
      run.progress(f"  ctl.checkpointer with {mib} MiB pieces: {lost} s lost")
      out[f"ctl.checkpointer's save in {mib} MiB pieces (default {default >> 20} MiB)"] = (
          statistics.median(lost))
  finally:
    module.PIECE_BYTES = default
  return out



def bare_d2h_lost(state, train: Trainer, plan: Plan) -> dict[str, float]:
  """Training time lost while the state's device-to-host (whole; by pieces) runs on a
  thread beside the loop (median of 2 each, a fresh state each time)."""
  dst = [np.ones(a.shape, a.dtype) for a in jax.tree.leaves(state)]  # pre-faulted
  ways = {"whole arrays": d2h_whole} | {
      f"{mib} MiB pieces": functools.partial(d2h_pieces, piece_bytes=mib << 20)
      for mib in PIECE_MIB}
  out = {}
  for name, way in ways.items():
    lost = []
    for _ in range(2):
      state = jax.block_until_ready(bump(state))
      idle = train.idle_rate(plan.window_s)
      leaves = jax.tree.leaves(state)
      lost.append(lost_beside_d2h(train, idle, functools.partial(way, leaves, dst)))
    out[name] = statistics.median(lost)
  return out


def rows(run: Run, chip: ChipLimits, restores: dict[str, tuple[float, bool]],
         sources: list[str], donation: dict[str, tuple[bool, str]], idle: dict[int, float],
         bare: dict[str, float], gib: float) -> list[Row]:
  med = statistics.median
  quiet = lambda recs: [r for r in recs if r.busy is None]
  first = {n: quiet(run.saved[n])[0] for n in run.saved}
  later = {n: quiet(run.saved[n])[1:] for n in run.saved}
  ret = {n: med(r.returned for r in later[n]) for n in later}
  out = [
      Row("checkpoint", "Orbax async save(): returns, the process's first", first["Orbax"].returned,
          "s", (("of Orbax's later ones", first["Orbax"].returned / ret["Orbax"]),)),
      Row("checkpoint", f"Orbax async save(): returns, later (median of {len(later['Orbax'])})",
          ret["Orbax"], "s", (("of the chip's D2H of the state", ret["Orbax"] / chip.d2h_s),)),
      Row("checkpoint", f"Orbax: durable, trainer idle (later saves, median of "
          f"{len(later['Orbax'])})", med(r.durable for r in later["Orbax"]), "s",
          (("of the chip's D2H of the state",
            med(r.durable for r in later["Orbax"]) / chip.d2h_s),),
          note=f"the process's first: {first['Orbax'].durable:.3f} s"),
      Row("checkpoint", "Orbax restore onto the device (fresh CheckpointManager)",
          restores["Orbax"][0], "s", (("of the chip's H2D of the state",
                                       restores["Orbax"][0] / chip.h2d_s),)),
  ]
  r_first, r_later = first["ctl.checkpointer"].returned, ret["ctl.checkpointer"]
  # A process's first save compiles the split and first touches its host buffers (on the
  # v5e host: staged 2.7 s, the second 0.7 s, later ones 0.39-0.41 s): later saves are
  # what a training run pays each time, the first is a row of its own, as for save().
  staged = med(r.staged for r in later["ctl.checkpointer"])
  durable = med(r.durable for r in later["ctl.checkpointer"])
  n_later = len(later["ctl.checkpointer"])
  ram, disk = restores["ctl.checkpointer"][0], restores["storage"][0]
  out += [
      Row("checkpoint", "ctl.checkpointer save(): returns, the process's first", r_first, "s",
          (("of Orbax's first", r_first / first["Orbax"].returned),),
          "<= Orbax's first", r_first <= first["Orbax"].returned),
      Row("checkpoint", f"ctl.checkpointer save(): returns, later (median of "
          f"{len(later['ctl.checkpointer'])})", r_later, "s",
          (("of Orbax's later", r_later / ret["Orbax"]),), "<= 20 ms, <= Orbax's",
          r_later <= min(0.020, ret["Orbax"]),
          note="later saves: " + ", ".join(f"{r.returned * 1e3:.1f} ms"
                                           for r in later["ctl.checkpointer"])),
      Row("checkpoint", "ctl.checkpointer: staged, the process's first save",
          first["ctl.checkpointer"].staged, "s",
          (("of the chip's fastest D2H of the state by pieces",
            first["ctl.checkpointer"].staged / chip.fastest_d2h_s),)),
      Row("checkpoint", f"ctl.checkpointer: staged (handle.staged; later saves, median of "
          f"{n_later})", staged, "s",
          (("of the chip's fastest D2H of the state by pieces",
            staged / chip.fastest_d2h_s), ("of the chip's D2H of whole arrays",
                                           staged / chip.d2h_s)),
          "<= 1.2x fastest D2H by pieces", staged <= 1.2 * chip.fastest_d2h_s,
          note="later saves: " + ", ".join(f"{r.staged:.3f}" for r in later["ctl.checkpointer"])),
      *[Row("checkpoint", f"bare device-to-host of the state by {PIECE_MIB[0]} MiB pieces on "
            f"{where}, one after each round of those saves (median of {len(runs)})",
            med(runs), "s", (("of the chip's D2H of whole arrays", med(runs) / chip.d2h_s),),
            note="runs: " + ", ".join(f"{t:.3f}" for t in runs))
        for where, runs in (("the main thread", chip.main_beside_saves),
                            ("a kept thread", chip.kept_beside_saves)) if runs],
      Row("checkpoint", f"ctl.checkpointer: durable, trainer idle (later saves, median of "
          f"{n_later})", durable, "s",
          (("of Orbax's durable", durable / med(r.durable for r in later["Orbax"])),),
          note=f"the process's first: {first['ctl.checkpointer'].durable:.3f} s"),
      Row("checkpoint", "ctl.checkpointer restore from the RAM tier onto the device", ram, "s",
          (("of the chip's H2D of the state", ram / chip.h2d_s),
           ("speed-up over Orbax's restore", restores["Orbax"][0] / ram)),
          "<= 1.2x H2D, >= 8x Orbax",
          ram <= 1.2 * chip.h2d_s and restores["Orbax"][0] / ram >= 8),
      Row("checkpoint", "ctl.checkpointer restore from storage onto the device (ram_steps=0)",
          disk, "s", (("speed-up over Orbax's restore", restores["Orbax"][0] / disk),),
          note=f"from {', '.join(sources)}"),
      Row("checkpoint", "restores bit-exact (RAM tier, storage, Orbax)",
          all(exact for _, exact in restores.values()), "check"),
  ]
  for name in ("ctl.checkpointer", "Orbax"):
    ok, why = donation[name]
    out.append(Row("checkpoint", f"{name}: save(), at once {DONATING_STEPS} jitted steps with "
                   "donate_argnums=0, restore bit-exact", ok, "check",
                   target="bit-exact" if name == "ctl.checkpointer" else "", note=why,
                   met=ok if name == "ctl.checkpointer" else None))
  for steps, idle_rate in idle.items():
    loop = f"{steps} step{'s' if steps > 1 else ''} a dispatch"
    out.append(Row("training", f"chip-bound loop (8 bf16 matmuls a step), {loop}, no save in "
                   "flight", idle_rate, "steps/s"))
    busy = {n: [r for r in run.saved[n] if r.loop == steps] for n in ("ctl.checkpointer",
                                                                     "Orbax")}
    for name, recs in busy.items():
      out.append(Row("training", f"the same, a save in flight: {name} (median of {len(recs)}, "
                     "from save() until durable)", med(r.busy for r in recs), "%",
                     note=f"durable {med(r.durable for r in recs):.2f} s"))
    lost = {n: med(r.lost for r in recs) for n, recs in busy.items()}
    for name in busy:
      mine = name == "ctl.checkpointer"
      out.append(Row(
          "training", f"training time lost per save, {loop}: {name} (from save() until "
          "durable: (idle - rate during) / idle x time + the block; median)", lost[name], "s",
          (("of Orbax's", lost[name] / lost["Orbax"]),) if mine and lost["Orbax"] > 0 else (),
          "<= 0.1 s per GiB, <= 1/3 of Orbax's" if mine else "",
          lost[name] <= 0.1 * gib and lost[name] <= lost["Orbax"] / 3 if mine else None,
          note=f"{lost[name] / gib:.3f} s per GiB"))
  for name, lost_s in bare.items():
    what = (f"training time lost per save, 1 step a dispatch: {name} (median of 2)"
            if name.startswith("ctl.") else f"training time lost, 1 step a dispatch, beside a "
            f"bare device-to-host of the state on a thread: {name} (median of 2)")
    out.append(Row("training", what, lost_s, "s", note=f"{lost_s / gib:.3f} s per GiB"))
  return out
