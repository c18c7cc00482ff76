"""One system's job in ``benchmarks.goodput``: a ``sidecar launch`` watched from outside,
its failures injected on a seeded schedule, then stopped.

The schedule (:func:`failure_schedule`): failure times drawn as exponential intervals of
mean ``mtbf`` from the job's start, within 90% of its window; the i-th failure's kind is
the i-th of the kinds given, cycling (``kill,error,hang``: a kill, an error, a hang, a
kill, ...). Cycling, not drawing, so that a window of a few failures holds each kind, in
an order the run chooses: a baseline's hang, which nothing ends, goes last. The times are
the kill-only schedule's for the same seed.

How each kind reaches the live trainer (the one of process 0, which writes the metrics):

  kill    SIGKILL of the trainer (with several hosts, of the last host's: the launcher
          then stops the others), at its time, whenever a trainer lives (one that falls
          while none does hits the next one as it appears)
  error   ``trainers.INJECT["error"]``: the trainer's handler notes it and its next step
          raises (``examples/lm/trainers.py``, ``--inject-faults``)
  hang    ``trainers.INJECT["hang"]``: its next step never returns

An error or a hang is injected into a trainer that has made a step since it started and
since the failure before (before its first step a hang is a compile that never ends: no
watchdog, ours included, tells them apart) and that catches the signal; a later failure
waits behind one that waits. A hung trainer is no target: where nothing ends its hang (a
trainer whose steps no sidecar sees), the failures after it are never injected
(``not_injected``), and the hang costs the rest of the window.
"""

from __future__ import annotations

import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import time

from benchmarks import goodput_ledger as ledger
from sidecar._src.controller import goodput as recorder
from sidecar._src.core import env as env_lib, stacks
from sidecar._src.tools import standby

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "lm"))
import trainers  # noqa: E402 - examples/lm/trainers.py: the signals both trainers catch

SYSTEMS = {"ours": "examples/lm/train.py", "baseline": "examples/lm/train_baseline.py"}
STEPS = 1_000_000  # --steps of every run: runs end by wall time or by a step reached
POLL = 0.02
LINES_EVERY = 0.25  # how often the metrics file is read while a job runs
FAULT = re.compile(r"fault: injected (error|hang) in step (\d+) \(pid (\d+)\) at unix ([\d.]+)")


def kill_schedule(*, seed: int, mtbf: float, wall: float) -> tuple[float, ...]:
  """Offsets from a job's start: exponential intervals of mean ``mtbf``, within 90% of ``wall``."""
  rng, t, out = random.Random(seed), 0.0, []
  while True:
    t += rng.expovariate(1 / mtbf)
    if t >= 0.9 * wall:
      return tuple(out)
    out.append(round(t, 3))


def failure_schedule(*, seed: int, mtbf: float, wall: float,
                     kinds: tuple[str, ...] = ("kill",)) -> tuple[tuple[float, str], ...]:
  """``(offset, kind)`` of each failure: :func:`kill_schedule`'s times, the kinds cycling
  in the order given (see the module doc)."""
  unknown = [k for k in kinds if k not in ledger.KINDS]
  if not kinds or unknown:
    raise ValueError(f"failure kinds must be some of {', '.join(ledger.KINDS)}, got "
                     f"{','.join(kinds)!r}")
  times = kill_schedule(seed=seed, mtbf=mtbf, wall=wall)
  return tuple((t, kinds[i % len(kinds)]) for i, t in enumerate(times))


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


def _rank(pid: int) -> int:
  """The trainer's process index, from the environment it was started with."""
  try:
    environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
  except OSError:
    return 0
  prefix = env_lib.PROCESS_ID.encode() + b"="
  value = next((v[len(prefix):] for v in environ if v.startswith(prefix)), b"0")
  return int(value) if value.isdigit() else 0


def _trainers(launcher: int, script: str, named: set[int]) -> tuple[list[int], list[int]]:
  """Live (not zombie) children of ``launcher`` running ``script``: the trainers, and the
  standby processes waiting to be one (``sidecar launch --standby``), by their name
  (``standby.NAME``) while they wait. A standby process runs the trainer only once it was
  seen waiting (``named``: the pids seen so): before, it is still starting up, however
  long that takes on a loaded machine (it names itself once its own imports are done,
  and waits named through its preloads, seconds). Seen late, a life's start moves time
  from its gap to its startup, not out of badput."""
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
    if waiting:
      named.add(pid)
    elif "sidecar._src.tools.standby" in cmdline and pid not in named:
      continue  # not yet named: starting up
    out[waiting].append(pid)
  return out


def _start_time(pid: int, seen: float) -> float:
  """When ``pid`` started, from /proc (10 ms ticks); ``seen`` where that looks wrong."""
  start = recorder.process_start(pid)  # now, where pid is gone
  return start if seen - 5 <= start <= seen + 0.05 else seen


class Job:
  """One ``sidecar launch`` of one system's trainer, watched, failed on schedule, stopped.

  ``launch``: the launcher's flags besides the hosts, restarts and sidecars' (say
  ``--stall-timeout 8``); ``trainer``: the trainer's besides the run's own (say
  ``--inject-faults``); ``preload``: with it, the launcher's ``--standby`` with these
  modules preloaded.
  """

  def __init__(self, system: str, *, name: str, config: str, data: str, work: str,
               save_every: int, env: dict, shm: str, restarts: int, hosts: int = 1,
               preload: list[str] | None = None, launch: tuple[str, ...] = (),
               trainer: tuple[str, ...] = ()):
    self.system, self.script = system, SYSTEMS[system]
    self.dir = os.path.join(work, name)
    os.makedirs(self.dir)
    self.ckpt = os.path.join(self.dir, "ckpt")
    self.metrics = os.path.join(self.dir, "metrics.jsonl")
    self.log = os.path.join(self.dir, "launch.log")
    self.command = [
        sys.executable, "-m", "sidecar", "launch", "--hosts", str(hosts), "--max-restarts",
        str(restarts), "--import", "pipelines.lm", "--shm-size", shm, "--checkpoint-root",
        work, *launch, *([] if preload is None else ["--standby", *(
            x for m in preload for x in ("--preload", m))]),
        "--", sys.executable, self.script, "--config", config, "--data", data,
        "--ckpt", self.ckpt, "--steps", str(STEPS), "--metrics", self.metrics,
        "--save-every", str(save_every), *trainer]
    self.env = env
    self.lives: dict[int, dict] = {}  # process 0's trainers: start, end, failure, hung
    self.ranks: dict[int, tuple[int, float]] = {}  # every trainer: (rank, start)
    self.kills: list[float] = []  # offsets of the SIGKILLs
    self.injected: list[dict] = []  # every failure injected: kind, at (offset), pid
    self.not_injected: list[tuple[float, str]] = []
    self.standbys: set[int] = set()  # pids seen waiting: their life starts when they run
    self.lines: list[ledger.Line] = []  # the metrics file's, as read so far
    self.alive: list[int] = []  # every trainer alive at the last look
    self._read = 0  # bytes of the metrics file read while it runs
    self._last_line = 0.0  # the time of the newest step line seen while it runs

  def run(self, *, wall: float | None = None, until_step: int | None = None,
          failures: tuple[tuple[float, str], ...] = (), limit: float = 600) -> Job:
    """Runs until ``wall`` seconds have passed or step ``until_step`` is written,
    injecting ``failures`` (``(offset, kind)``, in order)."""
    pending = list(failures)
    with open(self.log, "w") as log:
      self.t0 = time.time()
      launcher = subprocess.Popen(self.command, cwd=ROOT, env=self.env, stdout=log,
                                  stderr=subprocess.STDOUT)
      try:
        self._watch_until(launcher, wall=wall, until_step=until_step, pending=pending,
                          limit=limit)
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
    self.not_injected = pending
    for life in self.lives.values():
      if life["end"] is None:
        life["end"] = None if self.exit is None else self.t_end
    self.lines = ledger.read_lines(self.metrics)
    return self

  def _watch_until(self, launcher: subprocess.Popen, *, wall: float | None,
                   until_step: int | None, pending: list[tuple[float, str]],
                   limit: float) -> None:
    checked = 0.0
    while launcher.poll() is None:
      now = time.time()
      alive = self._watch(launcher.pid, now)
      if now - checked > LINES_EVERY:
        checked = now
        self._read_lines()
        if until_step is not None and self.lines and self.lines[-1].step >= until_step:
          return
      if pending and now - self.t0 >= pending[0][0] and self._inject(pending[0][1], alive,
                                                                     now):
        pending.pop(0)
      if wall is not None and now - self.t0 >= wall:
        return
      if now - self.t0 > limit:
        return
      time.sleep(POLL)

  def _read_lines(self) -> None:
    """Reads what the metrics file gained (whole lines only) into ``self.lines``."""
    try:
      with open(self.metrics, "rb") as f:
        f.seek(self._read)
        data = f.read()
    except FileNotFoundError:
      return
    whole = data[:data.rfind(b"\n") + 1]
    self._read += len(whole)
    self.lines += [line for text in whole.decode(errors="replace").splitlines()
                   if (line := ledger.parse_line(text)) is not None]
    if self.lines:
      self._last_line = self.lines[-1].time

  def _watch(self, launcher: int, now: float) -> list[int]:
    """Notes trainers that started or ended; returns process 0's live trainers that no
    failure has hit."""
    alive, _ = _trainers(launcher, self.script, self.standbys)
    for pid in alive:
      if pid not in self.ranks:
        start = now if pid in self.standbys else _start_time(pid, now)
        self.ranks[pid] = (_rank(pid), start)
        if self.ranks[pid][0] == 0:
          self.lives[pid] = {"start": start, "end": None, "failure": None, "hung": False}
    for pid, life in self.lives.items():
      if life["end"] is None and pid not in alive:
        life["end"] = now  # ended by itself (an error, a stall's kill: see the launch log)
    self.alive = alive
    return [pid for pid in alive if pid in self.lives and self.lives[pid]["end"] is None
            and self.lives[pid]["failure"] is None and not self.lives[pid]["hung"]]

  def _inject(self, kind: str, targets: list[int], now: float) -> bool:
    """Injects a failure of ``kind`` into the newest of ``targets`` if it can now (the
    module doc); whether it did."""
    if not targets:
      return False
    pid = targets[-1]
    life = self.lives[pid]
    if kind == "kill":
      start = life["start"] - 2.0  # its peers of the same start (several hosts)
      peers = [p for p in self.alive if self.ranks[p][1] >= start]
      victim = max(peers, key=lambda p: self.ranks[p][0])
      os.kill(victim, signal.SIGKILL)
      life["failure"] = "kill"
      if victim == pid:
        life["end"] = now
      self.kills.append(now - self.t0)
    else:
      since = max([life["start"]] + [self.t0 + x["at"] for x in self.injected])
      sig = trainers.INJECT[kind]
      # Unknown (no SigCgt in /proc: gVisor, the TPU host) is taken as armed: the trainer
      # arms the signals before its first step, and a step was seen since it started.
      if self._last_line <= since or stacks.catches(pid, sig) is False:
        return False
      os.kill(pid, sig)
      life["hung"] = kind == "hang"
    self.injected.append({"kind": kind, "at": now - self.t0, "pid": pid})
    return True

  def faults(self) -> list[dict]:
    """The trainers' ``fault:`` lines in the launch log: kind, step, pid, time."""
    try:
      text = pathlib.Path(self.log).read_text(errors="replace")
    except OSError:
      return []
    return [{"kind": m.group(1), "step": int(m.group(2)), "pid": int(m.group(3)),
             "time": float(m.group(4))} for m in FAULT.finditer(text)]

  def life_records(self) -> list[ledger.Life]:
    """Each life of process 0 for the ledger: how it ended, the errors it survived."""
    faults = self.faults()
    out = []
    for pid, life in self.lives.items():
      failure, caught = life["failure"], []
      for f in (f for f in faults if f["pid"] == pid):
        after = any(line.time > f["time"] for line in self.lines
                    if life["end"] is None or line.time < life["end"])
        if f["kind"] == "hang":
          failure = "hang"
        elif after:
          caught.append(f["time"])  # rolled back in-process: it stepped on
        elif failure is None:
          failure = "error"  # it ended with the error
      out.append(ledger.Life(life["start"], life["end"], failure, tuple(caught)))
    return out

  def account(self) -> ledger.Account:
    return ledger.account(self.lines, self.life_records(), t0=self.t0, t_end=self.t_end)

  def rate(self) -> float:
    return ledger.steady_rate(self.lines)
