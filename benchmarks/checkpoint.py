"""Checkpointing a 1 GiB state: ``ctl.checkpointer`` against Orbax's async CheckpointManager.

Run from the repository root: ``python -m benchmarks.checkpoint``. Not run by CI.

The state is 8 x 128 MiB float32 jax.Arrays on the CPU backend. Three savers, in one
run, interleaved round by round (each round rotates their order):
  sidecar                ``ctl.checkpointer(dir, ram_steps=1)`` on a 1-host LocalCluster:
                         the trainer copies the state into the sidecar's arena, the
                         sidecar writes it
  Orbax, zstd            ``ocp.CheckpointManager`` with ``StandardSave`` (its default:
                         zstd level 1), async, in the trainer process
  Orbax, no compression  the same with ``PyTreeCheckpointHandler(use_compression=False)``
                         (StandardCheckpointHandler has no such option); still OCDBT,
                         where the sidecar writes a file per chunk, with O_DIRECT
Per saver and save (distinct steps, after warm-up saves):
  blocked     how long ``save`` takes to return (the trainer's stall)
  durable     from the ``save`` call until committed on disk (ours: ``handle.durable``;
              Orbax: ``wait_until_finished()`` returns), with the trainer idle, and with
              it running the training loop
  steps/s     a jitted step (4 x 512x512 matmul + tanh) run on the trainer's thread from
              ``save``'s return until durable, against the same loop just before with
              no save in flight (1.5 s); a control row runs the loop 0.5 s more, still
              without a save, to show how far the measure moves on its own; cells give
              the median (min-max)
Ratios pair each save with its own round's memcpy, raw write or idle loop: this
machine's disk and CPU speed drift a lot within a run.
Restores (``block_until_ready`` included): ours from the RAM tier and from disk through a
fresh LocalCluster, Orbax with ``mngr.restore(step, args=StandardRestore(abstract))``;
disk reads with the page cache of the step's files dropped (``POSIX_FADV_DONTNEED``,
"cold") and as left by the previous read ("warm"; the sidecar reads its chunk files
with ``O_DIRECT``, past the page cache, so both are cold for it).
On the CPU backend Orbax's save copies nothing before it returns: its "device to host"
transfer is ``np.asarray`` of a CPU jax.Array, a view, so it writes from the live arrays
(on an accelerator it would wait for a 1 GiB transfer). The sidecar, another process,
needs the one copy into its arena.
The sidecar's save is split into phases (its write time from its log); its restore
from disk is also timed inside the sidecar (``benchmarks.checkpoint_fns.read_phases``).
References: one ``np.copyto`` of the 8 arrays into pre-faulted buffers, on one thread (the
sidecar's save copies with ``shm.COPY_THREADS``); a raw write and
fsync of the same bytes into 8 files, and a read of them back; the same bytes written
with ``O_DIRECT`` as the sidecar writes its chunk files (4 at once, no crc32c, no
arena, no commit): the disk's own time for them, which "durable" cannot beat.
Checkpoints go to a temp dir under ``--dir`` (default: the system temp dir, which must
not be a tmpfs) and are removed afterwards.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import mmap
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

import sidecar
from benchmarks.common import rate, table
from sidecar._src.arena import shm
from sidecar._src.ckptfmt import direct_io

LEAVES, LEAF_SHAPE = 8, (8192, 4096)  # 8 x 128 MiB float32 = 1 GiB
FNS = ["benchmarks.checkpoint_fns"]
# The issues' targets (issue 22 item 5: blocked <= 1.1x one memcpy of the same bytes).
TARGET_DURABLE_S, TARGET_STEPS, TARGET_RESTORE_X, TARGET_BLOCKED_X = 0.7, 0.85, 10.0, 1.1
CONTROL_S = 0.5  # about a save's time to durable with the trainer busy


def progress(msg: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_state(device) -> dict[str, jax.Array]:
  keys = jax.random.split(jax.random.key(0), LEAVES)
  state = {f"layer{i}": jax.device_put(jax.random.normal(k, LEAF_SHAPE, jnp.float32), device)
           for i, k in enumerate(keys)}
  return jax.block_until_ready(state)


def abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def check_restored(restored, state, what: str) -> None:
  for name in ("layer0", f"layer{LEAVES - 1}"):
    if not np.array_equal(np.asarray(restored[name]), np.asarray(state[name])):
      raise AssertionError(f"{what}: {name} differs from the saved state")


@jax.jit
def _train_step(x, w):
  for _ in range(4):
    x = jnp.tanh(x @ w) * 0.5
  return x


class Trainer:
  """A small CPU-heavy jitted step, run on the calling (trainer's) thread."""

  def __init__(self, device):
    self.x = jax.device_put(jnp.ones((512, 512), jnp.float32), device)
    self.w = jax.device_put(jax.random.normal(jax.random.key(1), (512, 512)) / 23, device)

  def __call__(self) -> None:
    self.x = _train_step(self.x, self.w)
    self.x.block_until_ready()


# ---- savers ----------------------------------------------------------------------


class Durable:
  """Set, with the time, when a save is durable; ``wait`` re-raises the save's error."""

  def __init__(self):
    self._event = threading.Event()
    self.at, self.error = 0.0, None

  def set(self, error: BaseException | None = None) -> None:
    self.at, self.error = time.perf_counter(), error
    self._event.set()

  def is_set(self) -> bool:
    return self._event.is_set()

  def wait(self) -> None:
    self._event.wait()
    if self.error is not None:
      raise self.error


class SidecarSaver:
  name = "sidecar ctl.checkpointer"

  def __init__(self, ctl, directory: str):
    self.directory = directory
    self.ckpt = ctl.checkpointer(directory, ram_steps=1)
    self.staged_at: dict[int, float] = {}

  def save(self, step: int, tree) -> Durable:
    handle = self.ckpt.save(step, tree)
    durable = Durable()
    handle.staged.add_done_callback(
        lambda f: self.staged_at.__setitem__(step, time.perf_counter()))
    handle.durable.add_done_callback(lambda f: durable.set(f.exception()))
    return durable

  def prune(self, keep: int) -> None:
    """Deletes the steps before ``keep`` (the RAM tier keeps only the latest anyway)."""
    for name in os.listdir(self.directory):
      if name.isdigit() and int(name) < keep:
        shutil.rmtree(os.path.join(self.directory, name))

  def close(self) -> None:
    self.ckpt.close()


class OrbaxSaver:
  """Orbax's async CheckpointManager in this process, with or without zstd."""

  def __init__(self, directory: str, *, compress: bool):
    self.directory = directory
    self.name = "Orbax async, zstd (default)" if compress else "Orbax async, no compression"
    if compress:
      self.mngr = ocp.CheckpointManager(directory)
      self._args = ocp.args.StandardSave
    else:
      registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
      registry.add(None, ocp.args.PyTreeSave, ocp.PyTreeCheckpointHandler(use_compression=False))
      self.mngr = ocp.CheckpointManager(directory, handler_registry=registry)
      self._args = ocp.args.PyTreeSave

  def save(self, step: int, tree) -> Durable:
    self.mngr.save(step, args=self._args(tree))
    durable = Durable()

    def wait():
      try:
        self.mngr.wait_until_finished()
      except BaseException as e:
        durable.set(e)
      else:
        durable.set()

    threading.Thread(target=wait, daemon=True, name=f"bench-orbax-wait-{step}").start()
    return durable

  def prune(self, keep: int) -> None:
    """Deletes the steps before ``keep``."""
    for step in self.mngr.all_steps():
      if step < keep:
        self.mngr.delete(step)

  def close(self) -> None:
    self.mngr.close()


@dataclasses.dataclass(frozen=True, slots=True)
class SaveRecord:
  step: int
  round: int
  called: float
  blocked: float
  durable: float
  steps_per_s: float | None = None  # the loop's rate while the save persisted
  idle_steps_per_s: float | None = None  # the same loop just before, no save in flight
  # Then the loop again for about a save's time, still no save: the measure's own noise.
  control_steps_per_s: float | None = None


def timed_save(saver, step: int, state, round_: int = -1, train: Trainer | None = None,
               idle_seconds: float = 0.0) -> SaveRecord:
  idle = rate(train, seconds=idle_seconds, warmup=1)[0] if train else None
  control = rate(train, seconds=CONTROL_S, warmup=0)[0] if train else None
  t0 = time.perf_counter()
  durable = saver.save(step, state)
  t1 = time.perf_counter()
  steps_per_s = None
  if train is not None:
    n = 0
    while not durable.is_set():
      train()
      n += 1
    steps_per_s = n / (time.perf_counter() - t1)
  durable.wait()
  saver.prune(step)  # outside the timings: the disk need hold only the last step of each
  record = SaveRecord(step, round_, t0, t1 - t0, durable.at - t0, steps_per_s, idle, control)
  busy = "" if train is None else f", {steps_per_s:.1f} steps/s (no save: {idle:.1f})"
  progress(f"  {saver.name} step {step}: blocked {record.blocked:.3f} s, durable "
           f"{record.durable:.3f} s{busy}")
  return record


# ---- references ------------------------------------------------------------------


def memcpy_seconds(state, repeats: int = 3) -> float:
  src = [np.asarray(a) for a in state.values()]
  dst = [np.ones_like(a) for a in src]  # pre-faulted
  out = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for d, s in zip(dst, src):
      np.copyto(d, s)
    out.append(time.perf_counter() - t0)
  return statistics.median(out)


def raw_write_seconds(state, directory: str) -> float:
  os.makedirs(directory, exist_ok=True)
  t0 = time.perf_counter()
  for name, a in state.items():
    with open(os.path.join(directory, name), "wb") as f:
      f.write(memoryview(np.asarray(a)).cast("B"))
      f.flush()
      os.fsync(f.fileno())
  return time.perf_counter() - t0


def page_aligned(state) -> list[np.ndarray]:
  """Copies of the arrays in page-aligned memory, as arena blocks are (XLA's CPU
  buffers are 64-byte aligned: O_DIRECT refuses them)."""
  out = []
  for a in state.values():
    a = np.asarray(a)
    copy = np.frombuffer(mmap.mmap(-1, a.nbytes), a.dtype).reshape(a.shape)
    np.copyto(copy, a)
    out.append(copy)
  return out


def direct_write_seconds(arrays: list[np.ndarray], directory: str) -> float:
  """Page-aligned arrays into a file each with O_DIRECT, 4 at once, as the sidecar
  writes its chunks."""
  os.makedirs(directory, exist_ok=True)
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    direct = list(pool.map(lambda i: direct_io.write_file(
        os.path.join(directory, f"direct{i}"), arrays[i]), range(len(arrays))))
  seconds = time.perf_counter() - t0
  if sum(direct) != sum(a.nbytes for a in arrays):
    raise SystemExit(f"{directory}: this file system refused O_DIRECT; pass --dir on a disk")
  return seconds


def raw_write_busy(state, directory: str, train: Trainer, idle_seconds: float
                   ) -> tuple[float, float, float]:
  """A raw write+fsync in a thread while the loop runs: (seconds, steps/s, steps/s idle)."""
  idle = rate(train, seconds=idle_seconds, warmup=1)[0]
  took = []
  writer = threading.Thread(target=lambda: took.append(raw_write_seconds(state, directory)),
                            name="bench-raw-write")
  t0, n = time.perf_counter(), 0
  writer.start()
  while writer.is_alive():
    train()
    n += 1
  writer.join()
  return took[0], n / (time.perf_counter() - t0), idle


def raw_read_seconds(state, directory: str, dst: list[np.ndarray]) -> float:
  t0 = time.perf_counter()
  for name, d in zip(state, dst):
    with open(os.path.join(directory, name), "rb") as f:
      f.readinto(memoryview(d).cast("B"))
  return time.perf_counter() - t0


def drop_page_cache(path: str) -> None:
  """Drops this machine's cached pages of every file under ``path`` (they are clean)."""
  for root, _, files in os.walk(path):
    for name in files:
      fd = os.open(os.path.join(root, name), os.O_RDONLY)
      try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)


def filesystem_type(path: str) -> str:
  path, best = os.path.realpath(path), ("", "")
  with open("/proc/mounts") as f:
    for line in f:
      mount, fstype = line.split()[1:3]
      inside = path == mount or path.startswith(mount.rstrip("/") + "/")
      if inside and len(mount) > len(best[0]):
        best = (mount, fstype)
  return best[1]


def sidecar_read_phases(ctl, directory: str, step: int, names: list[str]
                        ) -> dict[str, dict[str, float]]:
  out = {}
  for mode in ("cold", "warm"):
    if mode == "cold":
      drop_page_cache(directory)
    out[mode] = ctl.call("read_phases", args=(directory, step, names, list(LEAF_SHAPE)),
                         hosts=[0])[0]
  return out


def write_phases(log: str) -> dict[int, float]:
  """step -> seconds the sidecar spent writing (and fsyncing) it, from its log."""
  return {int(m[1]): float(m[2]) for m in re.finditer(r"step (\d+): wrote .*? in ([\d.]+) s", log)}


# ---- runs --------------------------------------------------------------------------


def run_saves(savers, state, train: Trainer, raw_dir: str, *, rounds: int, busy_saves: int,
              idle_seconds: float
              ) -> tuple[dict[str, list[SaveRecord]], list[float], list[float], list[float],
                         list[tuple]]:
  """Warm-up saves, then per round: a memcpy, each saver and an O_DIRECT write with the
  trainer idle, a raw write, each saver ``busy_saves`` times with the training loop
  running, a raw write with it running. Returns the records by saver, and the memcpy,
  raw write, O_DIRECT write and busy raw write results by round (ratios pair each save
  with its round's)."""
  steps = iter(range(1, 1 << 30))
  progress("warm-up saves")
  for saver in savers:  # the sidecar twice: with ram_steps=1 it alternates arena halves
    for _ in range(2 if isinstance(saver, SidecarSaver) else 1):
      timed_save(saver, next(steps), state)
  records, memcpy, raw, direct, raw_busy = {s.name: [] for s in savers}, [], [], [], []
  aligned = page_aligned(state)
  for r in range(rounds):
    progress(f"round {r + 1} of {rounds}")
    order = savers[r % len(savers):] + savers[:r % len(savers)]
    memcpy.append(memcpy_seconds(state))
    # The O_DIRECT write takes its turn among the savers: this disk is slower for a
    # while after a large write (its host still flushes), so the order matters.
    idle_order = [None, *savers]
    for saver in idle_order[r % len(idle_order):] + idle_order[:r % len(idle_order)]:
      if saver is None:
        direct.append(direct_write_seconds(aligned, raw_dir))
        progress(f"  O_DIRECT write: {direct[-1]:.3f} s")
      else:
        records[saver.name].append(timed_save(saver, next(steps), state, r))
    raw.append(raw_write_seconds(state, raw_dir))
    progress(f"  raw write+fsync: {raw[-1]:.3f} s; memcpy {memcpy[-1]:.3f} s")
    for saver in order:
      for _ in range(busy_saves):
        records[saver.name].append(
            timed_save(saver, next(steps), state, r, train, idle_seconds))
    raw_busy.append(raw_write_busy(state, raw_dir, train, idle_seconds))
    progress(f"  raw write+fsync, trainer busy: {raw_busy[-1][0]:.3f} s, "
             f"{raw_busy[-1][1]:.1f} steps/s (no save: {raw_busy[-1][2]:.1f})")
  return records, memcpy, raw, direct, raw_busy


def blocked_phases(ctl, state, repeats: int = 3) -> dict[str, float]:
  """The pieces of ``save()``'s stall, timed one by one as it does them (medians)."""
  worker, src = ctl.worker(0), [np.asarray(a) for a in state.values()]
  private = [np.ones_like(a) for a in src]  # pre-faulted
  used = lambda: ctl.status()[0].arena_used
  baseline, out = used(), {"alloc": [], "copy": [], "memcpy": []}
  for _ in range(repeats):
    t1 = time.perf_counter()
    blocks = [b for b, _ in worker.empty_like(src)]  # one request, as save() makes
    t2 = time.perf_counter()
    for dst, a in zip(blocks, src):
      shm.copy(dst, a)
    t3 = time.perf_counter()
    for dst, a in zip(private, src):
      shm.copy(dst, a)
    for k, v in zip(out, (t2 - t1, t3 - t2, time.perf_counter() - t3)):
      out[k].append(v)
    del blocks, dst
    deadline = time.monotonic() + 10  # the blocks go back asynchronously: reuse them
    while used() > baseline and time.monotonic() < deadline:
      time.sleep(0.05)
  return {k: statistics.median(v) for k, v in out.items()}


def restore_ram(saver: SidecarSaver, ctl, state, step: int, repeats: int) -> list[float]:
  target, out = abstract(state), []
  arena = ctl.worker(0).arena.buffer
  lo, hi = arena.ctypes.data, arena.ctypes.data + arena.nbytes
  for i in range(repeats):
    t0 = time.perf_counter()
    restored = jax.block_until_ready(saver.ckpt.restore(step, target=target))
    out.append(time.perf_counter() - t0)
    if i == 0:
      check_restored(restored, state, "sidecar RAM tier")
      pointer = restored["layer0"].addressable_shards[0].data.unsafe_buffer_pointer()
      if not lo <= pointer < hi:
        progress("note: the RAM-tier restore did not hand out arena views (it copied)")
    del restored
  return out


def restore_disk(paths: dict[str, tuple[str, int]], ctl, state, raw_dir: str,
                 repeats: int) -> dict[tuple[str, str], list[float]]:
  """Times each restore path, cold then warm, ``repeats`` times, rotating the order."""
  target = abstract(state)
  fresh = ctl.checkpointer(paths["sidecar"][0])  # a fresh cluster: no RAM tier
  managers = {k: ocp.CheckpointManager(d) for k, (d, _) in paths.items() if k != "sidecar"}
  raw_dst = [np.ones_like(np.asarray(a)) for a in state.values()]
  restorers = {
      "raw read": (raw_dir, lambda: raw_read_seconds(state, raw_dir, raw_dst)),
      "sidecar": (paths["sidecar"][0], lambda: fresh.restore(paths["sidecar"][1], target=target)),
      **{k: (paths[k][0], lambda m=m, k=k: m.restore(
          paths[k][1], args=ocp.args.StandardRestore(target))) for k, m in managers.items()},
  }
  out: dict[tuple[str, str], list[float]] = {}
  try:
    names = list(restorers)
    for i in range(repeats):
      for name in names[i % len(names):] + names[:i % len(names)]:
        directory, fn = restorers[name]
        for mode in ("cold", "warm"):
          if mode == "cold":
            drop_page_cache(directory)
          t0 = time.perf_counter()
          restored = jax.block_until_ready(fn())
          out.setdefault((name, mode), []).append(time.perf_counter() - t0)
          if i == 0 and mode == "cold" and name != "raw read":
            check_restored(restored, state, name)
          del restored
  finally:
    fresh.close()
    for m in managers.values():
      m.close()
  return out


# ---- report ------------------------------------------------------------------------


def _s(x: float) -> str:
  return f"{x:.3f}"


def save_table(records: dict[str, list[SaveRecord]], memcpy: list[float], raw: list[float],
               direct: list[float], raw_busy: list[tuple[float, float, float]]) -> str:
  med = statistics.median
  busy_recs = [r for recs in records.values() for r in recs if r.steps_per_s is not None]
  spread = lambda xs: f"{med(xs):.0%} ({min(xs):.0%}-{max(xs):.0%})"
  rows = [("one memcpy of the state, one thread (reference)", _s(med(memcpy)), "1.00x", "-", "-",
           "-", "-", "-", "-"),
          ("raw write+fsync, 8 files (reference)", "-", "-", _s(med(raw)),
           f"{min(raw):.2f}-{max(raw):.2f}", "1.00x", _s(med(b[0] for b in raw_busy)),
           f"{med(b[1] for b in raw_busy):.1f}", f"{med(b[1] / b[2] for b in raw_busy):.0%}"),
          ("O_DIRECT write, 8 files, 4 at once (the disk's floor)", "-", "-", _s(med(direct)),
           f"{min(direct):.2f}-{max(direct):.2f}",
           f"{med(d / w for d, w in zip(direct, raw)):.2f}x",
           "-", "-", "-"),
          ("training loop, no save in flight", "-", "-", "-", "-", "-", "-",
           f"{med(r.idle_steps_per_s for r in busy_recs):.1f}", "100%"),
          (f"the same, a {CONTROL_S:g} s window right after (control)", "-", "-", "-", "-", "-",
           "-", f"{med(r.control_steps_per_s for r in busy_recs):.1f}",
           spread([r.control_steps_per_s / r.idle_steps_per_s for r in busy_recs]))]
  for name, recs in records.items():
    idle = [r for r in recs if r.steps_per_s is None]
    busy = [r for r in recs if r.steps_per_s is not None]
    durable = [r.durable for r in idle]
    rows.append((name, _s(med(r.blocked for r in recs)),
                 f"{med(r.blocked / memcpy[r.round] for r in recs):.2f}x", _s(med(durable)),
                 f"{min(durable):.2f}-{max(durable):.2f}",
                 f"{med(r.durable / raw[r.round] for r in idle):.2f}x",
                 _s(med(r.durable for r in busy)),
                 f"{med(r.steps_per_s for r in busy):.1f}",
                 spread([r.steps_per_s / r.idle_steps_per_s for r in busy])))
  # Ratios pair each save with its round's memcpy, raw write or loop before it.
  return table(("save", "blocked s", f"vs memcpy (<= {TARGET_BLOCKED_X}x)",
                f"durable s, trainer idle (<= {TARGET_DURABLE_S})", "min-max",
                "vs write+fsync", "durable s, trainer busy", "steps/s during save",
                f"vs no save (>= {TARGET_STEPS:.0%})"), rows)


def phase_table(records: list[SaveRecord], staged_at: dict[int, float],
                written: dict[int, float]) -> str:
  """Where a sidecar save's time goes: medians over the saves, trainer idle and busy."""
  def phases(r: SaveRecord) -> list[float]:
    staged = staged_at[r.step] - r.called
    write = written.get(r.step, float("nan"))
    return [r.blocked, staged - r.blocked, r.durable - staged, write, r.durable]
  names = ("save() returns: plan + copy into the arena (trainer blocked)",
           "the last stage call, until staged",
           "from staged to durable: the writes' tail, prepared, commit",
           "sidecar writes its part (its log; from its first part staged)",
           "durable, total")
  cols = []
  for busy in (False, True):
    chosen = [phases(r) for r in records if (r.steps_per_s is not None) == busy]
    cols.append([statistics.median(p[i] for p in chosen) for i in range(len(names))])
  return table(("sidecar save phase", "s, trainer idle", "s, trainer busy"),
               [(n, _s(a), _s(b)) for n, a, b in zip(names, *cols)])


def blocked_table(pieces: dict[str, float], records: list[SaveRecord]) -> str:
  blocked = statistics.median(r.blocked for r in records)
  # save() asks no sidecar's Status any more (its fit check uses the arena sizes it knows).
  rows = [("8 arena blocks, one request (worker.empty_like)", pieces["alloc"]),
          (f"8 copies into those arena blocks ({shm.COPY_THREADS} threads each)", pieces["copy"]),
          ("the same 8 copies into pre-faulted private buffers", pieces["memcpy"]),
          ("save() blocked (the saves above)", blocked),
          ("save() blocked - allocations - copies", blocked - pieces["alloc"] - pieces["copy"])]
  return table(("sidecar save() stall, piece by piece", "s"),
               [(n, f"{v:+.3f}" if n.startswith("save() blocked -") else _s(v)) for n, v in rows])


def restore_table(ram: list[float], disk: dict[tuple[str, str], list[float]],
                  nbytes: int) -> tuple[str, float]:
  med = {k: statistics.median(v) for k, v in disk.items()}
  med[("sidecar RAM tier", "-")] = statistics.median(ram)
  orbax = {k: v for k, v in med.items() if k[0].startswith("Orbax")}
  best_key = min(orbax, key=orbax.get)
  zstd_cold = med[(next(k for k, _ in orbax if "zstd" in k), "cold")]
  order = ["raw read", "sidecar RAM tier", "sidecar"] + sorted({k for k, _ in orbax})
  rows = []
  for name in order:
    for (n, mode), s in med.items():
      if n == name:
        label = "sidecar from disk, fresh cluster" if n == "sidecar" else n
        rows.append((label, mode, _s(s), f"{nbytes / s / 1e9:.2f}", f"{zstd_cold / s:.1f}x",
                     f"{orbax[best_key] / s:.1f}x"))
  header = ("restore", "page cache", "s", "GB/s", "Orbax zstd cold / this",
            f"Orbax's fastest ({best_key[0]}, {best_key[1]}) / this")
  return table(header, rows), orbax[best_key] / med[("sidecar RAM tier", "-")]


def read_phase_table(phases: dict[str, dict[str, float]],
                     disk: dict[tuple[str, str], list[float]]) -> str:
  """Where a restore from disk through the sidecar goes, measured in the sidecar."""
  names = (("read", "the 8 chunk files into new arena blocks, one after another"),
           ("crc32c", "crc32c of the 8 leaves"))
  rows = [(label, *(_s(phases[m][k]) for m in ("cold", "warm"))) for k, label in names]
  rows.append(("sum", *(_s(sum(phases[m].values())) for m in ("cold", "warm"))))
  rows.append(("ckpt.restore from the controller (the table above)",
               *(_s(statistics.median(disk[("sidecar", m)])) for m in ("cold", "warm"))))
  return table(("sidecar restore from disk, in the sidecar", "s, cold", "s, warm"), rows)


def targets_table(records, memcpy: list[float], raw: list[float], direct: list[float],
                  ram_x: float) -> str:
  med = statistics.median
  recs = records[SidecarSaver.name]
  blocked_x = med(r.blocked / memcpy[r.round] for r in recs)
  durable = med(r.durable for r in recs if r.steps_per_s is None)
  steps = med(r.steps_per_s / r.idle_steps_per_s for r in recs if r.steps_per_s is not None)
  yes = lambda ok: "yes" if ok else "no"
  return table(("target (sidecar)", "measured", "met"), [
      (f"durable <= {TARGET_DURABLE_S} s", f"{durable:.2f} s (raw write+fsync of the bytes: "
       f"{med(raw):.2f} s; O_DIRECT write alone: {med(direct):.2f} s)",
       yes(durable <= TARGET_DURABLE_S)),
      (f"steps/s during the save >= {TARGET_STEPS:.0%} of idle", f"{steps:.0%}",
       yes(steps >= TARGET_STEPS)),
      (f"RAM-tier restore >= {TARGET_RESTORE_X:.0f}x faster than Orbax's",
       f"{ram_x:.1f}x (vs Orbax's fastest restore)", yes(ram_x >= TARGET_RESTORE_X)),
      (f"blocked <= {TARGET_BLOCKED_X}x one memcpy", f"{blocked_x:.2f}x",
       yes(blocked_x <= TARGET_BLOCKED_X))])


# ---- main --------------------------------------------------------------------------


@dataclasses.dataclass
class Results:
  """Everything one run measured; filled in phase by phase, then printed."""
  nbytes: int = 0
  records: dict[str, list[SaveRecord]] = dataclasses.field(default_factory=dict)
  memcpy: list[float] = dataclasses.field(default_factory=list)
  raw: list[float] = dataclasses.field(default_factory=list)
  direct: list[float] = dataclasses.field(default_factory=list)
  raw_busy: list[tuple[float, float, float]] = dataclasses.field(default_factory=list)
  last: dict[str, int] = dataclasses.field(default_factory=dict)  # saver -> its last step
  directories: dict[str, str] = dataclasses.field(default_factory=dict)  # saver -> its dir
  blocked: dict[str, float] = dataclasses.field(default_factory=dict)
  staged_at: dict[int, float] = dataclasses.field(default_factory=dict)
  written: dict[int, float] = dataclasses.field(default_factory=dict)
  ram: list[float] = dataclasses.field(default_factory=list)
  disk: dict[tuple[str, str], list[float]] = dataclasses.field(default_factory=dict)
  read_phases: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)


def measure_saves(args, dirs: dict[str, str], res: Results):
  """Saves, the stall's pieces and RAM-tier restores on one cluster; returns the state."""
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size=args.shm_size,
                                    imports=FNS) as cluster, cluster.controller() as ctl:
    device = cluster.devices(0)[0]
    state, train = make_state(device), Trainer(device)
    res.nbytes = sum(a.nbytes for a in state.values())
    savers = [SidecarSaver(ctl, dirs["sidecar"]),
              OrbaxSaver(dirs["orbax_zstd"], compress=True),
              OrbaxSaver(dirs["orbax_raw"], compress=False)]
    try:
      res.records, res.memcpy, res.raw, res.direct, res.raw_busy = run_saves(
          savers, state, train, dirs["raw"], rounds=args.rounds, busy_saves=args.busy_saves,
          idle_seconds=args.idle_seconds)
      res.last = {s.name: res.records[s.name][-1].step for s in savers}
      res.directories = {s.name: s.directory for s in savers}
      progress("save()'s stall, piece by piece")
      res.blocked = blocked_phases(ctl, state)
      progress("restores from the sidecar's RAM tier")
      res.ram = restore_ram(savers[0], ctl, state, res.last[SidecarSaver.name], args.restores + 1)
    finally:
      for saver in savers:
        saver.close()
    res.staged_at, res.written = savers[0].staged_at, write_phases(cluster.log(0))
  return state


def measure_disk_restores(args, dirs: dict[str, str], state, res: Results) -> None:
  progress("restores from disk (a fresh cluster for the sidecar)")
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size=args.shm_size,
                                    imports=FNS) as fresh, fresh.controller() as ctl:
    paths = {"sidecar" if name == SidecarSaver.name else name: (directory, res.last[name])
             for name, directory in res.directories.items()}
    res.disk = restore_disk(paths, ctl, state, dirs["raw"], args.restores)
    res.read_phases = sidecar_read_phases(ctl, *paths["sidecar"], list(state))


def report(args, res: Results) -> None:
  print(f"state: {LEAVES} x {np.prod(LEAF_SHAPE) * 4 >> 20} MiB float32 = "
        f"{res.nbytes / 2**30:.2f} GiB on the CPU backend; {args.rounds} rounds, each "
        f"with 1 save per saver with the trainer idle and {args.busy_saves} with it busy; "
        "medians\n")
  ours = res.records[SidecarSaver.name]
  restores, ram_x = restore_table(res.ram, res.disk, res.nbytes)
  for text in (save_table(res.records, res.memcpy, res.raw, res.direct, res.raw_busy),
               phase_table(ours, res.staged_at, res.written),
               blocked_table(res.blocked, ours), restores,
               read_phase_table(res.read_phases, res.disk),
               targets_table(res.records, res.memcpy, res.raw, res.direct, ram_x)):
    print(text)
    print()


def check_disk_space(base: str, args: argparse.Namespace) -> None:
  """Each saver keeps its last step on disk (the restores read it; older ones are deleted
  between saves, outside the timings), and writes the next beside it: fail at the
  start, not with ENOSPC mid-run, when that cannot fit."""
  del args  # the rounds no longer add to it
  state = LEAVES * int(np.prod(LEAF_SHAPE)) * 4
  need = (3 * 2 + 2) * state  # 3 savers' last and next steps, the raw and O_DIRECT copies
  free = shutil.disk_usage(base).free
  if free < need:
    raise SystemExit(
        f"the savers' steps of {state / 2**30:.0f} GiB need {need / 2**30:.0f} GiB, and "
        f"{base} has {free / 2**30:.0f} GiB free: pass --dir on a larger disk")


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--rounds", type=int, default=5, help="rounds of saves, each saver in turn")
  ap.add_argument("--busy-saves", type=int, default=3,
                  help="saves per saver and round with the training loop running (the "
                       "steps/s ratio moves most from window to window: see the control row)")
  ap.add_argument("--idle-seconds", type=float, default=1.5,
                  help="the training loop's rate with no save in flight, before each busy save")
  ap.add_argument("--restores", type=int, default=2, help="repeats of each restore")
  ap.add_argument("--dir", default=None, help="where the temp dir of checkpoints goes")
  ap.add_argument("--shm-size", default="3GiB", help="the sidecar's arena: 2 states + slack")
  args = ap.parse_args()
  base = tempfile.mkdtemp(prefix="sidecar-ckpt-bench-", dir=args.dir)
  dirs = {k: os.path.join(base, k) for k in ("sidecar", "orbax_zstd", "orbax_raw", "raw")}
  res = Results()
  try:
    if filesystem_type(base) == "tmpfs":
      raise SystemExit(f"{base} is on a tmpfs; pass --dir on a disk (this measures storage)")
    check_disk_space(base, args)
    state = measure_saves(args, dirs, res)
    measure_disk_restores(args, dirs, state, res)
  finally:
    shutil.rmtree(base, ignore_errors=True)
  report(args, res)


if __name__ == "__main__":
  main()
