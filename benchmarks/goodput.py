"""Goodput of the LM example under failures: the sidecar against Grain + Orbax, same run.

  python -m benchmarks.goodput [--quick] [--config tiny|chip] [--wall S] [--mtbf S]
                               [--failures kill,error,hang] [--stall-timeout S]
                               [--two-hosts] [--seed N] [--data DIR] [--out DIR]

From the repository root; not run by CI. Two systems train examples/lm's model on the
same corpus, in the same order, each for ``--wall`` seconds, under the same launcher
(``sidecar launch --hosts 1 --max-restarts R``, and the same ``--stall-timeout`` and
``--standby`` where given), with failures injected into the live trainer at the same
seeded times (exponential intervals of mean ``--mtbf`` from the job's start; the kinds
of ``--failures`` in turn, default ``kill`` only: ``goodput_job.py`` says how each
reaches the trainer):

  ours       examples/lm/train.py: the sidecar's feed, saves and RAM-tier restores; a
             hang is found by the launcher's stall detection (the sidecar sees every
             step) and restarted, an error rolled back in-process
             (``--recover-in-process``)
  baseline   examples/lm/train_baseline.py: Grain in-process, Orbax's async
             CheckpointManager with Grain's iterator state through its handler. An error
             ends its process and the launcher restarts it; a hang is never found: no
             sidecar sees its steps, and neither Grain, Orbax nor JAX has a watchdog (the
             field's: PyTorch's NCCL and AXLearn's, 600 s; none for a JAX trainer on
             one host). So it costs the rest of the window, and the failures after it are
             not injected (the report says which)
  floor      benchmarks/goodput_floor.py: a process that holds the device running the
             example's step (it also times the device-resident loop) is SIGKILLed; a
             fresh process, spawned once it is reaped, imports JAX, opens the device,
             puts a state and runs the step from JAX's persistent cache
             (``JAX_COMPILATION_CACHE_DIR``, set the same way for every process here):
             what every restart pays, the killed process's teardown included
             (``benchmarks.restart_floor`` measures it with a standby process too)

With ``--standby SYSTEM``, that system's launcher keeps its next process started, JAX
and ``PRELOAD``'s modules imported (``sidecar launch --standby``): a restart skips the
interpreter's start and those imports; its life counts from when it is told to run.
``--two-hosts`` adds a row: ours with ``--hosts 2`` (one trainer per host under
``jax.distributed`` on loopback), every failure of the schedule a SIGKILL of the last
host's trainer (an in-process rollback in one process of several needs all of them to
roll back together, which ``sidecar.jax.Recovery`` leaves to the user).

The save interval of each system comes from one rule and its own measured save cost:
a calibration run saving every ``k_cal`` steps against one that never saves gives the
training time lost per save ``c`` (``goodput_ledger.save_cost``); the interval is the
smallest ``k`` at which saving costs 1% of step time ``t``, ``k = ceil(100 * c / t)``, and
never below ``k_cal``. ``--rule young`` uses Young's optimum instead, ``sqrt(2 * c *
mtbf)`` seconds of steps between saves. ``--save-every SYSTEM=K`` gives an earlier run's
interval and skips that calibration; a run of that system to step 2 then compiles its
programs into the shared cache, so no system's timed run pays cold compiles that
another's found cached.

Goodput is computed the same way for both, from outside (``goodput_ledger.py``): the
metrics lines, the processes' starts (``/proc``), the failure times and the trainers'
``fault:`` lines. Productive time is the steps of the final lineage (each step's last
computation); badput splits into launch, startup, re-done work, stall, rollback, restart
gap and the step in flight at the end, and each failure is charged what it caused: the
report gives the cost per failure by kind against the floor. For ours the sidecar's own
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
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import goodput_floor, goodput_job, goodput_ledger as ledger
from benchmarks.common import table
from benchmarks.goodput_job import SYSTEMS, Job

ROOT = pathlib.Path(__file__).resolve().parents[1]
# With --standby SYSTEM: what its waiting process imports besides JAX (its trainer's next
# imports after JAX; model.py beside the script imports optax).
PRELOAD = {"ours": ["optax", "sidecar.jax"], "baseline": ["optax", "grain", "orbax.checkpoint"]}
NEVER = goodput_job.STEPS  # --save-every that never saves before the end
# Restarts beyond the failures: a TPU can refuse a process started just after another
# ended (docs/tpu.md); such a start fails, is restarted, and counts as startup badput.
RESTART_SLACK = 5
STALL_TIMEOUT = {"tiny": 8.0, "chip": 20.0}  # --stall-timeout's default where hangs are injected


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
  """One round of ``goodput_floor``: a holder SIGKILLed, then a fresh process."""
  for _ in range(tries - 1):
    try:
      return goodput_floor.one_round("fresh", config, env, resident_steps=steps)
    except RuntimeError as e:  # a device just released can refuse a process: once more
      print(f"the floor's round failed ({e}); again in 5 s", flush=True)
      time.sleep(5)
  return goodput_floor.one_round("fresh", config, env, resident_steps=steps)


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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true",
                 help="tiny config, 30 s per system, 1-2 failures: a couple of minutes on CPU")
  p.add_argument("--config", default="tiny", choices=("tiny", "chip"))
  p.add_argument("--wall", type=float, default=None,
                 help="seconds each system's job runs (default: 30 quick, else 300)")
  p.add_argument("--mtbf", type=float, default=None,
                 help="mean seconds between failures (default: 12 quick, else 90)")
  p.add_argument("--seed", type=int, default=0, help="seed of the failure times")
  p.add_argument("--failures", default="kill", metavar="KINDS",
                 help="the failures' kinds, in turn: a comma list of kill, error, hang "
                      "(default: kill). kill,error,hang puts a hang last: nothing ends "
                      "the baseline's")
  p.add_argument("--stall-timeout", type=float, default=None, metavar="SECONDS",
                 help="both systems' sidecar launch --stall-timeout (default: where hangs "
                      f"are injected {STALL_TIMEOUT['tiny']:g} tiny, "
                      f"{STALL_TIMEOUT['chip']:g} chip; else the launcher's)")
  p.add_argument("--two-hosts", action="store_true",
                 help="also run ours on 2 hosts, every failure a SIGKILL")
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
  args.systems = args.systems or list(SYSTEMS)
  if "ours" not in args.systems:
    p.error("--systems must include ours (the reference and the ledger are ours')")
  args.given = dict(item.split("=", 1) for item in args.save_every)
  if set(args.given) - set(SYSTEMS):
    p.error(f"--save-every names a system of {SYSTEMS}, got {sorted(args.given)}")
  args.kinds = tuple(k.strip() for k in args.failures.split(",") if k.strip())
  if not args.kinds or set(args.kinds) - set(ledger.KINDS):
    p.error(f"--failures takes a comma list of {', '.join(ledger.KINDS)}, got "
            f"{args.failures!r}")
  if args.quick:
    args.config = "tiny"
  tiny = args.config == "tiny"
  args.wall = args.wall or (30.0 if args.quick else 300.0)
  args.mtbf = args.mtbf or (12.0 if args.quick else 90.0)
  args.calibrate_steps = args.calibrate_steps or (150 if tiny else 80)
  args.resident_steps = args.resident_steps or (300 if tiny else 100)
  args.shm_size = args.shm_size or ("512MiB" if tiny else "12GiB")
  if args.stall_timeout is None and "hang" in args.kinds:
    args.stall_timeout = STALL_TIMEOUT[args.config]
  return args


class Bench:
  """One run of the benchmark: its work directory, its jobs, its report."""

  def __init__(self, args: argparse.Namespace, work: str):
    self.args, self.work = args, work
    self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        "JAX_COMPILATION_CACHE_DIR": os.path.join(work, "jax-cache")}
    self.failures = goodput_job.failure_schedule(seed=args.seed, mtbf=args.mtbf,
                                                 wall=args.wall, kinds=args.kinds)
    self.launch = () if args.stall_timeout is None else (
        "--stall-timeout", f"{args.stall_timeout:g}")
    self.inject = args.kinds != ("kill",)  # errors or hangs: the trainers catch the signals
    os.makedirs(args.out, exist_ok=True)
    self.path = os.path.join(args.out, time.strftime("goodput-%Y%m%d-%H%M%S.json"))
    self.started = time.time()
    self.report: dict = {
        "config": args.config, "wall_s": args.wall, "mtbf_s": args.mtbf, "seed": args.seed,
        "failures": list(args.kinds), "stall_timeout_s": args.stall_timeout,
        "standby": args.standby, "kill_at_s": [t for t, _ in self.failures],
        "failures_at_s": [list(f) for f in self.failures],
        "calibration": {"steps": args.calibrate_steps, "every": args.calibrate_every}}

  def say(self, text: str) -> None:
    print(f"[goodput {time.time() - self.started:6.1f}s] {text}", flush=True)

  def dump(self) -> None:  # after each phase: a run cut short still leaves what it measured
    with open(self.path, "w") as f:
      json.dump(self.report, f, indent=1)

  def job(self, system: str, name: str, save_every: int, *, hosts: int = 1) -> Job:
    trainer = (["--inject-faults"] if self.inject else []) + (
        ["--recover-in-process"] if system == "ours" and "error" in self.args.kinds else [])
    return Job(system, name=name, config=self.args.config, data=self.data, work=self.work,
               save_every=save_every, env=self.env, shm=self.args.shm_size,
               restarts=len(self.failures) + RESTART_SLACK, hosts=hosts,
               preload=PRELOAD[system] if system in self.args.standby else None,
               launch=self.launch, trainer=tuple(trainer))

  def prepare_data(self) -> None:
    self.data = self.args.data
    if self.data is None:
      self.data = os.path.join(self.work, "data")
      mb = self.args.data_mb or (2 if self.args.config == "tiny" else 32)
      subprocess.run([sys.executable, "examples/lm/prepare.py", "--out", self.data,
                      "--max-mb", str(mb)], cwd=ROOT, env=self.env, check=True,
                     stdout=subprocess.DEVNULL)

  def calibrate(self) -> None:
    """Each system's save interval (its calibration, or the one given) and its rates."""
    args, n_cal, k_cal = self.args, self.args.calibrate_steps, self.args.calibrate_every
    self.rates: dict[str, dict[str, float]] = {}
    self.calibration: dict[str, Job] = {}
    self.intervals: dict[str, tuple[int, float]] = {}  # system: (k, s lost a save)
    for system in [x for x in args.systems if x not in args.given]:
      self.say(f"{system}: calibration, no saves, to step {n_cal}")
      none = self.calibration[system] = self.job(system, f"{system}-none", NEVER).run(
          until_step=n_cal)
      self.say(f"{system}: calibration, saving every {k_cal}, to step {n_cal}")
      saving = self.job(system, f"{system}-cal", k_cal).run(until_step=n_cal)
      self.rates[system] = {"none": none.rate(), "saving": saving.rate()}
      lost, step_s = ledger.save_cost(saving.lines, none.lines, every=k_cal)
      self.intervals[system] = (save_interval(lost=lost, step_s=step_s, k_cal=k_cal,
                                              rule=args.rule, mtbf=args.mtbf), lost)
    for system, k in args.given.items():  # an earlier run's: its cost per save not measured
      self.intervals[system] = (int(k), float("nan"))
      self.rates.setdefault(system, {})
      # Calibration compiles each system's programs into the shared compilation cache;
      # without it the first system timed would pay the cold compiles (on the v5e ~23 s
      # at its first start, and ~11 s more at a restart whose predecessor died compiling)
      # and the next would find them cached.
      self.say(f"{system}: warming the compilation cache, no saves, to step 2")
      self.job(system, f"{system}-warm", NEVER).run(until_step=2)
    self.report["calibration"].update(rates=self.rates, intervals=self.intervals,
                                      rule=args.rule)
    self.dump()

  def timed_runs(self) -> None:
    """Each system's job under the failures (and ours on two hosts with --two-hosts)."""
    self.runs: dict[str, Job] = {}
    plan = [(s, s, 1, self.failures) for s in self.args.systems]
    if self.args.two_hosts:
      plan.append(("ours-2hosts", "ours", 2, tuple((t, "kill") for t, _ in self.failures)))
    for name, system, hosts, failures in plan:
      k, lost = self.intervals[system]
      self.say(f"{name}: save every {k} (lost per save {lost * 1e3:.1f} ms), "
               f"{self.args.wall:g} s, failures at {[list(f) for f in failures]}")
      self.runs[name] = self.job(system, f"{name}-failures", k, hosts=hosts).run(
          wall=self.args.wall, failures=failures)
      self.report[f"{name}_account"] = self.runs[name].account().to_dict()
      self.dump()


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  # SIGTERM (a timeout around the benchmark) unwinds as an exception: every launcher
  # started here is stopped, and the partial results stay written.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  work = tempfile.mkdtemp(prefix="goodput-")  # ours alone: removed at the end
  bench = Bench(args, work)
  try:
    bench.prepare_data()
    bench.calibrate()
    bench.timed_runs()
    runs = bench.runs
    own = {name: sidecar_ledger(runs[name].ckpt, bench.env) for name in runs
           if runs[name].system == "ours"}
    last = max(line.step for r in runs.values() for line in r.lines)
    reference = None
    bench.rates["ours"]["reference"] = float("nan")
    if not args.no_reference:
      bench.say(f"ours, no failures, no saves, to step {last}: the reference losses")
      reference = bench.job("ours", "ours-reference", NEVER).run(until_step=last)
      if "baseline" in bench.calibration:
        bench.report["same_order"] = ledger.loss_diffs(bench.calibration["baseline"].lines,
                                                       reference.lines)
      bench.rates["ours"]["reference"] = reference.rate()
    bench.say("floor: a process holding the device SIGKILLed, then a fresh one")
    floors = [floor(args.config, bench.env, steps=args.resident_steps)]
    cache = bench.env["JAX_COMPILATION_CACHE_DIR"]
    bench.report["compilation_cache_entries"] = (
        len(os.listdir(cache)) if os.path.isdir(cache) else 0)
    report_all(bench, own=own, reference=reference, floors=floors)
  finally:
    if args.keep_work:
      print(f"kept {work}")
    else:
      shutil.rmtree(work, ignore_errors=True)
  return 0


def report_all(bench: Bench, *, own: dict, reference: Job | None, floors: list[dict]) -> None:
  """Fills the report, prints its tables, writes the JSON."""
  args, runs, report, rates = bench.args, bench.runs, bench.report, bench.rates
  floor_s = floors[0]["first_step_s"]
  rows, accounts = [], {}
  for name, run in runs.items():
    a = accounts[name] = run.account()
    k_lost = bench.intervals[run.system]
    losses = ({"bit_exact": None, "max_abs_diff": float("nan")} if reference is None
              else ledger.loss_diffs(run.lines, reference.lines))
    pf = a.per_failure()
    above = (sum(pf.values()) - floor_s) if pf else 0.0
    report.pop(f"{name}_account", None)  # the partial record, now in full below
    report[name] = {
        "account": a.to_dict(), "save_every": k_lost[0], "lost_per_save_s": k_lost[1],
        "rates": rates.get(name, {}), "losses": losses, "kills": run.kills,
        "injected": run.injected, "not_injected": [list(f) for f in run.not_injected],
        "badput_per_failure_above_floor_s": above, "launch_exit": run.exit,
        "by_kind_vs_floor": {kind: {"cost_s": v["total_s"], "x_floor": v["total_s"] / floor_s,
                                    "above_floor_s": v["total_s"] - floor_s}
                             for kind, v in a.by_kind().items()}}
    if name in own:
      report[name]["sidecar_ledger"] = own[name]
    between = statistics.mean(a.rates) if a.rates else 0.0
    rows.append([name, _f(a.goodput, 3), _f(a.wall_s, 1), a.failures, a.steps,
                 k_lost[0], _f(k_lost[1] * 1e3, 1), _f(pf.get("startup", 0)),
                 _f(pf.get("redone", 0)), _f(pf.get("gap", 0)), _f(above), _f(between, 1),
                 "-" if losses["bit_exact"] is None else "yes" if losses["bit_exact"] else "no",
                 f"{losses['max_abs_diff']:.2e}"])
  rows.append(["floor", "", "", "", "", "", "", _f(floor_s), "", "", "", "", "", ""])
  report["floor"] = floors
  ours = accounts["ours"]
  ours_saving = statistics.mean(ours.rates) if ours.rates else 0.0
  resident_rate = floors[0].get("resident_steps_per_s", 0.0)
  report["no_failures"] = {
      "ours_no_saves_steps_per_s": rates["ours"]["reference"],
      "ours_saving_every_k_between_failures_steps_per_s": ours_saving,
      "ours_saving_every_k_cal_steps_per_s": rates["ours"].get("saving"),
      "device_resident_steps_per_s": resident_rate}
  print()
  print(f"goodput, config {args.config}, wall {args.wall:g} s per system, mtbf {args.mtbf:g} "
        f"s, seed {args.seed}, failures at {[list(f) for f in bench.failures]} s, save "
        f"interval rule {args.rule}"
        + ("" if args.stall_timeout is None else f", --stall-timeout {args.stall_timeout:g}")
        + (f", --standby for {', '.join(args.standby)}" if args.standby else ""))
  print(table(["system", "goodput", "wall s", "fails", "steps", "save every",
               "ms lost/save", "startup s/fail", "redone s/fail", "gap s/fail",
               "above floor s/fail", "steps/s", "loss bit-exact", "max |dloss|"], rows))
  print()
  print(table(["badput s", *ledger.CATEGORIES, "productive"],
              [[s, *(_f(accounts[s].badput_s[c]) for c in ledger.CATEGORIES),
                _f(accounts[s].productive_s)] for s in runs]))
  print()
  print(by_kind_table(accounts, runs, floor_s))
  print()
  print_summary(bench, accounts, own, floors, ours_saving, resident_rate)
  bench.dump()
  print(f"wrote {bench.path}")


def by_kind_table(accounts: dict[str, ledger.Account], runs: dict[str, Job],
                  floor_s: float) -> str:
  """Per failure, by kind: its parts, its cost, against the floor. A cost the window
  cut short (the job made no step after it) reads ``>=``."""
  rows = []
  for name, a in accounts.items():
    for kind, v in a.by_kind().items():
      pf, whole = v["per_failure_s"], v["recovered"] == v["failures"]
      cost = ("" if whole else ">=") + _f(v["total_s"])
      rows.append([name, kind, f"{v['failures']} ({v['recovered']} recovered)",
                   *(_f(pf.get(c, 0.0)) for c in ledger.CHARGED), cost,
                   _f(v["total_s"] / floor_s), _f(v["total_s"] - floor_s)])
    for t, kind in runs[name].not_injected:
      rows.append([name, kind, f"not injected (at {t:g} s)", *[""] * (len(ledger.CHARGED) + 3)])
  rows.append(["floor", "kill -> first step", "", "", "", "", "", "", _f(floor_s), "1.00", ""])
  return ("cost per failure, by kind (seconds; x floor: the cost over the floor's)\n"
          + table(["system", "kind", "failures", *(f"{c} s" for c in ledger.CHARGED),
                   "cost s/fail", "x floor", "above floor s"], rows))


def print_summary(bench: Bench, accounts: dict[str, ledger.Account], own: dict,
                  floors: list[dict], ours_saving: float, resident_rate: float) -> None:
  report, rates = bench.report, bench.rates
  g = {s: a.goodput for s, a in accounts.items()}
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
  for name, led in own.items():
    external = {k: accounts[name].to_dict()[k]
                for k in ("wall_s", "productive_s", "goodput", "badput_s")}
    own_line = f"sidecar's own ledger for {name}: "
    print(f"{own_line}{json.dumps(led)}")
    print(f"{f'external for {name}: ':<{len(own_line)}}{json.dumps(external)}")
  ratio = lambda a, b: a / b if b else float("nan")  # noqa: E731
  none = rates.get("baseline", {}).get("none", float("nan"))
  print(f"no failures, steps/s: device-resident loop {resident_rate:.1f}; ours no saves "
        f"{rates['ours']['reference']:.1f} "
        f"({ratio(rates['ours']['reference'], resident_rate):.3f}x); "
        f"ours saving every {bench.intervals['ours'][0]} {ours_saving:.1f} "
        f"({ratio(ours_saving, resident_rate):.3f}x); baseline no saves "
        f"{none:.1f} ({ratio(none, resident_rate):.3f}x)")
  for f in floors:
    print(f"floor ({f['mode']}), seconds from the SIGKILL: "
          + ", ".join(f"{k} {v:.2f}" for k, v in f["from_kill_s"].items())
          + f" (device tries {f['device_tries']}, {f['platform']})")
  print(f"JAX compilation cache entries after the run: {report['compilation_cache_entries']}")


if __name__ == "__main__":
  sys.exit(main())
