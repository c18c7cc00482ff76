"""Goodput of the LM example under SIGKILLs: the sidecar against Grain + Orbax, same run.

  python -m benchmarks.goodput [--quick] [--config tiny|chip] [--wall S] [--mtbf S]
                               [--seed N] [--data DIR] [--out DIR]

From the repository root; not run by CI. Two systems train examples/lm's model on the
same corpus, in the same order, each for ``--wall`` seconds, under the same launcher
(``sidecar launch --hosts 1 --max-restarts R``), with its trainer SIGKILLed at the same
seeded times (exponential intervals of mean ``--mtbf`` from the job's start; a kill that
falls while no trainer lives hits the next one as it appears):

  ours       examples/lm/train.py: the sidecar's feed, saves and RAM-tier restores
  baseline   examples/lm/train_baseline.py: Grain in-process, Orbax's async
             CheckpointManager with Grain's iterator state through its handler
  floor      benchmarks/goodput_floor.py: import JAX, open the device, one step compiled
             from JAX's persistent cache (``JAX_COMPILATION_CACHE_DIR``, set the same way
             for every process here): what any restart pays after the killed process is
             gone (``benchmarks.restart_floor`` times that teardown apart: SIGKILL to
             reaped, 1.7-3.0 s on the lent v5e, inside each system's gap here)

With ``--standby SYSTEM``, that system's launcher keeps its next process started, JAX
and ``PRELOAD``'s modules imported (``sidecar launch --standby``): a restart skips the
interpreter's start and those imports; its life counts from when it is told to run.

The save interval of each system comes from one rule and its own measured save cost:
a calibration run saving every ``k_cal`` steps against one that never saves gives the
training time lost per save ``c``: ``k_cal`` times the mean step of the saving run less the
mean step of the run without saves (steps over ten times their run's median left out:
the machine's scheduling, not a save; ``goodput_ledger.save_cost``); the interval is the
smallest ``k`` at which saving costs 1% of step time ``t``, ``k = ceil(100 * c / t)``, and
never below ``k_cal`` (below it the cost was not measured). ``--rule young`` uses Young's
optimum instead, ``sqrt(2 * c * mtbf)`` seconds of steps between saves.
``--save-every SYSTEM=K`` gives an earlier run's interval and skips that calibration; a
run of that system to step 2 then compiles its programs into the shared cache, so no
system's timed run pays cold compiles that another's found cached.

Goodput is computed the same way for both, from outside (``goodput_ledger.py``): the
metrics lines, the processes' starts (``/proc``) and the kill times. Productive time is
the steps of the final lineage (each step's last computation); badput splits into
launch, startup (start to first step: imports, device, restore, data resume, compile),
re-done work, restart gap and the step in flight at the end. For ours the sidecar's own
ledger (``sidecar goodput CKPT --json``) is printed beside it. The losses of every
computed step are compared with an uninterrupted run of ours (and the baseline's
uninterrupted calibration run with ours: the same order). Last, with no failures: ours'
steps/s (feed + saves) against the same step on one batch kept on the device.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import goodput_ledger as ledger
from benchmarks.common import table
from sidecar._src.controller import goodput as recorder
from sidecar._src.tools import standby

ROOT = pathlib.Path(__file__).resolve().parents[1]
SYSTEMS = {"ours": "examples/lm/train.py", "baseline": "examples/lm/train_baseline.py"}
# With --standby SYSTEM: what its waiting process imports besides JAX (its trainer's next
# imports after JAX; model.py beside the script imports optax).
PRELOAD = {"ours": ["optax", "sidecar.jax"], "baseline": ["optax", "grain", "orbax.checkpoint"]}
STEPS = 1_000_000  # --steps of every run: runs end by wall time or by a step reached
NEVER = STEPS  # --save-every that never saves before the end
POLL = 0.02
# Restarts beyond the kills: a TPU can refuse a process started just after another ended
# (docs/tpu.md); such a start fails, is restarted, and counts as startup badput.
RESTART_SLACK = 5


def _stat(pid: int) -> list[str] | None:
  try:
    text = pathlib.Path(f"/proc/{pid}/stat").read_text()
  except OSError:
    return None
  return text[text.rindex(")") + 2:].split()  # fields from the 3rd (state) on


def _cmdline(pid: int) -> str:
  try:
    return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
  except OSError:
    return ""


def _comm(pid: int) -> bytes:
  try:
    return pathlib.Path(f"/proc/{pid}/comm").read_bytes().strip()
  except OSError:
    return b""


def _trainers(launcher: int, script: str, named: set[int]) -> tuple[list[int], list[int]]:
  """Live (not zombie) children of ``launcher`` running ``script``: the trainers, and the
  standby processes waiting to be one (``sidecar launch --standby``), by their name
  (``standby.NAME``) while they wait. A standby process not yet named (``named``: the
  pids seen named, to which those seen running are added) is skipped for its first
  second: it may still be starting up. Seen late, a life's start moves time from its
  gap to its startup, not out of badput."""
  out: tuple[list[int], list[int]] = ([], [])
  for entry in os.scandir("/proc"):
    if not entry.name.isdigit():
      continue
    pid = int(entry.name)
    fields = _stat(pid)
    if not fields or int(fields[1]) != launcher or fields[0] == "Z":
      continue
    cmdline = _cmdline(pid)
    if script not in cmdline:
      continue
    waiting = _comm(pid) == standby.NAME
    if not waiting and "sidecar._src.tools.standby" in cmdline:
      if pid not in named and time.time() - recorder.process_start(pid) < 1.0:
        continue
      named.add(pid)  # a standby that runs: its life starts now, not at its spawn
    out[waiting].append(pid)
  return out


def _start_time(pid: int, seen: float) -> float:
  """When ``pid`` started, from /proc (10 ms ticks); ``seen`` where that looks wrong."""
  start = recorder.process_start(pid)  # now, where pid is gone
  return start if seen - 5 <= start <= seen + 0.05 else seen


class Job:
  """One ``sidecar launch`` of one system's trainer, watched, killed on schedule, stopped."""

  def __init__(self, system: str, *, name: str, config: str, data: str, work: str,
               save_every: int, env: dict, shm: str, restarts: int,
               preload: list[str] | None = None):
    self.system, self.script = system, SYSTEMS[system]
    self.dir = os.path.join(work, name)
    os.makedirs(self.dir)
    self.ckpt = os.path.join(self.dir, "ckpt")
    self.metrics = os.path.join(self.dir, "metrics.jsonl")
    self.log = os.path.join(self.dir, "launch.log")
    self.command = [
        sys.executable, "-m", "sidecar", "launch", "--hosts", "1", "--max-restarts",
        str(restarts), "--import", "pipelines.lm", "--shm-size", shm, "--checkpoint-root",
        work, *([] if preload is None else ["--standby", *(
            x for m in preload for x in ("--preload", m))]),
        "--", sys.executable, self.script, "--config", config, "--data", data,
        "--ckpt", self.ckpt, "--steps", str(STEPS), "--metrics", self.metrics,
        "--save-every", str(save_every)]
    self.env = env
    self.lives: dict[int, dict] = {}
    self.kills: list[float] = []
    self.standbys: set[int] = set()  # pids seen waiting: their life starts when they run

  def run(self, *, wall: float | None = None, until_step: int | None = None,
          kill_at: tuple[float, ...] = (), limit: float = 600) -> Job:
    """Runs until ``wall`` seconds have passed or step ``until_step`` is written."""
    with open(self.log, "w") as log:
      self.t0 = time.time()
      launcher = subprocess.Popen(self.command, cwd=ROOT, env=self.env, stdout=log,
                                  stderr=subprocess.STDOUT)
      try:
        self._watch_until(launcher, wall=wall, until_step=until_step,
                          kill_at=list(kill_at), limit=limit)
      finally:  # also on SIGTERM to the benchmark (SystemExit): stop what we started
        self.t_end = time.time()
        self.exit = launcher.poll()
        if self.exit is None:
          launcher.send_signal(signal.SIGTERM)  # it stops its trainers and sidecars
          try:
            launcher.wait(timeout=60)
          except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()
    for life in self.lives.values():
      if life["end"] is None:
        life["end"] = None if self.exit is None else self.t_end
    self.lines = ledger.read_lines(self.metrics)
    return self

  def _watch_until(self, launcher: subprocess.Popen, *, wall: float | None,
                   until_step: int | None, kill_at: list[float], limit: float) -> None:
    checked = 0.0
    while launcher.poll() is None:
      now = time.time()
      alive = self._watch(launcher.pid, now)
      if kill_at and now - self.t0 >= kill_at[0] and alive:
        os.kill(alive[-1], signal.SIGKILL)
        self.lives[alive[-1]].update(end=now, killed=True)
        self.kills.append(now - self.t0)
        kill_at.pop(0)
      if wall is not None and now - self.t0 >= wall:
        return
      if until_step is not None and now - checked > 0.25:
        checked = now
        lines = ledger.read_lines(self.metrics)
        if lines and lines[-1].step >= until_step:
          return
      if now - self.t0 > limit:
        return
      time.sleep(POLL)

  def _watch(self, launcher: int, now: float) -> list[int]:
    alive, waiting = _trainers(launcher, self.script, self.standbys)
    self.standbys.update(waiting)
    for pid in alive:
      if pid not in self.lives:
        start = now if pid in self.standbys else _start_time(pid, now)
        self.lives[pid] = {"start": start, "end": None, "killed": False}
    for pid, life in self.lives.items():
      if life["end"] is None and pid not in alive:
        life["end"] = now  # ended by itself (an error: see the launch log)
    return [pid for pid in alive if not self.lives[pid]["killed"]]

  def account(self) -> ledger.Account:
    lives = [ledger.Life(v["start"], v["end"], v["killed"]) for v in self.lives.values()]
    return ledger.account(self.lines, lives, t0=self.t0, t_end=self.t_end)

  def rate(self) -> float:
    return ledger.steady_rate(self.lines)


def kill_schedule(*, seed: int, mtbf: float, wall: float) -> tuple[float, ...]:
  """Offsets from a job's start: exponential intervals of mean ``mtbf``, within 90% of ``wall``."""
  rng, t, out = random.Random(seed), 0.0, []
  while True:
    t += rng.expovariate(1 / mtbf)
    if t >= 0.9 * wall:
      return tuple(out)
    out.append(round(t, 3))


def save_interval(*, lost: float, step_s: float, k_cal: int, rule: str = "1%",
                  mtbf: float = 0.0) -> int:
  """Steps between saves by ``rule``, from ``lost`` training seconds per save:

  ``"1%"``: saving costs 1% of step time, ``k = ceil(100 * lost / step_s)``; ``"young"``:
  Young's optimum for failures of mean interval ``mtbf``, ``sqrt(2 * lost * mtbf)``
  seconds of steps. Never below ``k_cal``, the interval the cost was measured at.
  """
  if rule == "1%":
    k = math.ceil(100 * lost / step_s)
  elif rule == "young":
    k = math.ceil(math.sqrt(2 * lost * mtbf) / step_s)
  else:
    raise ValueError(f"rule must be '1%' or 'young', got {rule!r}")
  return max(k_cal, k)


def floor(config: str, env: dict, *, steps: int, tries: int = 2) -> dict:
  for attempt in range(tries):
    spawned = time.time()
    out = subprocess.run([sys.executable, "-m", "benchmarks.goodput_floor", "--config",
                          config, "--spawned", repr(spawned), "--steps", str(steps)],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode == 0:
      return json.loads(out.stdout.strip().splitlines()[-1])
    if attempt + 1 < tries:  # a chip just released can refuse the next process: once more
      time.sleep(5)
  raise RuntimeError(f"the floor process failed ({out.returncode}): {out.stderr[-2000:]}")


def sidecar_ledger(ckpt: str, env: dict) -> dict | str:
  p = subprocess.run([sys.executable, "-m", "sidecar", "goodput", ckpt, "--json"], cwd=ROOT,
                     env=env, capture_output=True, text=True)
  if p.returncode:
    return f"sidecar goodput failed ({p.returncode}): {(p.stderr or p.stdout).strip()[-300:]}"
  try:
    return json.loads(p.stdout)
  except ValueError:
    return p.stdout.strip()[-300:]


def _f(x: float, digits: int = 2) -> str:
  return f"{x:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true",
                 help="tiny config, 30 s per system, 1-2 kills: a couple of minutes on CPU")
  p.add_argument("--config", default="tiny", choices=("tiny", "chip"))
  p.add_argument("--wall", type=float, default=None,
                 help="seconds each system's job runs (default: 30 quick, else 300)")
  p.add_argument("--mtbf", type=float, default=None,
                 help="mean seconds between kills (default: 12 quick, else 90)")
  p.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
  p.add_argument("--calibrate-steps", type=int, default=None,
                 help="steps of each calibration run (default: 150 tiny, 80 chip)")
  p.add_argument("--calibrate-every", type=int, default=10,
                 help="k_cal: steps between saves in the calibration runs")
  p.add_argument("--rule", default="1%", choices=("1%", "young"),
                 help="save interval from the measured cost c per save: '1%%' of step time, "
                      "or 'young': sqrt(2 c mtbf) (default: 1%%)")
  p.add_argument("--resident-steps", type=int, default=None,
                 help="steps of the device-resident loop (default: 300 tiny, 100 chip)")
  p.add_argument("--data", default=None,
                 help="a corpus from examples/lm/prepare.py (default: prepare one here)")
  p.add_argument("--data-mb", type=float, default=None,
                 help="MiB of corpus to prepare (default: 2 tiny, 32 chip)")
  p.add_argument("--shm-size", default=None, help="each sidecar's arena (default: 512MiB "
                 "tiny, 12GiB chip: the feed and the RAM tier's copies of the state)")
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"),
                 help="directory for goodput-<time>.json")
  p.add_argument("--keep-work", action="store_true", help="keep the checkpoints and logs")
  p.add_argument("--systems", action="append", choices=tuple(SYSTEMS),
                 help="the systems to run (repeatable; default: both)")
  p.add_argument("--no-reference", action="store_true",
                 help="skip the uninterrupted reference run (and so the loss comparison)")
  p.add_argument("--standby", action="append", default=[], choices=tuple(SYSTEMS),
                 help="run SYSTEM's launcher with --standby (its next process started ahead, "
                      "with PRELOAD's imports; repeatable; default: neither)")
  p.add_argument("--save-every", action="append", default=[], metavar="SYSTEM=K",
                 help="save interval of SYSTEM (ours, baseline) from an earlier run's "
                      "calibration; given for every system, the calibration is skipped")
  args = p.parse_args(argv)
  systems = args.systems or list(SYSTEMS)
  if "ours" not in systems:
    p.error("--systems must include ours (the reference and the ledger are ours')")
  given = dict(item.split("=", 1) for item in args.save_every)
  if set(given) - set(SYSTEMS):
    p.error(f"--save-every names a system of {SYSTEMS}, got {sorted(given)}")
  # SIGTERM (a timeout around the benchmark) unwinds as an exception: every launcher
  # started here is stopped, and the partial results stay written.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  if args.quick:
    args.config = "tiny"
  tiny = args.config == "tiny"
  wall = args.wall or (30.0 if args.quick else 300.0)
  mtbf = args.mtbf or (12.0 if args.quick else 90.0)
  n_cal = args.calibrate_steps or (150 if tiny else 80)
  k_cal = args.calibrate_every
  resident = args.resident_steps or (300 if tiny else 100)
  shm = args.shm_size or ("512MiB" if tiny else "12GiB")

  work = tempfile.mkdtemp(prefix="goodput-")  # ours alone: removed at the end
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
      "JAX_COMPILATION_CACHE_DIR": os.path.join(work, "jax-cache")}
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, time.strftime("goodput-%Y%m%d-%H%M%S.json"))
  report: dict = {"config": args.config, "wall_s": wall, "mtbf_s": mtbf, "seed": args.seed,
                  "calibration": {"steps": n_cal, "every": k_cal}}
  try:
    data = args.data
    if data is None:
      data = os.path.join(work, "data")
      mb = args.data_mb or (2 if tiny else 32)
      subprocess.run([sys.executable, "examples/lm/prepare.py", "--out", data, "--max-mb",
                      str(mb)], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    kills = kill_schedule(seed=args.seed, mtbf=mtbf, wall=wall)
    report["kill_at_s"] = list(kills)
    started = time.time()
    say = lambda text: print(f"[goodput {time.time() - started:6.1f}s] {text}", flush=True)

    def dump() -> None:  # after each phase: a run cut short still leaves what it measured
      with open(path, "w") as f:
        json.dump(report, f, indent=1)

    def job(system, name, save_every):
      return Job(system, name=name, config=args.config, data=data, work=work,
                 save_every=save_every, env=env, shm=shm,
                 restarts=len(kills) + RESTART_SLACK,
                 preload=PRELOAD[system] if system in args.standby else None)

    rates: dict[str, dict[str, float]] = {}
    calibration: dict[str, Job] = {}
    intervals: dict[str, tuple[int, float]] = {}  # system: (steps between saves, s lost a save)
    for system in [x for x in systems if x not in given]:
      say(f"{system}: calibration, no saves, to step {n_cal}")
      calibration[system] = job(system, f"{system}-none", NEVER).run(until_step=n_cal)
      say(f"{system}: calibration, saving every {k_cal}, to step {n_cal}")
      saving = job(system, f"{system}-cal", k_cal).run(until_step=n_cal)
      rates[system] = {"none": calibration[system].rate(), "saving": saving.rate()}
      lost, step_s = ledger.save_cost(saving.lines, calibration[system].lines, every=k_cal)
      intervals[system] = (save_interval(lost=lost, step_s=step_s, k_cal=k_cal,
                                         rule=args.rule, mtbf=mtbf), lost)
    for system, k in given.items():  # an earlier run's: its cost per save is not measured
      intervals[system] = (int(k), float("nan"))
      rates.setdefault(system, {})
      # Calibration compiles each system's programs into the shared compilation cache;
      # without it the first system timed would pay the cold compiles (on the v5e ~23 s
      # at its first start, and ~11 s more at a restart whose predecessor died compiling)
      # and the next would find them cached.
      say(f"{system}: warming the compilation cache, no saves, to step 2")
      job(system, f"{system}-warm", NEVER).run(until_step=2)
    report["calibration"].update(rates=rates, intervals=intervals, rule=args.rule)
    dump()
    runs, accounts = {}, {}
    for system in systems:
      k, lost = intervals[system]
      say(f"{system}: save every {k} (lost per save {lost * 1e3:.1f} ms), {wall:g} s, "
          f"kills at {list(kills)}")
      runs[system] = job(system, f"{system}-failures", k).run(wall=wall, kill_at=kills)
      accounts[system] = runs[system].account()
      report[f"{system}_account"] = accounts[system].to_dict()
      dump()
    own = sidecar_ledger(runs["ours"].ckpt, env)
    last = max(line.step for r in runs.values() for line in r.lines)
    reference = None
    rates["ours"]["reference"] = float("nan")
    if not args.no_reference:
      say(f"ours, no failures, no saves, to step {last}: the reference losses")
      reference = job("ours", "ours-reference", NEVER).run(until_step=last)
      if "baseline" in calibration:
        report["same_order"] = ledger.loss_diffs(calibration["baseline"].lines, reference.lines)
      rates["ours"]["reference"] = reference.rate()
    say("floor: twice (the first fills the compilation cache if the trainers' did not)")
    floors = [floor(args.config, env, steps=0), floor(args.config, env, steps=resident)]
    cache = env["JAX_COMPILATION_CACHE_DIR"]
    report["compilation_cache_entries"] = len(os.listdir(cache)) if os.path.isdir(cache) else 0

    floor_s = floors[-1]["first_step_s"]
    rows = []
    for system in systems:
      a, k_lost = accounts[system], intervals[system]
      losses = ({"bit_exact": None, "max_abs_diff": float("nan")} if reference is None
                else ledger.loss_diffs(runs[system].lines, reference.lines))
      pf = a.per_failure()
      above = (sum(pf.values()) - floor_s) if pf else 0.0
      report.pop(f"{system}_account", None)  # the partial record, now in full below
      report[system] = {
          "account": a.to_dict(), "save_every": k_lost[0], "lost_per_save_s": k_lost[1],
          "rates": rates[system], "losses": losses, "kills": runs[system].kills,
          "badput_per_failure_above_floor_s": above, "launch_exit": runs[system].exit}
      between = statistics.mean(a.rates) if a.rates else 0.0
      rows.append([system, _f(a.goodput, 3), _f(a.wall_s, 1), a.failures, a.steps,
                   k_lost[0], _f(k_lost[1] * 1e3, 1), _f(pf.get("startup", 0)),
                   _f(pf.get("redone", 0)), _f(pf.get("gap", 0)), _f(above),
                   _f(between, 1),
                   "-" if losses["bit_exact"] is None else "yes" if losses["bit_exact"] else "no",
                   f"{losses['max_abs_diff']:.2e}"])
    rows.append(["floor", "", "", "", "", "", "", _f(floor_s), "", "", "", "", "", ""])
    report["ours"]["sidecar_ledger"] = own
    report["floor"] = floors
    ours_saving = statistics.mean(accounts["ours"].rates) if accounts["ours"].rates else 0.0
    resident_rate = floors[-1].get("resident_steps_per_s", 0.0)
    report["no_failures"] = {
        "ours_no_saves_steps_per_s": rates["ours"]["reference"],
        "ours_saving_every_k_between_failures_steps_per_s": ours_saving,
        "ours_saving_every_k_cal_steps_per_s": rates["ours"].get("saving"),
        "device_resident_steps_per_s": resident_rate}

    print()
    print(f"goodput, config {args.config}, wall {wall:g} s per system, mtbf {mtbf:g} s, "
          f"seed {args.seed}, kills at {list(kills)} s, save interval rule {args.rule}")
    print(table(["system", "goodput", "wall s", "fails", "steps", "save every",
                 "ms lost/save", "startup s/fail", "redone s/fail", "gap s/fail",
                 "above floor s/fail", "steps/s", "loss bit-exact", "max |dloss|"], rows))
    print()
    print(table(["badput s", *ledger.CATEGORIES, "productive"],
                [[s, *(_f(accounts[s].badput_s[c]) for c in ledger.CATEGORIES),
                  _f(accounts[s].productive_s)] for s in systems]))
    print()
    g = {s: accounts[s].goodput for s in systems}
    if "baseline" in g:
      print(f"goodput ours - baseline: {100 * (g['ours'] - g['baseline']):+.1f} points; "
            f"badput above floor per failure ours/baseline: "
            f"{report['ours']['badput_per_failure_above_floor_s']:.2f} / "
            f"{report['baseline']['badput_per_failure_above_floor_s']:.2f} s")
    if "same_order" in report:
      print(f"same order: the baseline's uninterrupted losses against ours: "
            f"bit-exact {report['same_order']['bit_exact']}, max |dloss| "
            f"{report['same_order']['max_abs_diff']:.2e} over "
            f"{report['same_order']['compared']}")
    print(f"sidecar's own ledger for ours: {json.dumps(own)}")
    external = {k: accounts["ours"].to_dict()[k]
                for k in ("wall_s", "productive_s", "goodput", "badput_s")}
    print(f"external for ours:             {json.dumps(external)}")
    ratio = lambda a, b: a / b if b else float("nan")
    print(f"no failures, steps/s: device-resident loop {resident_rate:.1f}; ours no saves "
          f"{rates['ours']['reference']:.1f} "
          f"({ratio(rates['ours']['reference'], resident_rate):.3f}x); "
          f"ours saving every {intervals['ours'][0]} {ours_saving:.1f} "
          f"({ratio(ours_saving, resident_rate):.3f}x); baseline no saves "
          f"{rates.get('baseline', {}).get('none', float('nan')):.1f} "
          f"({ratio(rates.get('baseline', {}).get('none', float('nan')), resident_rate):.3f}x)")
    print(f"floor: {json.dumps(floors[-1])}; JAX compilation cache entries after the "
          f"run: {report['compilation_cache_entries']}")
    dump()
    print(f"wrote {path}")
  finally:
    if args.keep_work:
      print(f"kept {work}")
    else:
      shutil.rmtree(work, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
