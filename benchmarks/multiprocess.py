"""Feeds and a 1 GiB save with 2 trainer processes of one host each, against 1 process of 2 hosts.

Run from the repository root: ``python -m benchmarks.multiprocess``. Not run by CI.

Two jobs, both up for the whole run, on the same 2 cores:
  (A) single  this process owns both CPU devices and drives a LocalCluster of 2 sidecars
              x 1 device
  (B) multi   ``sidecar launch --hosts 2 --devices-per-host 1``: 2 trainer processes under
              ``jax.distributed``, each with 1 CPU device beside its own sidecar, running this
              module (the hidden ``--trainer`` argument), which prints one JSON line per figure
Both run the same code (``Bench``) phase by phase, taking turns window by window and save by
save (each turn rotates which goes first: this machine's speed drifts, and other people's
work shares its cores); a feed or checkpointer stays open, idle, while the other job runs.
  feeds   ``ctl.feed`` of ``benchmarks.feed_fns``' pipeline as ``benchmarks.feed`` defines it
          (224x224x3 uint8 images as is, "noop", or lightly augmented, "light"; global batch
          32, 16 rows per host; ``--workers`` per sidecar, prefetch 4) into global jax.Arrays
          sharded over the 2 devices. Warm-up as ``benchmarks.feed`` (``feed.WARMUP_S``) after
          opening; then per window ``--settle`` s unmeasured (the batches prefetched while
          idle come out at once) and ``--seconds`` s measured: batches/s and the trainer's
          mean wait per step. (B)'s processes use the same wall-clock window (process 0 names
          it; a barrier would let the prefetch fill while it waits). Each window also counts
          CPU seconds: the trainer process, its hosts' sidecars and their feed workers, and
          the whole machine (``/proc``), per global batch
  saves   a 1 GiB state as ``benchmarks.checkpoint`` (8 x 128 MiB float32), each leaf sharded
          by rows over the 2 devices; ``ctl.checkpointer(ram_steps=1)``, 2 warm-up saves, then
          ``--saves`` saves with the trainer idle, timed by ``benchmarks.checkpoint.timed_save``:
          blocked (``save`` returning) and durable (``handle.durable``); just before each, the
          same shards copied into pre-faulted private buffers with the save's copy
          (``shm.copy``) as a reference. (B)'s processes enter each together (a barrier)
(B)'s figures: for feeds every process's batches/s (the job goes at its slowest's pace), for
saves process 0's and the max over processes of each save (the job waits for its slowest).
Ratios pair each of (B)'s windows or saves with (A)'s turn next to it; medians.
Target (issue 12): (B) within 10% of (A) for feed batches/s and blocked time.
Checkpoints go to a temp dir under ``--dir`` (default: the system temp dir, which must not be
a tmpfs) and are removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from benchmarks import feed as feed_bench
from benchmarks.checkpoint import (
  LEAF_SHAPE,
  LEAVES,
  SidecarSaver,
  filesystem_type,
  progress,
  timed_save,
)
from benchmarks.common import table
from sidecar._src.arena import shm

HOSTS = 2
IMPORTS = ["benchmarks.feed_fns"]
KINDS = ("noop", "light")
TARGET_FEED_X, TARGET_BLOCKED_X = 0.9, 1.1
MARK = "BENCH "  # what starts a trainer's figure line
_LINE = re.compile(r"^\[host (\d+)\] " + re.escape(MARK) + r"(.*)$")
_POLL_S = 0.02
Emit = Callable[[dict[str, Any]], None]


# ---- what every trainer process runs ----------------------------------------------


def data_sharding(ctl) -> NamedSharding:
  """The batch (and state rows) over every device of the job, in device order."""
  devices = [d for d in jax.devices() if d.id in ctl.device_hosts]
  return NamedSharding(Mesh(np.array(devices), ("data",)), P("data"))


def make_state(sharding: NamedSharding) -> dict[str, jax.Array]:
  """``benchmarks.checkpoint``'s 1 GiB state, each leaf's rows over the devices; every
  process makes only its own blocks, the same whatever the process count."""
  def leaf(i: int) -> jax.Array:
    def block(index) -> np.ndarray:
      start, stop, _ = index[0].indices(LEAF_SHAPE[0])
      rng = np.random.default_rng([i, start])
      return rng.random((stop - start, *LEAF_SHAPE[1:]), dtype=np.float32)
    return jax.make_array_from_callback(LEAF_SHAPE, sharding, block)
  return jax.block_until_ready({f"layer{i}": leaf(i) for i in range(LEAVES)})


class Bench:
  """What one job runs, phase by phase: the same in (A)'s process and in each of (B)'s.

  A feed or a checkpointer stays open across the phases that use it, so (A) and (B) can
  take turns window by window and save by save while the other one's sits idle.
  """

  def __init__(self, ctl):
    self.ctl = ctl
    self.sharding = data_sharding(ctl)
    self.state = make_state(self.sharding)
    self.feed = self.saver = None
    self.private: list[np.ndarray] = []
    self._n = 0

  def run(self, spec: dict[str, Any], emit: Emit) -> None:
    self._n += 1
    key, what = f"bench/{self._n}", spec["what"]
    if what == "feed_open":
      self.feed = self.ctl.feed(
          "bench_images", kwargs={"kind": spec["kind"]}, global_batch_size=feed_bench.BATCH,
          sharding=self.sharding,
          options=sidecar.FeedOptions(workers=spec["workers"], prefetch=spec["prefetch"]))
      self._consume(self._deadline(key, spec["warmup"]), None)
    elif what == "feed_window":
      # A short settle first: the prefetched batches of the idle turn come out at once.
      start = self._deadline(key, spec["settle"])
      self._consume(start, None)
      cpu = cpu_now(self.ctl)
      figure = self._consume(start + spec["seconds"], 3)
      cpu = {k: v - cpu[k] for k, v in cpu_now(self.ctl).items()}
      emit({"figure": f"feed/{spec['kind']}", "window": spec["window"], "cpu": cpu, **figure})
    elif what == "feed_close":
      self.feed.close()
      self.feed = None
    elif what == "ckpt_open":
      self.saver = SidecarSaver(self.ctl, spec["directory"])
      self.private = [np.ones_like(a) for a in own_shards(self.state)]  # pre-faulted
      for step in spec["warmup_steps"]:  # with ram_steps=1 they alternate arena halves
        self._barrier(f"{key}/{step}")
        timed_save(self.saver, step, self.state)
    elif what == "save":
      self._barrier(f"{key}/memcpy")
      memcpy = copy_seconds(own_shards(self.state), self.private)
      self._barrier(f"{key}/save")
      record = timed_save(self.saver, spec["step"], self.state)
      emit({"figure": "save", "step": spec["step"], "blocked": record.blocked,
            "durable": record.durable, "memcpy": memcpy})
    elif what == "ckpt_close":
      self.saver.close()
      self.saver, self.private = None, []
    else:
      raise ValueError(f"unknown phase {spec!r}")

  def _deadline(self, key: str, seconds: float) -> float:
    """A wall-clock time ``seconds`` from now, process 0's in every process (one
    machine, one clock): a barrier instead would let the prefetch fill while it waits."""
    lead = str(time.time() + seconds) if self.ctl.process_index == 0 else None
    return float(self.ctl.peers.broadcast(f"{key}/deadline", lead))

  def _barrier(self, key: str) -> None:
    self.ctl.peers.all_gather(key, "")

  def _consume(self, until: float, at_least: int | None) -> dict[str, Any]:
    """``feed.consume``'s loop on global arrays until wall-clock ``until``."""
    n, waited, t0 = 0, 0.0, time.perf_counter()
    while time.time() < until or n < (at_least or 0):
      w = time.perf_counter()
      batch = next(self.feed)
      waited += time.perf_counter() - w
      jax.block_until_ready(batch)
      n += 1
    elapsed = time.perf_counter() - t0
    return {"batches_per_s": n / elapsed, "wait_ms": waited / max(n, 1) * 1e3, "batches": n}

  def close(self) -> None:
    if self.feed is not None:
      self.feed.close()
    if self.saver is not None:
      self.saver.close()


def _process_cpu(pid: int) -> float:
  """CPU seconds (user + system) process ``pid`` has used; 0 if it is gone."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
  except OSError:
    return 0.0
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _descendants(pid: int) -> list[int]:
  out = []
  try:
    for tid in os.listdir(f"/proc/{pid}/task"):
      with open(f"/proc/{pid}/task/{tid}/children") as f:
        out += [int(c) for c in f.read().split()]
  except OSError:
    return out
  return out + [d for c in out for d in _descendants(c)]


def cpu_now(ctl) -> dict[str, float]:
  """CPU seconds so far: this process, its hosts' sidecars, their children (the feed
  workers), and the whole machine (busy, and all of it)."""
  sidecars = [h.pid for h in ctl.hosts if h.host_id in ctl.local_hosts]
  with open("/proc/stat") as f:
    ticks = [int(x) for x in f.readline().split()[1:9]]
  tck = os.sysconf("SC_CLK_TCK")
  return {"trainer": time.process_time(), "sidecar": sum(map(_process_cpu, sidecars)),
          "workers": sum(_process_cpu(c) for p in sidecars for c in _descendants(p)),
          "machine_busy": (sum(ticks) - ticks[3] - ticks[4]) / tck, "machine": sum(ticks) / tck}


def own_shards(state) -> list[np.ndarray]:
  """The blocks a save copies in this process: its addressable shards with replica_id 0."""
  return [np.asarray(s.data) for a in state.values() for s in a.addressable_shards
          if s.replica_id == 0]


def copy_seconds(src: list[np.ndarray], dst: list[np.ndarray]) -> float:
  """The save's copies (``shm.copy``, as ``Worker.put``) into pre-faulted private buffers."""
  t0 = time.perf_counter()
  for d, s in zip(dst, src):
    shm.copy(d, s)
  return time.perf_counter() - t0


def trainer(control_dir: str) -> int:
  """One process of (B): runs each phase the parent writes into ``control_dir``."""
  sidecar.jax.initialize()
  with sidecar.jax.Controller.from_env(timeout=60) as ctl:
    me = ctl.process_index
    emit = lambda fig: print(MARK + json.dumps({"process": me, **fig}), flush=True)
    bench = Bench(ctl)
    try:
      emit({"ready": True})
      for n in range(1, 1 << 30):
        path = os.path.join(control_dir, f"phase-{n}.json")
        while not os.path.exists(path):
          time.sleep(_POLL_S)
        with open(path) as f:
          spec = json.load(f)
        if spec["what"] == "exit":
          break
        bench.run(spec, emit)
        emit({"done": n})
    finally:
      bench.close()
  return 0


# ---- the parent: (A) in this process, (B) through sidecar launch ------------------------


class Single:
  """(A): this process owns both devices and drives a LocalCluster of 2 hosts."""

  def __init__(self, shm_size: str):
    self.cluster = sidecar.testing.LocalCluster(num_hosts=HOSTS, devices_per_host=1,
                                                shm_size=shm_size, imports=IMPORTS).start()
    try:
      self.ctl = self.cluster.controller()
      self.bench = Bench(self.ctl)
    except BaseException:
      self.cluster.close()
      raise

  def run(self, spec: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    self.bench.run(spec, lambda fig: out.append({"process": 0, **fig}))
    return out

  def close(self) -> None:
    try:
      self.bench.close()
    finally:
      self.ctl.close()
      self.cluster.close()


class Multi:
  """(B): ``sidecar launch`` of 2 trainers running ``trainer``; phases go through files."""

  def __init__(self, shm_size: str, control_dir: str):
    self.control_dir = control_dir
    command = [sys.executable, "-m", "sidecar", "launch", "--hosts", str(HOSTS),
               "--devices-per-host", "1", "--shm-size", shm_size,
               *(a for m in IMPORTS for a in ("--import", m)), "--",
               sys.executable, "-m", "benchmarks.multiprocess", "--trainer", control_dir]
    self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, text=True)
    self.lines: queue.SimpleQueue = queue.SimpleQueue()
    self.tail: list[str] = []
    self.reader = threading.Thread(target=self._read, name="bench-multi-reader")
    self.reader.start()
    self._n = 0
    try:
      self._collect(lambda figs: sum("ready" in f for f in figs) == HOSTS)
    except BaseException:
      self.close()
      raise

  def _read(self) -> None:
    with self.proc.stdout:
      for line in self.proc.stdout:
        m = _LINE.match(line.rstrip("\n"))
        if m:
          self.lines.put(json.loads(m[2]))
        else:  # the trainers' progress and the launcher's messages
          self.tail = (self.tail + [line])[-40:]
          sys.stderr.write(line)
          sys.stderr.flush()
    self.lines.put(None)

  def _collect(self, done: Callable[[list[dict[str, Any]]], bool]) -> list[dict[str, Any]]:
    figures: list[dict[str, Any]] = []
    while not done(figures):
      fig = self.lines.get()
      if fig is None:
        raise RuntimeError(f"sidecar launch exited with code {self.proc.wait()}; its output "
                           "ended:\n" + "".join(self.tail))
      figures.append(fig)
    return figures

  def _write(self, spec: dict[str, Any]) -> None:
    self._n += 1
    path = os.path.join(self.control_dir, f"phase-{self._n}.json")
    with open(path + ".tmp", "w") as f:
      json.dump(spec, f)
    os.replace(path + ".tmp", path)  # the trainers never see half a file

  def run(self, spec: dict[str, Any]) -> list[dict[str, Any]]:
    self._write(spec)
    n = self._n
    figures = self._collect(lambda figs: sum(f.get("done") == n for f in figs) == HOSTS)
    return [f for f in figures if "figure" in f]

  def close(self) -> None:
    if self.proc.poll() is None:
      try:
        self._write({"what": "exit"})
        self.proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        self.proc.terminate()  # the launcher stops its trainers and sidecars
        self.proc.wait()
    self.reader.join(timeout=10)
    if self.proc.returncode:  # not raised: it would hide what went wrong first
      progress(f"sidecar launch exited with code {self.proc.returncode}")


def clear_steps(directory: str) -> None:
  """Removes the committed steps (the RAM tier keeps its copy; nothing restores them)."""
  for name in os.listdir(directory):
    if name.isdigit():
      shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def take_turns(jobs: dict[str, Any], spec: dict[str, Any], i: int) -> list[dict[str, Any]]:
  """Runs ``spec`` in every job, one after the other; turn ``i`` rotates the order."""
  names, out = list(jobs), []
  for name in names[i % len(names):] + names[:i % len(names)]:
    out += [{**fig, "job": name} for fig in jobs[name].run(spec)]
  return out


def run_all(args, jobs: dict[str, Any], base: str) -> list[dict[str, Any]]:
  """Every phase, (A) and (B) taking turns; returns their figures, each with its job."""
  figures = []
  for kind in args.kinds:
    progress(f"feed {kind}: opening, {args.warmup:g} s warm-up in each job")
    take_turns(jobs, {"what": "feed_open", "kind": kind, "workers": args.workers,
                      "prefetch": args.prefetch, "warmup": args.warmup}, 0)
    for w in range(args.windows):
      got = take_turns(jobs, {"what": "feed_window", "kind": kind, "window": w,
                              "settle": args.settle, "seconds": args.seconds}, w)
      progress(f"  window {w + 1} of {args.windows}: " + "; ".join(
          f"{f['job']}[{f['process']}] {f['batches_per_s']:,.0f}/s" for f in got))
      figures += got
    take_turns(jobs, {"what": "feed_close"}, 0)
  directories = {name: os.path.join(base, name) for name in jobs}
  for d in directories.values():
    os.makedirs(d)
  progress("saves: 2 warm-up saves in each job")
  for name, job in jobs.items():
    job.run({"what": "ckpt_open", "directory": directories[name], "warmup_steps": [1, 2]})
  for i in range(args.saves):
    figures += take_turns(jobs, {"what": "save", "step": 3 + i}, i)
    for d in directories.values():
      clear_steps(d)
  for job in jobs.values():
    job.run({"what": "ckpt_close"})
  return figures


# ---- report ------------------------------------------------------------------------


def _med(xs) -> float:
  return statistics.median(list(xs))


def _spread(xs: list[float], fmt: str = "{:.2f}") -> str:
  return f"{fmt.format(min(xs))}-{fmt.format(max(xs))}"


def kinds_in(figures: list[dict[str, Any]]) -> list[str]:
  return [k for k in KINDS if any(f["figure"] == f"feed/{k}" for f in figures)]


def paired(figures: list[dict[str, Any]], figure: str, by: str
           ) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
  """(A)'s figure and (B)'s (one per process), turn by turn (window or step)."""
  turns: dict[int, tuple[list, list]] = {}
  for f in figures:
    if f["figure"] == figure:
      turns.setdefault(f[by], ([], []))[f["job"] == "multi"].append(f)
  return [(a[0], sorted(b, key=lambda f: f["process"])) for a, b in
          (turns[t] for t in sorted(turns))]


def feed_table(figures: list[dict[str, Any]]) -> tuple[str, dict[str, float]]:
  rows, ratios = [], {}
  for kind in kinds_in(figures):
    pairs = paired(figures, f"feed/{kind}", "window")
    per_window = [min(f["batches_per_s"] for f in b) / a["batches_per_s"] for a, b in pairs]
    ratios[kind] = _med(per_window)
    procs = range(len(pairs[0][1]))
    b_med = lambda k, p, fmt, pairs=pairs: fmt.format(_med(b[p][k] for _, b in pairs))
    rows.append((kind, f"{_med(a['batches_per_s'] for a, _ in pairs):,.0f}",
                 f"{_med(a['wait_ms'] for a, _ in pairs):.2f}",
                 " / ".join(b_med("batches_per_s", p, "{:,.0f}") for p in procs),
                 " / ".join(b_med("wait_ms", p, "{:.2f}") for p in procs),
                 f"{ratios[kind]:.2f}x", _spread(per_window, "{:.2f}x")))
  n = len(paired(figures, f"feed/{kinds_in(figures)[0]}", "window"))
  return table((f"elements ({n} windows each)", "(A) 1 process, 2 hosts: batches/s",
                "wait ms/step", "(B) 2 processes: batches/s, process 0 / 1",
                "wait ms/step, process 0 / 1",
                f"multi/single, slowest process (>= {TARGET_FEED_X:.2f}x)",
                "min-max over windows"), rows), ratios


def cpu_table(figures: list[dict[str, Any]]) -> str:
  """Where the CPU goes per global batch: ours by role, and the rest of the machine."""
  rows = []
  for kind in kinds_in(figures):
    ours = {}
    for job, label in (("single", "(A)"), ("multi", "(B)")):
      per_window: list[dict[str, float]] = []
      for a, b in paired(figures, f"feed/{kind}", "window"):
        figs = [a] if job == "single" else b
        row = {k: sum(f["cpu"][k] / f["batches"] for f in figs)
               for k in ("trainer", "sidecar", "workers")}
        first = figs[0]  # the machine as process 0 saw it over its window
        row["ours"] = sum(row.values())
        row["rest"] = first["cpu"]["machine_busy"] / first["batches"] - row["ours"]
        row["busy"] = first["cpu"]["machine_busy"] / first["cpu"]["machine"]
        per_window.append(row)
      med = {k: _med(r[k] for r in per_window) for k in per_window[0]}
      ours[job] = [r["ours"] for r in per_window]
      x = "1.00x" if job == "single" else f"{_med(a / b for a, b in zip(*ours.values())):.2f}x"
      rows.append((kind, label, *(f"{med[k] * 1e3:.2f}" for k in
                                  ("trainer", "sidecar", "workers", "ours", "rest")),
                   f"{med['busy']:.0%}", x))
  return table(("CPU per global batch", "job", "trainer process(es) ms", "sidecars ms",
                "feed workers ms", "ours, total ms", "rest of the machine ms", "machine busy",
                "(A)'s total / this (batches per CPU-second vs (A))"), rows)


def save_table(figures: list[dict[str, Any]]) -> tuple[str, float]:
  pairs = paired(figures, "save", "step")
  rows, blocked_x = [], 0.0
  labels = (("memcpy", "the save's copies into private memory, just before (reference)"),
            ("blocked", "blocked: save() returns"), ("durable", "durable, trainer idle"))
  for what, label in labels:
    single = [a[what] for a, _ in pairs]
    p0 = [b[0][what] for _, b in pairs]
    mx = [max(f[what] for f in b) for _, b in pairs]
    x0 = _med(y / x for x, y in zip(single, p0))
    xmax = _med(y / x for x, y in zip(single, mx))
    if what == "blocked":
      blocked_x = xmax
    rows.append((label, f"{_med(single):.3f}", _spread(single), f"{_med(p0):.3f}",
                 f"{_med(mx):.3f}", _spread(mx), f"{x0:.2f}x", f"{xmax:.2f}x"))
  title = (f"1 GiB save ({LEAVES} x {np.prod(LEAF_SHAPE) * 4 >> 20} MiB float32 over 2 "
           f"devices), medians of {len(pairs)}")
  return table((title, "(A) s", "min-max", "(B) process 0 s", "(B) max over processes s",
                "min-max", "multi/single, process 0",
                f"multi/single, max (blocked <= {TARGET_BLOCKED_X:.2f}x)"), rows), blocked_x


def report(figures: list[dict[str, Any]]) -> None:
  feeds, feed_x = feed_table(figures)
  saves, blocked_x = save_table(figures)
  yes = lambda ok: "yes" if ok else "no"
  targets = table(("target (multi vs single)", "measured", "met"), [
      *((f"feed {k} batches/s >= {TARGET_FEED_X:.2f}x", f"{x:.2f}x", yes(x >= TARGET_FEED_X))
        for k, x in feed_x.items()),
      (f"blocked <= {TARGET_BLOCKED_X:.2f}x (max over processes)", f"{blocked_x:.2f}x",
       yes(blocked_x <= TARGET_BLOCKED_X))])
  for text in (feeds, cpu_table(figures), saves, targets):
    print(text)
    print()


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  ap.add_argument("--windows", type=int, default=8,
                  help="measured feed windows per element kind and job, taking turns")
  ap.add_argument("--seconds", type=float, default=3.0, help="each feed window")
  ap.add_argument("--settle", type=float, default=0.5,
                  help="seconds each feed runs unmeasured before its window")
  ap.add_argument("--warmup", type=float, default=feed_bench.WARMUP_S,
                  help="seconds each feed runs after it opens (as benchmarks.feed)")
  ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                  help="which feeds to run (for profiling one)")
  ap.add_argument("--workers", type=int, default=2, help="feed workers per sidecar")
  ap.add_argument("--prefetch", type=int, default=4)
  ap.add_argument("--saves", type=int, default=12, help="measured saves per job, taking turns")
  ap.add_argument("--dir", default=None, help="where the temp dir of checkpoints goes")
  ap.add_argument("--shm-size", default="1536MiB",
                  help="each sidecar's arena: its half of 2 states + slack")
  ap.add_argument("--figures", default=None,
                  help="also write every raw figure to this JSON file")
  ap.add_argument("--report", default=None, metavar="FIGURES",
                  help="print the tables of a --figures file and exit (nothing runs)")
  ap.add_argument("--trainer", default=None, help=argparse.SUPPRESS)  # a process of (B)
  args = ap.parse_args()
  if args.trainer is not None:
    sys.exit(trainer(args.trainer))
  if args.report is not None:
    with open(args.report) as f:
      report(json.load(f))
    return
  base = tempfile.mkdtemp(prefix="sidecar-mp-bench-", dir=args.dir)
  jobs: dict[str, Any] = {}
  try:
    if filesystem_type(base) == "tmpfs":
      raise SystemExit(f"{base} is on a tmpfs; pass --dir on a disk (this measures storage)")
    control = os.path.join(base, "control")
    os.makedirs(control)
    progress("starting (A): 1 process, LocalCluster of 2 hosts x 1 device")
    jobs["single"] = Single(args.shm_size)
    progress("starting (B): sidecar launch --hosts 2 --devices-per-host 1")
    jobs["multi"] = Multi(args.shm_size, control)
    figures = run_all(args, jobs, base)
  finally:
    for job in reversed(list(jobs.values())):
      job.close()
    shutil.rmtree(base, ignore_errors=True)
  if args.figures:
    with open(args.figures, "w") as f:
      json.dump(figures, f)
  print(f"{HOSTS} hosts x 1 CPU device; (A) 1 process drives both, (B) 2 processes under "
        f"jax.distributed, 1 host each, taking turns; feeds: global batch {feed_bench.BATCH}, "
        f"workers={args.workers} per sidecar, prefetch {args.prefetch}, {args.warmup:g} s "
        f"warm-up, then windows of {args.settle:g} s unmeasured + {args.seconds:g} s\n")
  report(figures)


if __name__ == "__main__":
  main()
