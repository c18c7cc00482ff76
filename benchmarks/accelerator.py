"""The project on the accelerator JAX sees, against the chip's limits, Grain and Orbax: one table.

Run from the repository root: ``python -m benchmarks.accelerator`` (a few minutes on a TPU
host), or ``--quick`` (a smaller state, shorter windows: about two minutes on a 2-core CPU
machine, where it must run too). Not run by CI. Prints one table and writes it as JSON and
markdown under ``--out`` (default ``benchmarks/results/``, ignored by git).

Everything runs in this one process, the only one that opens the chip; the sidecars are a
1-host LocalCluster's processes (JAX on the CPU). Every ratio is to a baseline measured in
the same run:

  chip        the chip's limits: host-to-device of a 32x224x224x3 uint8 batch (4.8 MB) with
              many puts in flight, the same puts each used at once by a step (8 and 16
              ahead: plain JAX's rate for a consumer like the feed's), and one put waited
              for; device-to-host of the checkpoint state (``copy_to_host_async`` on every
              array, then ``np.asarray``; and by 4, 16 and 64 MiB pieces of one jitted
              split, their transfers in order, 4 in flight, on the main thread, and by
              4 MiB pieces on one thread kept from run to run), one memcpy of it (numpy,
              one thread), host-to-device of it (a put per array, all in flight)
  grain       Grain in-process and ``mp_prefetch`` into device arrays, 'noop' and 'light'
              elements (``benchmarks/feed_fns.py``): the consumer keeps N batches in flight
              on the device (puts a batch, then uses the one N steps older), best of N in
              ``--depths``
  feed        ``ctl.feed`` of the same pipelines into device arrays, the consumer using each
              batch at once (``block_until_ready`` of a tiny reduction of it, as a training
              step would); ``FeedOptions.device_prefetch`` at its default, where it exists;
              and light elements from one feed worker (the cores 600/s would take)
  checkpoint  Orbax's async save (``PyTreeCheckpointHandler``, no compression) and restore
              beside ``ctl.checkpointer``'s of the same state
              (``benchmarks/accelerator_checkpoint.py``)
  training    chip-bound loops (jitted bf16 matmuls) that dispatch every step and every 8
              steps: steps/s with no save, and while a save is in flight (ours, Orbax's),
              from ``save()`` until durable; the training time lost per save, (idle rate -
              rate during) / idle rate x time + the block, in seconds; the same for ours
              with 4, 16 and 64 MiB pieces, and beside a bare device-to-host of the state
              (whole arrays, pieces) on a thread
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import absl.flags
import grain
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from benchmarks import accelerator_checkpoint as ckpt, accelerator_rows, feed_fns
from benchmarks.accelerator_rows import Row
from sidecar._src.arena import shm

BATCH = 32
BATCH_SHAPE = (BATCH, 224, 224, 3)
FNS = ["benchmarks.feed_fns"]
KINDS = ("noop", "light")
T0 = time.perf_counter()


def progress(msg: str) -> None:
  print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
  seconds: float  # each rate's window
  warmup_s: float  # before each window of a feed or in-process Grain
  most_warmup_s: float  # of a path with worker processes: they start, then reach their rate
  chip_depth: int  # puts in flight for the chip's pipelined rate
  depths: tuple[int, ...]  # batches Grain's consumer keeps in flight
  workers: int  # ctl.feed's and Grain mp_prefetch's worker processes
  prefetch: int
  repeats: int  # of each state transfer
  device_prefetch: tuple[int | None, ...] = (None,)  # ctl.feed's, a no-op row each
  host_half: bool = False  # a row of ctl.feed into host arrays (the layout's puts skipped)


# ---- the chip's limits -------------------------------------------------------------


def pipelined_puts(host: np.ndarray, device, *, depth: int, seconds: float) -> float:
  """Batches per second onto ``device`` with ``depth`` puts in flight."""
  in_flight, n = collections.deque(), 0
  t0 = time.perf_counter()
  while (elapsed := time.perf_counter() - t0) < seconds or n < 10:
    in_flight.append(jax.device_put(host, device))
    if len(in_flight) > depth:
      in_flight.popleft().block_until_ready()
      n += 1
  return n / elapsed


def waited_put_ms(host: np.ndarray, device, n: int = 50) -> float:
  took = []
  for _ in range(n):
    t0 = time.perf_counter()
    jax.device_put(host, device).block_until_ready()
    took.append(time.perf_counter() - t0)
  return statistics.median(took) * 1e3


def state_limits(state, device, repeats: int) -> tuple[ckpt.ChipLimits, dict]:
  """The state's device-to-host, memcpy and host-to-device times (medians); the state,
  bumped (a fresh jax.Array keeps no host copy from these reads)."""
  d2h, host = [], []
  for _ in range(repeats):
    state = jax.block_until_ready(ckpt.bump(state))
    leaves = jax.tree.leaves(state)
    t0 = time.perf_counter()
    for a in leaves:
      a.copy_to_host_async()
    host = [np.asarray(a) for a in leaves]
    d2h.append(time.perf_counter() - t0)
  dst = [np.ones_like(h) for h in host]  # pre-faulted
  memcpy, h2d = [], []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for d, h in zip(dst, host):
      np.copyto(d, h)
    memcpy.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    jax.block_until_ready([jax.device_put(d, device) for d in dst])
    h2d.append(time.perf_counter() - t0)
  med = statistics.median

  def by_pieces(mib: int, run=lambda f: f(), *, into: list[np.ndarray] = dst, drop: int = 1,
                times: int = repeats, how=ckpt.d2h_pieces) -> list[float]:
    """Each timed D2H by ``mib`` pieces into the pre-faulted host arrays ``into``, each
    made by ``run`` with ``how``; the first ``drop`` runs not timed (they compile the
    split, or warm a thread's malloc arena)."""
    nonlocal state
    took = []
    for _ in range(drop + times):
      state, seconds = ckpt.timed_d2h(state, into, run=run, how=how, piece_bytes=mib << 20)
      took.append(seconds)
    return took[drop:]

  pieces = {mib: med(by_pieces(mib)) for mib in ckpt.PIECE_MIB}
  arena = shm.Arena.create(sum(d.nbytes for d in dst), name="bench-d2h")
  blocks, at = [], 0  # the memory a save's blocks lie in: a memfd, reserved and mapped
  try:
    for d in dst:
      blocks.append(arena.view(at, d.nbytes).view(d.dtype).reshape(d.shape))
      at += d.nbytes
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bench-d2h") as thread:
      on_thread = lambda f: thread.submit(f).result()
      # On the lent v5e a thread's runs reach their pace from the second or third (its
      # arena's pages warm); five after three dropped, as a save's stager thread is timed.
      mib = ckpt.PIECE_MIB[0]
      kept = by_pieces(mib, on_thread, drop=3, times=5)
      into_arena = by_pieces(mib, on_thread, into=blocks, drop=1, times=5)
      library = by_pieces(mib, on_thread, into=blocks, drop=1, times=5, how=ckpt.d2h_library)
  finally:
    del blocks
    arena.close()
  limits = ckpt.ChipLimits(d2h_s=med(d2h), h2d_s=med(h2d), memcpy_s=med(memcpy),
                           d2h_pieces_s=pieces, kept_thread=tuple(kept),
                           kept_thread_arena=tuple(into_arena), library=tuple(library))
  return limits, jax.block_until_ready(ckpt.bump(state))


def used_at_once(host: np.ndarray, device, s: Settings) -> dict[int, float]:
  """Plain JAX's batches/s by ``jax.device_put`` of a numpy batch (image and label), each
  used at once as the feed's are, with 8 and 16 puts ahead: what JAX itself gives a
  consumer of batches from host memory (the feed's ceiling)."""
  batch = {"image": host, "label": np.zeros(BATCH, np.int32)}
  in_flight_rate(itertools.repeat(batch), device, depth=8, seconds=0.3)  # compiles use
  return {d: in_flight_rate(itertools.repeat(batch), device, depth=d, seconds=s.seconds)
          for d in (8, 16)}


def chip_rows(device, state, s: Settings
              ) -> tuple[list[Row], float, float, ckpt.ChipLimits, dict]:
  host = np.random.default_rng(0).integers(0, 256, BATCH_SHAPE, dtype=np.uint8)
  mb = host.nbytes / 1e6
  pipelined_puts(host, device, depth=s.chip_depth, seconds=0.3)  # warm-up
  chip_rate = pipelined_puts(host, device, depth=s.chip_depth, seconds=s.seconds)
  used = used_at_once(host, device, s)
  put_ms = waited_put_ms(host, device)
  limits, state = state_limits(state, device, s.repeats)
  nbytes = sum(a.nbytes for a in jax.tree.leaves(state))
  gbs = lambda sec: f"{nbytes / sec / 1e9:.1f} GB/s"
  med = statistics.median
  runs = lambda secs: ", ".join(f"{t:.3f}" for t in secs)
  rows = [
      Row("chip", f"host-to-device, {mb:.1f} MB batch, {s.chip_depth} puts in flight", chip_rate,
          "batches/s", note=f"{chip_rate * host.nbytes / 1e9:.1f} GB/s"),
      Row("chip", "plain JAX: jax.device_put of each numpy batch, each used at once (as the "
          "feed's consumer does), 8 / 16 puts ahead", max(used.values()), "batches/s",
          (("of the chip's pipelined H2D", max(used.values()) / chip_rate),),
          note=" / ".join(f"{r:,.0f}" for r in used.values())),
      Row("chip", "host-to-device, one batch put and waited for", put_ms, "ms",
          (("of a pipelined batch's time", put_ms / 1e3 * chip_rate),)),
      Row("chip", "memcpy of the state, numpy, one thread", limits.memcpy_s, "s",
          note=gbs(limits.memcpy_s)),
      Row("chip", f"device-to-host of the state ({len(jax.tree.leaves(state))} arrays: "
          "copy_to_host_async on all, then np.asarray)", limits.d2h_s, "s",
          (("of the memcpy", limits.d2h_s / limits.memcpy_s),), note=gbs(limits.d2h_s)),
      *[Row("chip", f"device-to-host of the state by {mib} MiB pieces (one jitted split, "
            f"transfers in order, {ckpt.PIECES_IN_FLIGHT} in flight, each into its rows of a "
            "host array)", sec, "s", (("of whole arrays' D2H", sec / limits.d2h_s),),
            note=gbs(sec)) for mib, sec in limits.d2h_pieces_s.items()],
      Row("chip", f"the same by {ckpt.PIECE_MIB[0]} MiB pieces on one thread kept from run to "
          "run, not the main thread (median of 5 after 3 dropped)", med(limits.kept_thread),
          "s", (("of whole arrays' D2H", med(limits.kept_thread) / limits.d2h_s),),
          note=f"{gbs(med(limits.kept_thread))}; runs: {runs(limits.kept_thread)}"),
      Row("chip", "the same on that thread into a memfd arena like a sidecar's (reserved, "
          "mapped populated), as a save's blocks (median of 5)", med(limits.kept_thread_arena),
          "s", (("of whole arrays' D2H", med(limits.kept_thread_arena) / limits.d2h_s),),
          note=f"{gbs(med(limits.kept_thread_arena))}; runs: {runs(limits.kept_thread_arena)}"),
      Row("chip", "the library's own D2H of a save (its split and pieces, as its stager copies "
          "them) into that arena on that thread, no sidecar (median of 5)",
          med(limits.library), "s",
          (("of the same by bare pieces", med(limits.library) / med(limits.kept_thread_arena)),),
          note=f"{gbs(med(limits.library))}; runs: {runs(limits.library)}"),
      Row("chip", "host-to-device of the state (a put per array, all in flight)", limits.h2d_s,
          "s", (("of the memcpy", limits.h2d_s / limits.memcpy_s),), note=gbs(limits.h2d_s)),
  ]
  return rows, chip_rate, max(used.values()), limits, state


# ---- feeds -------------------------------------------------------------------------


@jax.jit
def use(batch):
  """A training step's first touch of a batch: a tiny reduction, which waits for it."""
  return batch["image"][:, 0, 0, 0].astype(jnp.int32).sum() + batch["label"].sum()


def in_flight_rate(iterator, device, *, depth: int, seconds: float) -> float:
  """Batches/s when the consumer puts each batch on ``device`` and uses the one
  ``depth`` steps older."""
  waiting, n = collections.deque(), 0
  t0 = time.perf_counter()
  while (elapsed := time.perf_counter() - t0) < seconds or n < 3:
    waiting.append(jax.device_put(next(iterator), device))
    if len(waiting) > depth:
      use(waiting.popleft()).block_until_ready()
      n += 1
  return n / elapsed


def warm_up(measure: Callable[[float], float], *, least_s: float, most_s: float) -> None:
  """Calls ``measure(seconds)`` (a rate over a window of that length) until the rate stops
  rising (by 10%) after ``least_s``, or ``most_s`` passed: worker processes start, then
  reach their rate (Grain's mp_prefetch takes ~8 s on 2 cores)."""
  t0, last = time.perf_counter(), 0.0
  while (elapsed := time.perf_counter() - t0) < most_s:
    rate = measure(1.0)
    if elapsed >= least_s and rate <= 1.1 * last:
      return
    last = rate


@contextlib.contextmanager
def children_on_cpu():
  """Processes started meanwhile run JAX on the CPU: only one process may open the chip
  (this one has, and its own platform was fixed when it imported JAX)."""
  old = os.environ.get("JAX_PLATFORMS")
  os.environ["JAX_PLATFORMS"] = "cpu"
  try:
    yield
  finally:
    if old is None:
      os.environ.pop("JAX_PLATFORMS")
    else:
      os.environ["JAX_PLATFORMS"] = old


def grain_best(kind: str, device, s: Settings, *, workers: int = 0) -> tuple[float, int]:
  """Grain's best batches/s over ``s.depths``, and its depth; ``workers``: mp_prefetch."""
  ds = feed_fns.dataset(kind).repeat().batch(BATCH).to_iter_dataset()
  if workers:
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
  with children_on_cpu():
    it = iter(ds)
    try:
      warm_up(lambda sec: in_flight_rate(it, device, depth=max(s.depths), seconds=sec),
              least_s=s.warmup_s, most_s=s.most_warmup_s if workers else s.warmup_s)
      rates = {d: in_flight_rate(it, device, depth=d, seconds=s.seconds) for d in s.depths}
    finally:
      if hasattr(it, "close"):
        it.close()
  best = max(rates, key=rates.get)
  return rates[best], best


def feed_options(s: Settings, device_prefetch: int | None = None
                 ) -> tuple[sidecar.FeedOptions, str]:
  """The feed's options, and how the table names them."""
  options = sidecar.FeedOptions(workers=s.workers, prefetch=s.prefetch,
                                device_prefetch=device_prefetch)
  label = (f"workers={s.workers}, prefetch={s.prefetch}, device_prefetch="
           + ("None (its default)" if device_prefetch is None else str(device_prefetch)))
  return options, label


def feed_rate(ctl, kind: str, device, s: Settings, device_prefetch: int | None = None, *,
              host_only: bool = False) -> tuple[float, float]:
  """ctl.feed's batches/s with each batch used at once, and the mean wait ms in next();
  ``host_only``: the layout hands the arena views over as they are (no put, no use)."""
  sharding = NamedSharding(Mesh(np.array([device]), ("data",)), P("data"))
  with ctl.feed("bench_images", kwargs={"kind": kind}, global_batch_size=BATCH,
                sharding=sharding, options=feed_options(s, device_prefetch)[0]) as feed:
    step = use
    if host_only:  # the host half alone: what the feed costs before any transfer
      feed._layout.assemble = lambda blocks, hosts: blocks[0][0]
      done = jax.numpy.zeros(())
      step = lambda batch: done

    def measure(seconds: float) -> tuple[float, float]:
      n, waited, t0 = 0, 0.0, time.perf_counter()
      while (elapsed := time.perf_counter() - t0) < seconds or n < 3:
        w = time.perf_counter()
        batch = next(feed)
        waited += time.perf_counter() - w
        step(batch).block_until_ready()
        n += 1
      return n / elapsed, waited / n * 1e3

    step(next(feed)).block_until_ready()  # its workers are up
    warm_up(lambda sec: measure(sec)[0], least_s=s.warmup_s, most_s=s.most_warmup_s)
    return measure(s.seconds)


def failed(section: str, what: str, e: BaseException) -> Row:
  """A row for a measurement that raised: the run goes on, the table says what failed."""
  traceback.print_exc()
  return Row(section, what, None, "", note=f"{type(e).__name__}: {str(e)[:200]}")


def grain_rows(device, s: Settings, chip_rate: float) -> tuple[list[Row], dict[str, float]]:
  rows, best = [], {}
  for workers in (0, s.workers):
    for kind in KINDS:
      name = f"mp_prefetch({workers} workers)" if workers else "in-process"
      what = f"Grain {name}, {kind} elements, into device arrays"
      progress(what)
      try:
        per_s, depth = grain_best(kind, device, s, workers=workers)
      except Exception as e:
        rows.append(failed("grain", what, e))
        continue
      best[kind] = max(best.get(kind, 0.0), per_s)
      rows.append(Row("grain", what, per_s, "batches/s",
                      (("of the chip's pipelined H2D", per_s / chip_rate),),
                      note=f"best of {'/'.join(map(str, s.depths))} in flight: {depth}"))
  return rows, best


FEED_TARGETS = {"noop": (2000, 0.8, 0.0), "light": (600, 0.0, 0.0)}  # issue 44 target 3


def feed_rows(ctl, device, s: Settings, chip_rate: float, plain_rate: float,
              grain: dict[str, float]) -> list[Row]:
  rows = []
  if s.host_half:
    what = (f"ctl.feed, noop elements, {feed_options(s, 0)[1]}, into host arrays (the "
            "layout's puts skipped): the host half alone")
    progress(what)
    try:
      per_s, wait_ms = feed_rate(ctl, "noop", device, s, 0, host_only=True)
      rows.append(Row("feed", what, per_s, "batches/s",
                      (("of the chip's pipelined H2D", per_s / chip_rate),),
                      note=f"next() takes {wait_ms:.2f} ms a step"))
    except Exception as e:
      rows.append(failed("feed", what, e))
  for kind, depth in [(k, d) for k in KINDS
                      for d in (s.device_prefetch if k == "noop" else s.device_prefetch[:1])]:
    what = f"ctl.feed, {kind} elements, {feed_options(s, depth)[1]}, each batch used at once"
    progress(what)
    try:
      per_s, wait_ms = feed_rate(ctl, kind, device, s, depth)
    except Exception as e:
      rows.append(failed("feed", what, e))
      continue
    least, of_chip, of_grain = FEED_TARGETS[kind]
    target = ", ".join([f">= {least:,}/s"] + ([f">= {of_chip:.0%} of chip"] if of_chip else [])
                       + ([f">= {of_grain:g}x Grain"] if of_grain else []))
    vs = [("of the chip's pipelined H2D", per_s / chip_rate)]
    if kind == "noop":
      vs.append(("of plain JAX's puts used at once", per_s / plain_rate))
    met: bool | None = per_s >= least and per_s >= of_chip * chip_rate
    if kind in grain:
      vs.append(("of Grain's best", per_s / grain[kind]))
      met = met and per_s >= of_grain * grain[kind]
    elif of_grain:
      met = None  # Grain failed: the target cannot be judged
    rows.append(Row("feed", what, per_s, "batches/s", tuple(vs), target, met,
                    note=f"next() waits {wait_ms:.2f} ms a step"))
  if s.workers > 1:  # what one feed worker's core gives: the light target's measure
    solo = dataclasses.replace(s, workers=1)
    what = f"ctl.feed, light elements, {feed_options(solo)[1]}: one feed worker's rate"
    progress(what)
    try:
      per_s, wait_ms = feed_rate(ctl, "light", device, solo)
      least = FEED_TARGETS["light"][0]
      rows.append(Row("feed", what, per_s, "batches/s",
                      note=f"{least:,}/s takes {least / per_s:.1f} workers at this rate, "
                      f"each a core of its own (the host has {os.cpu_count()})"))
    except Exception as e:
      rows.append(failed("feed", what, e))
  return rows


# ---- main --------------------------------------------------------------------------


def settings(args, quick: bool) -> tuple[Settings, ckpt.Plan]:
  s = Settings(seconds=args.seconds or (1.5 if quick else 3.0), warmup_s=1.0 if quick else 2.0,
               most_warmup_s=12.0 if quick else 20.0, chip_depth=16, depths=tuple(args.depths),
               workers=args.workers, prefetch=args.prefetch, repeats=3,
               device_prefetch=tuple(args.device_prefetch), host_half=args.host_half)
  state_mib = args.state_mib or (64 if quick else 1024)
  on_cpu = jax.devices()[0].platform == "cpu"
  plan = ckpt.Plan(leaves=args.leaves, state_bytes=state_mib << 20, saves=2 if quick else 5,
                   busy_saves=1 if quick else 3, window_s=0.5 if quick else 1.0,
                   matmul=args.matmul or (256 if on_cpu else 4096))
  return s, plan


def parse(argv=None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true",
                  help="a 64 MiB state and short windows (a check that it runs, on a CPU)")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"),
                  help="the folder the table goes to, as JSON and markdown")
  ap.add_argument("--workers", type=int, default=8 if (os.cpu_count() or 1) >= 12 else 2,
                  help="ctl.feed's and Grain mp_prefetch's worker processes")
  ap.add_argument("--prefetch", type=int, default=4, help="ctl.feed's FeedOptions.prefetch")
  ap.add_argument("--device-prefetch", type=int, nargs="+", default=[None],
                  help="ctl.feed's FeedOptions.device_prefetch: a no-op row for each (the "
                       "light row takes the first); default: the framework's choice")
  ap.add_argument("--host-half", action="store_true",
                  help="add a row of ctl.feed into host arrays, the layout's puts skipped "
                       "(what the feed's host side gives alone)")
  ap.add_argument("--depths", type=int, nargs="+", default=[2, 8],
                  help="batches Grain's consumer keeps in flight on the device (best is kept)")
  ap.add_argument("--seconds", type=float, default=None, help="each rate's window")
  ap.add_argument("--state-mib", type=int, default=None,
                  help="the checkpoint state (default 1024, 64 with --quick)")
  ap.add_argument("--leaves", type=int, default=8, help="arrays in the state")
  ap.add_argument("--matmul", type=int, default=None,
                  help="the training loop's matrices (default 4096 on an accelerator, 256 on CPU)")
  ap.add_argument("--dir", default=None, help="where the temp dir of checkpoints goes")
  ap.add_argument("--skip", nargs="+", default=[], choices=["grain", "feed", "checkpoint"],
                  help="parts left out (the feed's Grain ratios then stay empty)")
  return ap.parse_args(argv)


def main(argv=None) -> None:
  args = parse(argv)
  absl.flags.FLAGS.mark_as_parsed()  # Grain's multiprocessing reads absl flags
  device = jax.devices()[0]
  s, plan = settings(args, args.quick)
  leaves, shape = plan.leaves, plan.leaf_shape
  meta = {"platform": device.platform, "device": device.device_kind, "cores": os.cpu_count(),
          "date": time.strftime("%Y-%m-%d %H:%M"), "argv": " ".join(sys.argv[1:]),
          "jax": jax.__version__, "batch": "x".join(map(str, BATCH_SHAPE)) + " uint8",
          "state": f"{leaves} x {shape[0] * shape[1] * 4 >> 20} MiB float32"}
  out = accelerator_rows.Output(args.out, meta, judge=device.platform != "cpu",
                                started=T0)
  base = tempfile.mkdtemp(prefix="sidecar-accel-bench-", dir=args.dir)
  shm_size = max(4 * plan.state_bytes + (256 << 20), 512 << 20)  # 2 saves in flight, restores
  progress(f"{device.device_kind} ({device.platform}); checkpoints under {base}; the table "
           f"goes to {out.paths[1]} as each part ends")
  rows: list[Row] = []
  try:
    progress("the chip's limits")
    state = ckpt.make_state(device, plan)
    more, chip_rate, plain_rate, limits, state = chip_rows(device, state, s)
    out.write(rows := rows + more)
    grain_best_rates: dict[str, float] = {}
    if "grain" not in args.skip:
      more, grain_best_rates = grain_rows(device, s, chip_rate)
      out.write(rows := rows + more)
    progress(f"a 1-host LocalCluster, arena {shm_size >> 20} MiB")
    try:
      with sidecar.testing.LocalCluster(
          num_hosts=1, devices_per_host=1, shm_size=shm_size, imports=FNS,
          checkpoint_roots=[base], start_timeout=180) as cluster, cluster.controller() as ctl:
        if "feed" not in args.skip:
          out.write(rows := rows + feed_rows(ctl, device, s, chip_rate, plain_rate,
                                             grain_best_rates))
        if "checkpoint" not in args.skip:
          try:
            more = ckpt.measure(ctl, device, state, limits, base, plan, progress)
          except Exception as e:
            more = [failed("checkpoint", "the checkpoint part", e)]
          out.write(rows := rows + more)
    except Exception as e:  # the cluster did not start, or did not stop
      out.write(rows := rows + [failed("sidecar", "LocalCluster(num_hosts=1)", e)])
  finally:
    shutil.rmtree(base, ignore_errors=True)
  out.write(rows)
  print(accelerator_rows.headline(meta) + "\n")
  print(accelerator_rows.render(out.judged(rows)))
  print(f"\nwritten: {', '.join(out.paths)}")


if __name__ == "__main__":
  main()
