"""``sidecar launch``: N sidecars and N trainer processes on this machine, supervised together.

The local multi-process mode, in the spirit of ``torchrun``: a LocalCluster of sidecars, then
one copy of the user's command per host, each in its own process group with the environment
that ``sidecar.jax.initialize()``, ``Worker`` and ``Controller.from_env()`` read
(``env.py`` lists it). Each trainer's output comes back line by line, prefixed ``[host i] ``.
The first failure (a trainer exiting non-zero, a sidecar dying, SIGINT or SIGTERM to the
launcher) stops everything else, and decides the exit code. With ``max_restarts``, a failed
trainer instead restarts every trainer beside the same sidecars, as torchrun's restarts,
until ``max_restarts`` restarts are spent. With ``elastic``, a lost host
(its trainer failed or its sidecar died) instead restarts the trainers of the hosts that
remain as a job of one process fewer, beside the same sidecars, whose RAM tiers survive.

Example::

  code = launch.run([sys.executable, "train.py"], hosts=2, devices_per_host=4)
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import BinaryIO, TextIO

from sidecar._src.core import env as env_lib, errors, platform, stall as stall_lib
from sidecar._src.tools import (
  drain,
  sidecar_logs,
  standbys as standbys_lib,
  torchrun,
  trainers,
  watchdog as watchdog_lib,
)
from sidecar._src.tools.launch_env import (  # noqa: F401 - launch.free_port etc., as before
  PREEMPTION_SERVICE,
  free_port,
  loopback_tcp,
  trainer_env,
)
from sidecar._src.tools.local import STOP_GRACE_S, LocalCluster
from sidecar._src.tools.supervisor import Supervisor

DEFAULT_MAX_RESTARTS = 4  # --elastic --in-place restarts, as the manifests' backoffLimit
# Without --elastic: none, as torchrun's default; the first failure ends the job.
DEFAULT_GRACE = 5.0  # seconds between SIGTERM and SIGKILL when stopping trainers
# Seconds the sidecars may take to write the steps they accepted once the trainers are
# stopped: under a scheduler's own kill timeout, if any (Slurm's KillWait, k8s's grace).
DEFAULT_SAVE_GRACE = 60.0
_STOP_NOW_S = 1.0  # SIGTERM to SIGKILL of the sidecars after a second signal: no waiting

HELP = f"""\
Starts --hosts sidecars on this machine, then --hosts copies of CMD ("trainers"), one per
host (or --procs-per-host per host), each in its own session and process group, stdin
from /dev/null. Trainer i's stdout and stderr come back merged, line by line, prefixed
"[host i] ".

Each trainer gets this environment added to the launcher's:
{chr(10).join(f"  {name:29} {text}" for name, text in env_lib.DESCRIPTIONS.items()
               if name != env_lib.TOKEN_FILE)}
  JAX_PLATFORMS                 yours if set; else unset where an accelerator is here
                                (/dev/accel*, /dev/vfio/N, a TPU on PCI, TPU_* variables,
                                /dev/nvidiaN), so JAX picks it; else cpu, with
                                --devices-per-host CPU devices (XLA_FLAGS gets
                                --xla_force_host_platform_device_count=N). The first line
                                says which. The sidecars run JAX on the CPU whatever is set:
                                they never take the chip
  PYTHONUNBUFFERED              1, unless already set
  JAX_ENABLE_PREEMPTION_SERVICE false, unless already set: JAX's preemption notifier
                                catches SIGTERM, so a stopped trainer would run on until
                                the SIGKILL after the grace
  JAX_COMPILATION_CACHE_DIR     with restarts (--max-restarts, --elastic), unless already
                                set: a directory of this launch (gone at its end), so a
                                restarted trainer loads what the one before it compiled
                                from JAX's persistent cache instead of compiling it again
with SIDECAR_COORDINATOR_ADDRESS=127.0.0.1:<free port> (none for a job of one process, which
runs without jax.distributed), SIDECAR_HOST_ID=SIDECAR_PROCESS_ID=i,
SIDECAR_SLICE_ID=0, SIDECAR_LOCAL_DEVICES=--devices-per-host, SIDECAR_RESTART=0. SIDECAR_TOKEN
is set when there is a token: from --token-file, else $SIDECAR_TOKEN or $SIDECAR_TOKEN_FILE of
the launcher. The sidecars get no device ids: each learns its own from the trainer that
attaches to it.

With --procs-per-host P, P trainers run beside each sidecar (one per accelerator, as
torchrun --nproc-per-node P), each attaching its own Worker session to that sidecar: host
i's trainers are ranks i*P..i*P+P-1 (SIDECAR_PROCESS_ID), all with SIDECAR_HOST_ID=i,
SIDECAR_NUM_PROCESSES=N*P, and their lines are prefixed "[host i rank r] ". Each rank's
session may hold about 1/P of its sidecar's arena (the sidecars get --session-quota 0.96/P,
0.12 for 8, unless SIDECAR_SESSION_QUOTA is set): one rank cannot take what the others need.

{torchrun.LAUNCH_HELP}
Exit code: 0 if every trainer exits 0; otherwise the first failure's: a trainer's non-zero
exit code (128+N if signal N killed it), a dead sidecar's code by the same rule (1 if it
exited 0), 130 for SIGINT (Ctrl-C) and 143 for SIGTERM to the launcher, whether or not the
steps it then waited for were written; 1 if the sidecars do not start, 127 if CMD is not
found (or is `python SCRIPT` with no such SCRIPT: nothing starts), 126 if it cannot be run.

Each sidecar's output goes to --log-dir's DIR/RUN/host<i>.log (named in the first lines,
kept after the job); its WARNING, ERROR and CRITICAL lines (and a traceback after one) show
here as they are written, prefixed "[sidecar i] ".

When one trainer fails or one sidecar dies (its log's last lines are printed, prefixed
"[sidecar i] "), or on SIGINT/SIGTERM, every other trainer's process group gets SIGTERM,
then SIGKILL after {DEFAULT_GRACE:g} s. Then, at the end of every job, the launcher waits up
to --save-grace seconds for the steps the sidecars accepted to be written (a sidecar writes
them, and commits a step one host holds, whether or not its trainer is still there),
saying so ("waiting up to 60 s for step 200 on host 0 to be written"); a SIGINT or SIGTERM
during the wait ends it at once. Steps not written by then, or never committed, are named as
abandoned. Then the sidecars stop. No process, socket, temporary directory or shared
memory is left behind. A trainer that exits 0 leaves the others running.

With --max-restarts N (default 0, as torchrun's), a trainer that fails (an exit code other
than 0, or a signal) does not end the job while restarts are left: every other trainer is
stopped (SIGTERM, SIGKILL after the grace) and all of them start again with the same
environment, but SIDECAR_RESTART one higher (TORCHELASTIC_RESTART_COUNT with --torch) and
a fresh coordinator port, beside the same sidecars: their arenas and RAM tiers keep
running, so the new trainers restore the latest step from host memory. The feeds of the
stopped trainers end in their sidecars as their connections drop, and their feed worker
processes with them. Each restart is logged here with its count, its cause (which host
and rank, the exit code or the signal) and the seconds from the failure to the new
trainers' start. The failure after N restarts ends the job with that trainer's exit code.
A sidecar that dies still ends the job (unless --elastic says otherwise).

{watchdog_lib.HELP}
With --elastic, losing a host does not end the job. When host H's trainer fails or its
sidecar dies, every trainer is stopped (SIGTERM, SIGKILL after the grace), H's sidecar is
stopped if it still runs, and the trainers of the other hosts start again as a job of one
host fewer, while their sidecars keep running, with their arenas and RAM tiers: so the
new job can restore the latest step from host memory. The new job's environment:
SIDECAR_PROCESS_ID 0..N-2 in host order, SIDECAR_NUM_PROCESSES=N-1, a fresh coordinator
port, SIDECAR_HOSTS listing only the hosts that remain, SIDECAR_ADDRESS each one's own
sidecar, SIDECAR_RESTART=1 (2 after the next loss, ...). Host ids and the "[host H] "
prefixes stay those of the sidecars. Each restart is logged here: the host lost and why,
the new process count, and the seconds from the loss to the new trainers' start. The job
restarts so while at least --min-hosts hosts (default 1) remain; on the loss that leaves
fewer, it ends with that failure's exit code, as without --elastic. A trainer that exits 0
everywhere still ends the job with 0, and SIGINT/SIGTERM still stop everything.

With --elastic --in-place, the job restarts at its full size instead, as the manifests in
k8s/ restart a pod's containers in place: a failed trainer restarts every trainer beside
the same sidecars; a dead sidecar is started again first, as a new process with an empty
arena at the same addresses (a native sidecar's restart), so the new job restores the
lost host's shards from its peers' replicas (or storage) and the others' from their own
RAM tiers. Process ids, SIDECAR_NUM_PROCESSES and SIDECAR_HOSTS stay as they were;
SIDECAR_RESTART counts the restarts. After --max-restarts of them (default
{DEFAULT_MAX_RESTARTS}, as the manifests' backoffLimit) the next failure ends the job.
"""


class _Interrupted(BaseException):
  """SIGINT/SIGTERM while the sidecars start: unwinds LocalCluster.start, which cleans up."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum


def run(command: Sequence[str], *, hosts: int = 2, devices_per_host: int = 1,
        imports: Sequence[str] = (), shm_size: int | str = "256MiB", token: str | None = None,
        grace: float = DEFAULT_GRACE, elastic: bool = False, min_hosts: int = 1,
        in_place: bool = False, max_restarts: int | None = None,
        procs_per_host: int = 1, torch: bool = False, standby: Sequence[str] | None = None,
        stall_timeout: float = stall_lib.DEFAULT_FLOOR_S,
        checkpoint_roots: Sequence[str] | None = None, stdout: BinaryIO | None = None,
        stderr: TextIO | None = None, transport: str = "unix", log_dir: str | None = None,
        save_grace: float = DEFAULT_SAVE_GRACE) -> int:
  """Runs ``command`` ``procs_per_host`` times per host beside a LocalCluster of sidecars;
  returns the exit code.

  See ``HELP`` for the environment each process gets and the exit code rule. SIGINT and
  SIGTERM are handled (and restored afterwards) only when called from the main thread.

  Args:
    command: the program and its arguments, e.g. ``[sys.executable, "train.py"]``.
    hosts: how many sidecars and trainers.
    devices_per_host: CPU devices of each trainer (``SIDECAR_LOCAL_DEVICES``).
    imports: modules every sidecar imports, so their decorators register.
    shm_size: each sidecar's arena size.
    token: the sidecars' bearer token, also given to the trainers; default none.
    grace: seconds between SIGTERM and SIGKILL when stopping trainers.
    elastic: when a host is lost, restart the trainers of the others as a smaller job.
    min_hosts: with ``elastic``, the fewest hosts to restart on; below, the job ends.
    in_place: with ``elastic``, restart at full size: a dead sidecar is started again
      (empty) and every trainer restarts, as Kubernetes restarts containers in place.
    max_restarts: how many restarts at most; the next failure ends the job. Without
      ``elastic``, a failed trainer restarts every trainer beside the same sidecars (a
      dead sidecar still ends the job); default 0, as torchrun's. With ``in_place``, the
      same, and a dead sidecar is started again; default ``DEFAULT_MAX_RESTARTS``. Not
      with ``elastic`` alone, which restarts while ``min_hosts`` remain.
    procs_per_host: trainer processes beside each sidecar (one per accelerator, as
      ``torchrun --nproc-per-node``), each with its own Worker session.
    torch: also set torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
      ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``, ...).
    standby: with restarts, start each trainer's next process ahead, while the job
      trains: it imports JAX (where installed) and these modules, then waits; a restart
      hands it the new environment and it runs ``command`` (``tools/standby.py``). The
      command must be ``PYTHON SCRIPT ...`` or ``PYTHON -m MODULE ...``. None: off.
    stall_timeout: a trainer that makes no step for this long (or 10x its slowest step
      seen, if more) after its first is stalled: its stacks are printed, it is killed and
      restarted as a crash (``core/stall.py``); 0: never. Default 120 s.
    checkpoint_roots: the directories every sidecar may checkpoint in; default the temp
      directory and the working directory (``LocalCluster``'s).
    stdout: where the prefixed trainer output goes (bytes); default this process's stdout.
    stderr: where the launcher's own messages go; default this process's stderr.
    transport: how trainers reach the sidecars: ``"unix"`` sockets (no ports), or ``"tcp"``
      on loopback ports (``LocalCluster``'s). jax.distributed's coordinator is TCP either way.
    log_dir: keep the sidecars' logs in a new directory of it (``sidecar_logs.run_dir``);
      None: in their temp directory, gone at the end. Their warnings show on ``stderr``.
    save_grace: seconds the sidecars may take, once the trainers are stopped, to write
      the steps they accepted before they are stopped too (``drain.py``).

  Raises:
    InvalidArgumentError: an empty command, hosts, devices_per_host or procs_per_host
      below 1, min_hosts not in 1..hosts, or a standby for a command that is not Python's.
  """
  if isinstance(command, str) or not command:
    raise errors.InvalidArgumentError(
        f"command must be a non-empty list like ['python', 'train.py'], got {command!r}")
  if grace < 0:
    raise errors.InvalidArgumentError(f"grace must be >= 0 seconds, got {grace!r}")
  try:
    stall_timeout = stall_lib.check_floor(stall_timeout)
  except ValueError as e:
    raise errors.InvalidArgumentError(f"{e}; give --stall-timeout 0 to turn it off") from None
  if save_grace < 0:
    raise errors.InvalidArgumentError(f"save_grace must be >= 0 seconds, got {save_grace!r}")
  if in_place and not elastic:
    raise errors.InvalidArgumentError("in_place applies only with elastic=True")
  if max_restarts is None:
    max_restarts = DEFAULT_MAX_RESTARTS if in_place else 0
  elif elastic and not in_place:
    raise errors.InvalidArgumentError(
        "max_restarts applies without elastic, or with elastic and in_place; elastic alone "
        "restarts while min_hosts remain")
  if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
    raise errors.InvalidArgumentError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
  if not 1 <= min_hosts <= hosts:
    raise errors.InvalidArgumentError(
        f"min_hosts must be in 1..hosts ({hosts}), got {min_hosts!r}")
  if isinstance(procs_per_host, bool) or not isinstance(procs_per_host, int) or procs_per_host < 1:
    raise errors.InvalidArgumentError(
        f"procs_per_host must be an int >= 1, got {procs_per_host!r}")
  if standby is not None:
    standbys_lib.check(command)
  # P ranks share each sidecar: each gets about 1/P of its arena ($SIDECAR_SESSION_QUOTA wins).
  share = torchrun.session_share(procs_per_host)
  quota = ("--session-quota", share) if share and not env_lib.get(env_lib.SESSION_QUOTA) else ()
  extra = (*quota, "--stall-timeout", f"{stall_timeout:g}")  # the sidecars apply the rule
  logs = None if log_dir is None else sidecar_logs.run_dir(log_dir)  # raises, naming it
  cluster = LocalCluster(hosts, devices_per_host, shm_size=shm_size, imports=imports,
                         token=token, configure_jax=False, assign_device_ids=False,
                         checkpoint_roots=checkpoint_roots, transport=transport,
                         extra_args=extra, log_dir=logs)
  launch = Supervisor(command, cluster, grace=grace, stdout=stdout or sys.stdout.buffer,
                      stderr=stderr or sys.stderr, elastic=elastic, min_hosts=min_hosts,
                      in_place=in_place, max_restarts=max_restarts,
                      procs_per_host=procs_per_host, torch=torch, standby=standby,
                      stall_timeout=stall_timeout)
  in_start = True

  def handler(signum, frame):
    nonlocal in_start
    if in_start and not launch.trainers:
      in_start = False  # Once: a second signal must not interrupt the cleanup.
      raise _Interrupted(signum)
    launch.on_signal(signum, frame)  # a trainer runs: the supervisor stops the job as ever

  previous = {}
  if threading.current_thread() is threading.main_thread():
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
  follower: sidecar_logs.Follower | None = None
  supervised, code = False, None
  try:
    try:
      if (why := trainers.cannot_start(command)) is not None:
        launch.say(f"{why}; starting nothing")
        return 127
      if not torch:  # a PyTorch job's trainers need no word on JAX's platform
        launch.say(platform.for_trainers(os.environ, devices=devices_per_host).summary)
      if logs is not None:
        launch.say(f"the sidecars' logs go to {logs}/host<i>.log, kept after the job; their "
                   "warnings and errors show here, prefixed [sidecar i]")
      if not loopback_tcp(launch.say, hosts * procs_per_host, torch):
        return 1
      cluster.start()
      follower = sidecar_logs.Follower({h: cluster.log_path(h) for h in range(hosts)},
                                       launch.print_line).start()
      for h in range(hosts):
        launch.say(f"host {h}'s sidecar (pid {cluster.pid(h)}) serves {cluster.addresses[h]} "
                   f"and unix://{cluster.socket(h)}")
      launch.start_trainers()
      launch.watchdog.start()
      in_start = False
    except _Interrupted as e:
      launch.say(f"got {signal.Signals(e.signum).name} while starting; stopping every process")
      return 128 + e.signum
    except errors.SidecarError as e:
      launch.say(f"the sidecars did not start: {e}")
      return 1
    except OSError as e:
      launch.say(f"cannot run {command[0]!r}: {e}")
      return 127 if isinstance(e, FileNotFoundError) else 126
    supervised = True
    code = launch.supervise()
    return code
  finally:
    in_start = False
    launch.watchdog.close()
    launch.stop_trainers()
    if supervised:
      launch.finish_saves(save_grace)
    launch.stop_standbys()
    cluster.close(grace=_STOP_NOW_S if launch.hurried else STOP_GRACE_S)
    if follower is not None:
      follower.close()  # after the sidecars' last words
    if supervised:  # what the sidecars did with the steps, once stopped; how to resume
      drain.after_stop(launch.drained, 1 if code is None else code, launch.say,
                       seen=launch.watchdog.directories(), fails_again=launch.fails_again)
    for signum, old in previous.items():
      signal.signal(signum, old)
