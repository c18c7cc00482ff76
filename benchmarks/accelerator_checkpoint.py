"""The checkpoint part of ``benchmarks.accelerator``: Orbax's async save and restore beside
``ctl.checkpointer``'s, of one state on the device JAX picks, in the trainer process.

Every save is of fresh arrays (a donating jitted ``x + 1`` before it), as in training: a
``jax.Array`` read once keeps its host copy, and a later save of it would copy nothing.
Each restore is compared bit for bit, on the device, with a copy taken before the save.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import SingleDeviceSharding

from benchmarks import checkpoint as ckpt_bench
from benchmarks.accelerator_rows import Row
from benchmarks.common import rate

ROW_WIDTH = 4096  # float32 elements per row of a leaf: 16 KiB
DONATING_STEPS = 3  # jitted donating steps run at once after save(), as in the issue


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


def make_state(device, plan: Plan) -> dict[str, jax.Array]:
  """``plan.leaves`` float32 arrays of random normals, made on ``device``."""
  make = jax.jit(lambda k: jax.random.normal(k, plan.leaf_shape, jnp.float32),
                 out_shardings=SingleDeviceSharding(device))
  keys = jax.random.split(jax.random.key(0), plan.leaves)
  return jax.block_until_ready({f"layer{i}": make(k) for i, k in enumerate(keys)})


# The state's programs, each compiled at its first call (before any timing).
bump = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)
copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))


@jax.jit
def same_bits(a, b) -> jax.Array:
  """Whether two trees of float32 arrays are bit for bit the same (NaNs and -0.0 too)."""
  bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jnp.all(jnp.stack([jnp.all(bits(x) == bits(y))
                            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]))


@jax.jit
def _chip_step(x, w):
  for _ in range(8):
    x = jnp.tanh(x @ w)
  return x


class Trainer:
  """A chip-bound training step: 8 bf16 matmuls of ``n`` x ``n``, waited for."""

  def __init__(self, device, n: int):
    put = lambda a: jax.device_put(a.astype(jnp.bfloat16), device)
    self.x = put(jnp.ones((n, n)))
    self.w = put(jax.random.normal(jax.random.key(1), (n, n)) / n ** 0.5)

  def __call__(self) -> None:
    self.x = _chip_step(self.x, self.w)
    self.x.block_until_ready()


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


def timed_save(saver, step: int, state, train: Trainer | None = None,
               idle_steps: float | None = None) -> Saved:
  """One save; with ``train``, the training loop runs from the call until durable."""
  t0 = time.perf_counter()
  durable = saver.save(step, state)
  returned = time.perf_counter() - t0
  n = 0
  while train is not None and not durable.is_set():
    train()
    n += 1
  durable.wait()
  busy = None if train is None else n / (time.perf_counter() - t0) / idle_steps
  staged = getattr(saver, "staged_at", {}).get(step)
  saver.prune(step)
  return Saved(step, returned, None if staged is None else staged - t0, durable.at - t0, busy)


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
    self.saved.setdefault(saver.name, []).append(record)
    self.progress(f"  {saver.name} step {step}: returned {record.returned:.3f} s, durable "
                  f"{record.durable:.3f} s" + (f", loop {record.busy:.0%} of idle"
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
    progress("saves, the trainer idle: each saver's first of the process, then later ones")
    for r in range(1 + plan.saves):
      for saver in run.savers[r % 2:] + run.savers[:r % 2]:
        run.save(saver)
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
    progress("the training loop, without and with a save in flight")
    train = Trainer(device, plan.matmul)
    idle = []
    for _ in range(plan.busy_saves):
      for saver in run.savers:
        idle.append(rate(train, seconds=plan.window_s, warmup=2)[0])
        run.save(saver, train=train, idle_steps=idle[-1])
  finally:
    for saver in (*run.savers, store):
      saver.close()
  return rows(run, chip, restores, sources, donation, statistics.median(idle))


def rows(run: Run, chip: ChipLimits, restores: dict[str, tuple[float, bool]],
         sources: list[str], donation: dict[str, tuple[bool, str]], idle: float) -> list[Row]:
  med = statistics.median
  ours, orbax = run.saved[Ours.name], run.saved[Orbax.name]
  quiet = lambda recs: [r for r in recs if r.busy is None]
  first = {n: quiet(run.saved[n])[0] for n in run.saved}
  later = {n: quiet(run.saved[n])[1:] for n in run.saved}
  ret = {n: med(r.returned for r in later[n]) for n in later}
  out = [
      Row("checkpoint", "Orbax async save(): returns, the process's first", first["Orbax"].returned,
          "s", (("of Orbax's later ones", first["Orbax"].returned / ret["Orbax"]),)),
      Row("checkpoint", f"Orbax async save(): returns, later (median of {len(later['Orbax'])})",
          ret["Orbax"], "s", (("of the chip's D2H of the state", ret["Orbax"] / chip.d2h_s),)),
      Row("checkpoint", "Orbax: durable, trainer idle (median)",
          med(r.durable for r in quiet(orbax)), "s",
          (("of the chip's D2H of the state", med(r.durable for r in quiet(orbax)) / chip.d2h_s),)),
      Row("checkpoint", "Orbax restore onto the device (fresh CheckpointManager)",
          restores["Orbax"][0], "s", (("of the chip's H2D of the state",
                                       restores["Orbax"][0] / chip.h2d_s),)),
  ]
  r_first, r_later = first["ctl.checkpointer"].returned, ret["ctl.checkpointer"]
  staged = med(r.staged for r in quiet(ours))
  durable = med(r.durable for r in quiet(ours))
  ram, disk = restores["ctl.checkpointer"][0], restores["storage"][0]
  out += [
      Row("checkpoint", "ctl.checkpointer save(): returns, the process's first", r_first, "s",
          (("of Orbax's first", r_first / first["Orbax"].returned),),
          "<= Orbax's first", r_first <= first["Orbax"].returned),
      Row("checkpoint", f"ctl.checkpointer save(): returns, later (median of "
          f"{len(later['ctl.checkpointer'])})", r_later, "s",
          (("of Orbax's later", r_later / ret["Orbax"]),), "<= Orbax's", r_later <= ret["Orbax"]),
      Row("checkpoint", "ctl.checkpointer: staged (handle.staged, median)", staged, "s",
          (("of the chip's D2H of the state", staged / chip.d2h_s),), "<= 1.2x D2H",
          staged <= 1.2 * chip.d2h_s),
      Row("checkpoint", "ctl.checkpointer: durable, trainer idle (median)", durable, "s",
          (("of Orbax's durable", durable / med(r.durable for r in quiet(orbax))),)),
      Row("checkpoint", "ctl.checkpointer restore from the RAM tier onto the device", ram, "s",
          (("of the chip's H2D of the state", ram / chip.h2d_s),
           ("speed-up over Orbax's restore", restores["Orbax"][0] / ram)),
          "<= 1.3x H2D, >= 8x Orbax",
          ram <= 1.3 * chip.h2d_s and restores["Orbax"][0] / ram >= 8),
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
  out.append(Row("training", "chip-bound loop (8 bf16 matmuls a step), no save in flight",
                 idle, "steps/s"))
  for name in ("ctl.checkpointer", "Orbax"):
    busy = [r for r in run.saved[name] if r.busy is not None]
    out.append(Row("training", f"the same, a save in flight: {name} (median of {len(busy)}, "
                   "from save() until durable)", med(r.busy for r in busy), "%",
                   note=f"durable {med(r.durable for r in busy):.2f} s"))
  return out
