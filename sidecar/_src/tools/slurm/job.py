"""``sidecar slurm _job``: the driver of a batch job, run by its sbatch script.

It runs on the job's first node, in the batch step, and:

1. makes the job's rendezvous directory (mode 0700) with a fresh token file (0600);
2. starts the sidecars as a background step, ``srun --overlap`` with one task per node
   running that node's ``--hosts-per-node`` sidecars (tasks.py), and waits until every one
   serves: one that exits or does not come up fails the job at once, naming its node,
   its task and its log's last lines;
3. runs the trainers as a second step, one task per process (``--distribution=arbitrary``
   over a host file: each host's share of its node's tasks), each becoming CMD with the
   environment ``sidecar launch`` gives (tasks.py);
4. watches the sidecars meanwhile. A sidecar lost (its exit marker, or its health port
   silent for a few seconds: a lost node) ends the job; with ``--elastic`` it stops the
   trainers and starts them again beside the sidecars that remain, whose RAM tiers
   hold the last steps (as ``sidecar launch --elastic``), while at least ``--min-hosts``
   remain;
5. on exit, failure or ``scancel`` (SIGTERM) stops both steps and removes what it made in
   the directory (owned.py: a directory it did not make, it leaves; one that is not empty
   and not its own, it refuses at the start).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar._src.core import env as env_lib, errors, platform, rendezvous
from sidecar._src.tools import torchrun
from sidecar._src.tools.slurm import owned, tasks

_POLL_S = 0.25
_LOST_AFTER_S = 5.0  # a health port silent this long: its node is lost
_GRACE_S = 10.0
_LOG_TAIL_LINES = 30
# What a job writes in its rendezvous directory, all it removes there (owned.py).
ENTRIES = (rendezvous.JOB_FILE, rendezvous.TOKEN_FILE, rendezvous.PEER_TOKEN_FILE,
           rendezvous.HOSTS_DIR, rendezvous.LOGS_DIR, rendezvous.STEPS_DIR)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class JobOptions:
  """What ``sidecar slurm batch`` put in the script."""
  command: tuple[str, ...]
  hosts_per_node: int = 1
  shm_size: str = "1GiB"
  imports: tuple[str, ...] = ()
  checkpoint_roots: tuple[str, ...] = ()
  devices_per_task: int | None = None  # SIDECAR_LOCAL_DEVICES, CPU runs only
  elastic: bool = False
  min_hosts: int = 1
  start_timeout: float = 120.0


def say(text: str) -> None:
  print(f"sidecar slurm: {text}", file=sys.stderr, flush=True)


def node_names() -> list[str]:
  """The job's nodes, in Slurm's order (``scontrol show hostnames``)."""
  listed = os.environ.get("SLURM_JOB_NODELIST", "")
  done = subprocess.run(["scontrol", "show", "hostnames", listed], capture_output=True,
                        text=True, timeout=60)
  names = done.stdout.split()
  if done.returncode or not names:
    raise errors.InvalidArgumentError(
        f"cannot list the job's nodes (SLURM_JOB_NODELIST={listed!r}): {done.stderr.strip()}")
  return names


def tasks_per_node() -> int:
  text = os.environ.get("SLURM_NTASKS_PER_NODE", "").strip()
  if not text.isdigit():
    raise errors.InvalidArgumentError(
        f"SLURM_NTASKS_PER_NODE is {text!r}; submit with --ntasks-per-node (sidecar slurm "
        "batch writes it)")
  return int(text)


def log_tail(directory: str, host: int, lines: int = _LOG_TAIL_LINES) -> str:
  try:
    with open(tasks.paths(directory, host)[2], errors="replace") as f:
      return "\n".join(f"[sidecar {host}] {line}" for line in f.read().splitlines()[-lines:])
  except OSError:
    return f"[sidecar {host}] (no log)"


def _stop(proc: subprocess.Popen | None, step_name: str, grace: float = _GRACE_S, *,
          sig: signal.Signals = signal.SIGTERM) -> None:
  """Stops the step ``proc`` (an srun) runs: ``sig`` to its tasks (scancel --signal, so
  that they clean up: srun itself would kill them), SIGKILL to srun after ``grace``.

  slurmstepd reports a step signalled with SIGTERM or SIGKILL as cancelled, in the job's
  output (``error: *** STEP J.S ON NODE CANCELLED AT ... ***``); with another signal that
  its tasks take as a stop, the step ends by itself, unreported.
  """
  if proc is None or proc.poll() is not None:
    return
  job = os.environ.get("SLURM_JOB_ID", "")
  listed = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"],
                          capture_output=True, text=True, timeout=30)
  steps = [line.split()[0] for line in listed.stdout.splitlines()
           if line.split()[1:] == [step_name]]
  for step in steps:
    subprocess.run(["scancel", f"--signal={sig.name.removeprefix('SIG')}", step],
                   capture_output=True, timeout=30)
  if not steps:
    proc.send_signal(signal.SIGTERM)
  try:
    proc.wait(grace)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()


class Job:
  """One batch job's sidecars and trainers, by steps of this allocation."""

  def __init__(self, options: JobOptions):
    self.o = options
    self.job_id = os.environ.get("SLURM_JOB_ID", "")
    if not self.job_id:
      raise errors.InvalidArgumentError("sidecar slurm _job runs inside a Slurm batch job "
                                        "(SLURM_JOB_ID is not set)")
    self.nodes = node_names()
    self.per_node = tasks_per_node()
    if self.per_node % options.hosts_per_node:
      raise errors.InvalidArgumentError(
          f"--hosts-per-node {options.hosts_per_node} does not divide --ntasks-per-node "
          f"{self.per_node}")
    self.directory = rendezvous.job_dir() or ""
    self.claimed = False
    self.sidecars: subprocess.Popen | None = None
    self.trainers: subprocess.Popen | None = None
    self.live = list(range(len(self.nodes) * options.hosts_per_node))
    self.restart = 0
    self.interrupted = 0
    self.channels: dict[int, grpc.Channel] = {}
    self.silent_since: dict[int, float] = {}

  # ---- set up -------------------------------------------------------------

  def make_directory(self) -> None:
    """Takes the rendezvous directory (owned.py; a requeued job's earlier run there is
    cleared) and writes the job's files.

    Raises:
      InvalidArgumentError: the directory is not the job's to take (owned.claim).
    """
    owned.claim(self.directory, f"job {self.job_id}", ENTRIES,
                what=env_lib.SLURM_DIR if env_lib.get(env_lib.SLURM_DIR)
                else "the job's rendezvous directory")
    self.claimed = True
    for sub in (rendezvous.HOSTS_DIR, rendezvous.LOGS_DIR, rendezvous.STEPS_DIR):
      os.mkdir(os.path.join(self.directory, sub), 0o700)
    token = os.path.join(self.directory, rendezvous.TOKEN_FILE)
    rendezvous.make_token_file(token)
    rendezvous.make_token_file(os.path.join(self.directory, rendezvous.PEER_TOKEN_FILE))
    rendezvous.write_json(os.path.join(self.directory, rendezvous.JOB_FILE), {
        "job_id": self.job_id, "nodes": self.nodes, "num_hosts": len(self.live),
        "hosts_per_node": self.o.hosts_per_node, "tasks_per_node": self.per_node,
        "token_file": token})

  def start_sidecars(self) -> None:
    n = len(self.nodes)
    command = [sys.executable, "-m", "sidecar", "slurm", "_sidecars", "--dir", self.directory,
               "--hosts-per-node", str(self.o.hosts_per_node), "--shm-size", self.o.shm_size]
    command += [f"--checkpoint-root={r}" for r in self.o.checkpoint_roots]
    # The node's ranks share each of its sidecars: each gets about 1/P of the arena, so one
    # cannot take what the others need ($SIDECAR_SESSION_QUOTA wins, as sidecar serve reads it).
    share = torchrun.session_share(self.per_node // self.o.hosts_per_node)
    if share and not env_lib.get(env_lib.SESSION_QUOTA):
      command += ["--session-quota", share]
    for module in self.o.imports:
      command += ["--import", module]
    self.sidecars = subprocess.Popen(
        ["srun", "--overlap", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1",
         "--kill-on-bad-exit=0", "--job-name=sidecars", *command], stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + self.o.start_timeout
    while True:
      lost = self.check_sidecars(health=False)
      if lost is not None:
        raise errors.HostLostError(lost, host_id=-1)
      have = {e.host_id for e in rendezvous.read_hosts(self.directory)}
      if have >= set(self.live):
        break
      if time.monotonic() > deadline:
        missing = sorted(set(self.live) - have)
        raise errors.HostLostError(
            f"sidecar hosts {missing} were not serving {self.o.start_timeout:g} s after the "
            "start. Their logs end:\n" + "\n".join(log_tail(self.directory, h, 10)
                                                   for h in missing), host_id=missing[0])
      time.sleep(_POLL_S)
    for e in rendezvous.read_hosts(self.directory):
      say(f"sidecar host {e.host_id} (node {e.node}, pid {e.pid}) serves "
          f"{e.address}:{e.port} and unix://{e.socket}")

  # ---- watching -----------------------------------------------------------

  def check_sidecars(self, *, health: bool = True) -> str | None:
    """Why a sidecar of ``live`` is lost (marker, the step gone, a silent node), or None."""
    for h in self.live:
      marker = tasks.paths(self.directory, h)[1]
      if os.path.exists(marker):
        info = rendezvous.read_json(marker)
        return (f"sidecar host {h} (node {info.get('node')}, task {info.get('task')}) "
                f"{_how(int(info.get('code', -1)))}. Its log ends:\n"
                + log_tail(self.directory, h))
    if self.sidecars is not None and self.sidecars.poll() is not None:
      return (f"the sidecars' step (srun) ended with code {self.sidecars.returncode}. Their "
              "logs end:\n" + "\n".join(log_tail(self.directory, h, 10) for h in self.live))
    if health:
      entries = {e.host_id: e for e in rendezvous.read_hosts(self.directory)}
      for h in self.live:
        if h in entries and not self._healthy(entries[h]):
          since = self.silent_since.setdefault(h, time.monotonic())
          if time.monotonic() - since > _LOST_AFTER_S:
            return (f"sidecar host {h} (node {entries[h].node}) has not answered its health "
                    f"checks for {_LOST_AFTER_S:g} s: its node is lost")
        else:
          self.silent_since.pop(h, None)
    return None

  def _healthy(self, e: rendezvous.HostEntry) -> bool:
    channel = self.channels.get(e.host_id)
    if channel is None:
      channel = self.channels[e.host_id] = grpc.insecure_channel(
          f"{e.address}:{e.health_port}")
    try:
      reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                        timeout=1.0)
    except grpc.RpcError:
      return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING

  # ---- trainers -----------------------------------------------------------

  def start_trainers(self) -> None:
    """Starts trainer start ``restart``: each live host's share of its node's tasks."""
    share = self.per_node // self.o.hosts_per_node
    entries = {e.host_id: e for e in rendezvous.read_hosts(self.directory)}
    processes = [h for h in self.live for _ in range(share)]
    first_node = entries[processes[0]].node
    here = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    # JAX's coordinator and torch.distributed's store (MASTER_PORT), on the first process's
    # node: ports free a moment ago where that is this node, else derived from the job.
    seq = int(self.job_id) + self.restart
    port, torch_port = ((_free_port(), _free_port()) if first_node == here
                        else (61440 + seq % 4096, 57344 + seq % 4096))
    steps = os.path.join(self.directory, rendezvous.STEPS_DIR)
    plan = {"restart": self.restart, "coordinator": f"{entries[processes[0]].address}:{port}",
            "torch_master_port": torch_port, "processes": processes,
            "local_devices": self.o.devices_per_task}
    rendezvous.write_json(os.path.join(steps, f"{self.restart}.json"), plan)
    hostfile = os.path.join(steps, f"{self.restart}.hosts")
    with open(hostfile, "w") as f:
      f.write("".join(f"{entries[h].node}\n" for h in processes))
    command = [sys.executable, "-m", "sidecar", "slurm", "_trainer", "--dir", self.directory,
               "--step", str(self.restart), "--", *self.o.command]
    nodes = len({entries[h].node for h in processes})
    self.trainers = subprocess.Popen(
        ["srun", "--overlap", "--overcommit", f"--ntasks={len(processes)}", f"--nodes={nodes}",
         "--distribution=arbitrary", "--kill-on-bad-exit=1", "--label", "--job-name=trainers",
         *command], env={**os.environ, "SLURM_HOSTFILE": hostfile}, stdin=subprocess.DEVNULL)
    say(f"start {self.restart}: {len(processes)} trainer processes on hosts {self.live}: "
        + shlex.join(self.o.command))

  def supervise(self) -> int:
    """Runs the trainers to their end; restarts them on a lost sidecar with --elastic."""
    self.start_trainers()
    while True:
      assert self.trainers is not None
      if self.interrupted:
        say(f"got {signal.Signals(self.interrupted).name}; stopping every step")
        return 128 + self.interrupted
      code = self.trainers.poll()
      lost = self.check_sidecars()
      if lost is None and code is None:
        time.sleep(_POLL_S)
        continue
      if lost is None and code is not None and code != 0:
        # A trainer failed: a sidecar that died with it is the cause, and its exit
        # marker may be a moment behind.
        deadline = time.monotonic() + 2.0
        while lost is None and time.monotonic() < deadline:
          time.sleep(_POLL_S)
          lost = self.check_sidecars(health=False)
      if lost is None:
        if code == 0:
          say("the trainers exited 0")
          return 0
        say(f"the trainers' step ended with code {code}")
        return code or 1
      say(lost)
      gone = self._lost_hosts()
      left = [h for h in self.live if h not in gone]
      if not self.o.elastic or len(left) < self.o.min_hosts:
        extra = "" if not self.o.elastic else (
            f" ({len(left)} hosts would remain, fewer than --min-hosts {self.o.min_hosts})")
        say(f"stopping the job{extra}")
        return 1
      t0 = time.monotonic()
      _stop(self.trainers, "trainers")
      self.live, self.restart = left, self.restart + 1
      self.start_trainers()
      say(f"restart {self.restart}: hosts {sorted(gone)} lost; {len(left)} hosts remain, "
          f"trainers started again {time.monotonic() - t0:.2f} s after the loss")

  def _lost_hosts(self) -> set[int]:
    gone = {h for h in self.live if os.path.exists(tasks.paths(self.directory, h)[1])}
    gone |= {h for h, since in self.silent_since.items()
             if time.monotonic() - since > _LOST_AFTER_S}
    return gone or set(self.live)  # the whole sidecars' step is gone

  def on_signal(self, signum: int, frame) -> None:
    del frame
    self.interrupted = signum

  def close(self) -> None:
    """Stops the trainers, then the sidecars; removes what the job made in its directory
    (the directory too if it made it); idempotent."""
    _stop(self.trainers, "trainers")
    # SIGINT, which `sidecar slurm _sidecars` takes as SIGTERM: a successful job's output
    # then ends with its own last line, not slurmstepd's "STEP ... CANCELLED" error.
    _stop(self.sidecars, "sidecars", grace=_GRACE_S + 5,  # the sidecars' own grace first
          sig=signal.SIGINT)
    for channel in self.channels.values():
      channel.close()
    self.channels = {}
    if self.claimed:
      owned.release(self.directory, f"job {self.job_id}", ENTRIES)
      self.claimed = False


def _how(code: int) -> str:
  if code < 0:
    return f"was killed by {signal.Signals(-code).name}"
  return f"exited with code {code}"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("", 0))
    return s.getsockname()[1]


def run(options: JobOptions) -> int:
  """The batch job: sidecars, then trainers, then cleanup. Returns the exit code."""
  try:
    job = Job(options)
  except errors.SidecarError as e:
    say(str(e))
    return 2
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, job.on_signal)
  # As each trainer's node decides for itself (tasks.py); this is the first node's answer.
  say(platform.for_trainers(os.environ, devices=options.devices_per_task).summary)
  try:
    try:
      job.make_directory()
    except errors.SidecarError as e:
      say(f"no rendezvous directory: {e}")
      return 2
    try:
      job.start_sidecars()
    except errors.SidecarError as e:
      say(f"the sidecars did not start: {e}")
      return 1
    if job.interrupted:
      return 128 + job.interrupted
    return job.supervise()
  finally:
    job.close()
