"""Feeds and a 1 GiB save with 2 trainer processes of one host each, against 1 process of 2 hosts.

Run from the repository root: ``python -m benchmarks.multiprocess``. Not run by CI.

Two jobs, both up for the whole run, on the same 2 cores:
  (A) single  this process owns both CPU devices and drives a LocalCluster of 2 sidecars
              x 1 device
  (B) multi   ``sidecar launch --hosts 2 --devices-per-host 1``: 2 trainer processes under
              ``jax.distributed``, each with 1 CPU device beside its own sidecar, running this
              module (the hidden ``--trainer`` argument); each prints one JSON line per figure
They take turns phase by phase; each round rotates which goes first (this machine's speed
drifts). Every phase runs the same code (``run_phase``) in (A) and in each process of (B):
  feed noop, feed light  ``ctl.feed`` of ``benchmarks.feed_fns``' pipeline as
              ``benchmarks.feed`` defines it (224x224x3 uint8 images as is, or lightly
              augmented; global batch 32, 16 rows per host; ``workers`` per sidecar, prefetch
              4) into global jax.Arrays sharded over the 2 devices. Warm-up as
              ``benchmarks.feed`` (``feed.WARMUP_S``), then batches/s and the trainer's mean
              wait per step over ``--seconds``; (B)'s processes measure the same wall-clock
              window (process 0 names its start), with no barrier to fill their prefetch
  saves       a 1 GiB state as ``benchmarks.checkpoint`` (8 x 128 MiB float32), each leaf
              sharded by rows over the 2 devices; ``ctl.checkpointer(ram_steps=1)``, 2 warm-up
              saves, then ``--saves`` saves with the trainer idle, timed by
              ``benchmarks.checkpoint.timed_save``: blocked (``save`` returning) and durable
              (``handle.durable``). (B)'s processes enter each save together (a barrier).
              Reference: the same shards copied into pre-faulted private buffers with the
              save's copy (``shm.copy``), in (B) by both processes at once
(B)'s figures: for feeds every process's batches/s (the job goes at its slowest's pace), for
saves process 0's and the max over processes of each save (the job waits for its slowest).
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
from benchmarks.checkpoint import (LEAF_SHAPE, LEAVES, SidecarSaver, filesystem_type, progress,
                                   timed_save)
from benchmarks.common import table
from sidecar._src import shm

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


def feed_phase(ctl, sharding, spec: dict[str, Any], key: str) -> dict[str, Any]:
  """``feed.consume``'s loop on global arrays: warm-up, then the same window in every process."""
  with ctl.feed("bench_images", global_batch_size=feed_bench.BATCH, sharding=sharding,
                workers=spec["workers"], prefetch=spec["prefetch"], kind=spec["kind"]) as feed:
    # Process 0 names the window; a barrier instead would let the prefetch fill meanwhile.
    start = float(ctl.peers.broadcast(f"{key}/window", str(time.time() + spec["warmup"])
                                      if ctl.process_index == 0 else None))
    while time.time() < start:
      jax.block_until_ready(next(feed))
    n, waited, t0 = 0, 0.0, time.perf_counter()
    end = start + spec["seconds"]
    while time.time() < end or n < 3:
      w = time.perf_counter()
      batch = next(feed)
      waited += time.perf_counter() - w
      jax.block_until_ready(batch)
      n += 1
    elapsed = time.perf_counter() - t0
  return {"figure": f"feed/{spec['kind']}", "batches_per_s": n / elapsed,
          "wait_ms": waited / n * 1e3, "batches": n}


def own_shards(state) -> list[np.ndarray]:
  """The blocks a save copies in this process: its addressable shards with replica_id 0."""
  return [np.asarray(s.data) for a in state.values() for s in a.addressable_shards
          if s.replica_id == 0]


def memcpy_seconds(src: list[np.ndarray], repeats: int = 3) -> float:
  """The save's copies (``shm.copy``, as ``Worker.put``) into pre-faulted private buffers."""
  dst = [np.ones_like(a) for a in src]
  out = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for d, s in zip(dst, src):
      shm.copy(d, s)
    out.append(time.perf_counter() - t0)
  return statistics.median(out)


def save_phase(ctl, state, spec: dict[str, Any], key: str, emit: Emit) -> None:
  barrier = lambda name: ctl.peers.all_gather(f"{key}/{name}", "")
  barrier("memcpy")
  emit({"figure": "memcpy", "seconds": memcpy_seconds(own_shards(state))})
  saver = SidecarSaver(ctl, spec["directory"])
  try:
    for i, step in enumerate(range(spec["first_step"], spec["first_step"] + 2 + spec["saves"])):
      barrier(f"save/{step}")
      record = timed_save(saver, step, state)
      if i >= 2:  # the first two are warm-up: with ram_steps=1 they alternate arena halves
        emit({"figure": "save", "step": step, "blocked": record.blocked,
              "durable": record.durable})
  finally:
    saver.close()


def run_phase(ctl, sharding, state, spec: dict[str, Any], n: int, emit: Emit) -> None:
  key = f"bench/{n}"
  if spec["what"] == "feed":
    emit(feed_phase(ctl, sharding, spec, key))
  elif spec["what"] == "saves":
    save_phase(ctl, state, spec, key, emit)
  else:
    raise ValueError(f"unknown phase {spec!r}")


def trainer(control_dir: str) -> int:
  """One process of (B): runs each phase the parent writes into ``control_dir``."""
  sidecar.distributed.initialize()
  with sidecar.Controller.from_env(timeout=60) as ctl:
    me = ctl.process_index
    emit = lambda fig: print(MARK + json.dumps({"process": me, **fig}), flush=True)
    sharding = data_sharding(ctl)
    state = make_state(sharding)
    emit({"ready": True})
    for n in range(1, 1 << 30):
      path = os.path.join(control_dir, f"phase-{n}.json")
      while not os.path.exists(path):
        time.sleep(_POLL_S)
      with open(path) as f:
        spec = json.load(f)
      if spec["what"] == "exit":
        break
      run_phase(ctl, sharding, state, spec, n, emit)
      emit({"done": n})
  return 0


# ---- the parent: (A) in this process, (B) through sidecar launch ------------------------


class Single:
  """(A): this process owns both devices and drives a LocalCluster of 2 hosts."""

  name = "single"

  def __init__(self, shm_size: str):
    self.cluster = sidecar.testing.LocalCluster(num_hosts=HOSTS, devices_per_host=1,
                                                shm_size=shm_size, imports=IMPORTS).start()
    try:
      self.ctl = self.cluster.controller()
      self.sharding = data_sharding(self.ctl)
      self.state = make_state(self.sharding)
    except BaseException:
      self.cluster.close()
      raise
    self._n = 0

  def run(self, spec: dict[str, Any]) -> list[dict[str, Any]]:
    self._n += 1
    out: list[dict[str, Any]] = []
    run_phase(self.ctl, self.sharding, self.state, spec, self._n,
              lambda fig: out.append({"process": 0, **fig}))
    return out

  def close(self) -> None:
    self.ctl.close()
    self.cluster.close()


class Multi:
  """(B): ``sidecar launch`` of 2 trainers running ``trainer``; phases go through files."""

  name = "multi"

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
  """Removes the saved steps (the RAM tier keeps the last; the next phase's steps go on)."""
  for name in os.listdir(directory):
    shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def run_rounds(args, jobs: dict[str, Any], base: str) -> dict[str, list[dict[str, Any]]]:
  """Every phase in every job, round by round; returns each job's figures, with round."""
  results: dict[str, list[dict[str, Any]]] = {name: [] for name in jobs}
  names, step = list(jobs), 1
  for r in range(args.rounds):
    progress(f"round {r + 1} of {args.rounds}")
    phases = [{"what": "feed", "kind": k, "seconds": args.seconds, "warmup": args.warmup,
               "workers": args.workers, "prefetch": args.prefetch} for k in KINDS]
    phases.append({"what": "saves", "saves": args.saves})
    for spec in phases:
      for name in names[r % 2:] + names[:r % 2]:
        what = spec.get("kind", spec["what"])
        progress(f"  {name}: {what}")
        if spec["what"] == "saves":
          spec = {**spec, "directory": os.path.join(base, name), "first_step": step}
          os.makedirs(spec["directory"], exist_ok=True)
        figures = jobs[name].run(spec)
        if spec["what"] == "saves":
          step += 2 + args.saves
          clear_steps(spec["directory"])
        for fig in figures:
          if fig["figure"].startswith("feed"):
            progress(f"    process {fig['process']}: {fig['batches_per_s']:,.0f} batches/s, "
                     f"wait {fig['wait_ms']:.2f} ms/step")
        results[name] += [{**f, "round": r} for f in figures]
  return results


# ---- report ------------------------------------------------------------------------


def _med(xs) -> float:
  return statistics.median(list(xs))


def _spread(xs: list[float], fmt: str = "{:.2f}") -> str:
  return f"{fmt.format(min(xs))}-{fmt.format(max(xs))}"


def _by_process(figs: list[dict[str, Any]]) -> list[int]:
  return sorted({f["process"] for f in figs})


def feed_rows(results, rounds: int) -> tuple[list[tuple], dict[str, float]]:
  rows, ratios = [], {}
  for kind in KINDS:
    pick = lambda name, r, p=None, kind=kind: [
        f for f in results[name] if f["figure"] == f"feed/{kind}" and f["round"] == r
        and (p is None or f["process"] == p)]
    single = [pick("single", r)[0] for r in range(rounds)]
    procs = _by_process([f for f in results["multi"] if f["figure"] == f"feed/{kind}"])
    multi = {p: [pick("multi", r, p)[0] for r in range(rounds)] for p in procs}
    per_round = [min(multi[p][r]["batches_per_s"] for p in procs) / single[r]["batches_per_s"]
                 for r in range(rounds)]
    ratios[kind] = _med(per_round)
    rate = lambda figs: f"{_med(f['batches_per_s'] for f in figs):,.0f}"
    wait = lambda figs: f"{_med(f['wait_ms'] for f in figs):.2f}"
    rows.append((kind, rate(single), wait(single),
                 " / ".join(rate(multi[p]) for p in procs),
                 " / ".join(wait(multi[p]) for p in procs),
                 f"{ratios[kind]:.2f}x", _spread(per_round, "{:.2f}x")))
  return rows, ratios


def feed_table(results, rounds: int) -> tuple[str, dict[str, float]]:
  rows, ratios = feed_rows(results, rounds)
  return table(("elements", "(A) 1 process, 2 hosts: batches/s", "wait ms/step",
                "(B) 2 processes: batches/s, process 0 / 1", "wait ms/step, process 0 / 1",
                f"multi/single, slowest process (>= {TARGET_FEED_X:.2f}x)",
                "per round"), rows), ratios


def save_figures(results) -> dict[str, dict[str, list[float]]]:
  """Per job and figure: single; multi's process 0; multi's max over processes per save."""
  out: dict[str, dict[str, list[float]]] = {}
  for name, figs in results.items():
    saves = [f for f in figs if f["figure"] == "save"]
    memcpy = [f for f in figs if f["figure"] == "memcpy"]
    by_step: dict[int, list[dict]] = {}
    for f in saves:
      by_step.setdefault(f["step"], []).append(f)
    by_round: dict[int, list[dict]] = {}
    for f in memcpy:
      by_round.setdefault(f["round"], []).append(f)
    first = lambda fs, k: [f[k] for f in fs if f["process"] == 0]
    out[name] = {
        "p0 blocked": first(saves, "blocked"), "p0 durable": first(saves, "durable"),
        "p0 memcpy": first(memcpy, "seconds"),
        "max blocked": [max(f["blocked"] for f in fs) for fs in by_step.values()],
        "max durable": [max(f["durable"] for f in fs) for fs in by_step.values()],
        "max memcpy": [max(f["seconds"] for f in fs) for fs in by_round.values()]}
  return out


def save_table(results) -> tuple[str, float]:
  figs = save_figures(results)
  single, multi = figs["single"], figs["multi"]
  rows = []
  labels = (("memcpy", "the save's copies into private memory (reference)"),
            ("blocked", "blocked: save() returns"), ("durable", "durable, trainer idle"))
  for what, label in labels:
    a, p0, mx = _med(single[f"p0 {what}"]), _med(multi[f"p0 {what}"]), _med(multi[f"max {what}"])
    rows.append((label, f"{a:.3f}", _spread(single[f"p0 {what}"]), f"{p0:.3f}", f"{mx:.3f}",
                 _spread(multi[f"max {what}"]), f"{p0 / a:.2f}x", f"{mx / a:.2f}x"))
  blocked_x = _med(multi["max blocked"]) / _med(single["p0 blocked"])
  n = len(single["p0 blocked"])
  title = (f"1 GiB save, medians of {n} ({LEAVES} x {np.prod(LEAF_SHAPE) * 4 >> 20} MiB "
           "float32 over 2 devices)")
  return table((title, "(A) s", "min-max", "(B) process 0 s",
                "(B) max over processes s", "min-max", "multi/single, process 0",
                f"multi/single, max (blocked <= {TARGET_BLOCKED_X:.2f}x)"), rows), blocked_x


def report(results, rounds: int) -> None:
  feeds, feed_x = feed_table(results, rounds)
  saves, blocked_x = save_table(results)
  yes = lambda ok: "yes" if ok else "no"
  targets = table(("target (multi vs single)", "measured", "met"), [
      *((f"feed {k} batches/s >= {TARGET_FEED_X:.2f}x", f"{x:.2f}x", yes(x >= TARGET_FEED_X))
        for k, x in feed_x.items()),
      (f"blocked <= {TARGET_BLOCKED_X:.2f}x (max over processes)", f"{blocked_x:.2f}x",
       yes(blocked_x <= TARGET_BLOCKED_X))])
  for text in (feeds, saves, targets):
    print(text)
    print()


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every phase in both")
  ap.add_argument("--seconds", type=float, default=4.0, help="measured window of each feed")
  ap.add_argument("--warmup", type=float, default=feed_bench.WARMUP_S,
                  help="seconds each feed runs before its window (as benchmarks.feed)")
  ap.add_argument("--workers", type=int, default=2, help="feed workers per sidecar")
  ap.add_argument("--prefetch", type=int, default=4)
  ap.add_argument("--saves", type=int, default=4, help="measured saves per round and job")
  ap.add_argument("--dir", default=None, help="where the temp dir of checkpoints goes")
  ap.add_argument("--shm-size", default="1536MiB",
                  help="each sidecar's arena: its half of 2 states + slack")
  ap.add_argument("--trainer", default=None, help=argparse.SUPPRESS)  # a process of (B)
  args = ap.parse_args()
  if args.trainer is not None:
    sys.exit(trainer(args.trainer))
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
    results = run_rounds(args, jobs, base)
  finally:
    for job in reversed(list(jobs.values())):
      job.close()
    shutil.rmtree(base, ignore_errors=True)
  print(f"{HOSTS} hosts x 1 CPU device; (A) 1 process drives both, (B) 2 processes under "
        f"jax.distributed, 1 host each; {args.rounds} rounds, phases alternating between them; "
        f"feeds: global batch {feed_bench.BATCH}, workers={args.workers} per sidecar, "
        f"prefetch {args.prefetch}, {args.warmup:g} s warm-up, {args.seconds:g} s window\n")
  report(results, args.rounds)


if __name__ == "__main__":
  main()
