"""``sidecar launch``'s watchdog: stalled trainers, and failures that recur at once.

**Stalls.** Every sidecar knows each attached trainer's step progress (its feed's
batches taken, its saves: ``server/goodput/steps.py``) and says in ``Status.trainers`` which are
stalled (the rule: ``core/stall.py``: timed from its first completed step). :class:`Watchdog`
polls each sidecar's Status every :data:`POLL_S` in a thread of its own; the launcher asks
it, between events, for a stall among the trainers of its current start
(:meth:`Watchdog.stalled`), and :meth:`Watchdog.kill` then prints the stall line, has the
trainer write its Python stacks (``core/stacks.py``: faulthandler on
``$SIDECAR_STACKS_SIGNAL``, every thread), **looks again** (a trainer that stepped
meanwhile is spared), and kills its process group. The launcher restarts it like a crash.

**The ledger hears of it.** The goodput ledger is process 0's, kept by its sidecar, which
may not be the stalled trainer's, and process 0 is often not stalled yet (it waits in a
collective, or in an announced phase): its death alone would read as a plain crash. So
once it has killed a stalled trainer, :meth:`Watchdog.check` tells every sidecar of the
job (the Stalled RPC, :meth:`Watchdog.report`) that the trainers of that start die of
that stall, its last step the time the launcher verified; the sidecar keeping the ledger
marks process 0's life, which the kill that follows ends (``server/goodput/ledgers.py``).
``sidecar slurm``'s trainer task does the same for its one trainer (:func:`watch_one`):
its own sidecar watches it, and every sidecar of the job (the entries in its rendezvous
directory) hears of the stall it killed.

**Only processes the launcher started are signalled.** The pid a sidecar lists is what
its session said; it is signalled only where ``/proc`` shows it in the process group of
the trainer the launcher started for that rank (:func:`trainers.in_group`): a negative,
zero, impossible or foreign pid is never signalled, and its stall is not acted on.

**Failures that recur.** A trainer that fails the same way (the same exit status and the
same last error line of its output) :data:`REPEATS` times in a row, either before its
first step or at the same step, ends the job with that failure instead of restarting it
again (:meth:`Watchdog.recurs`): a typo in a path, or a bug that raises in step 30,
fails the same way every time, and restarting it only hides the error under more output.
"Before its first step": its sidecar saw it attach and its clock never started (the same
signal as stalls). "At the same step": its position, the newest step the sidecars held
when its life began (what it resumed from: as read when the life before it failed) plus
the batches it took from their feeds, is the same in both lives. A trainer its sidecar
never saw (one that failed before its Worker attached, or one that uses no sidecar, as a
Grain + Orbax trainer under the same launcher) is restarted as before: no signal tells its
steps from none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, BinaryIO

from sidecar._src.core import env as env_lib, procfs, stacks, stall
from sidecar._src.tools import trainers
from sidecar._src.wire import ipc

if TYPE_CHECKING:  # the protobuf messages load with gRPC, once a Status is read
  from sidecar._src.wire.protocol import pb

POLL_S = 1.0  # how often each sidecar's Status is read
STATUS_TIMEOUT_S = 5.0
STACKS_S = 1.0  # how long a stalled trainer is given to write its stacks
REPEATS = 2  # the same failure this often in a row (before a step, or at one) ends the job
# What `sidecar launch --help` says of this module's two rules.
HELP = f"""\
A trainer that fails the same way (exit status and last error line) {REPEATS} times in a
row, after its Worker attached and before its first step, or at the same step (the step
it resumed from plus the batches it took), is not restarted again: the job ends with
that failure.

--stall-timeout SECONDS (default {stall.DEFAULT_FLOOR_S:g}; 0: off): a trainer is timed from
its first completed step (its start, a restore, its first compile are never watched);
one that then makes no step (no feed batch taken, no save: its sidecar watches) for the
larger of SECONDS and {stall.MULTIPLE:g}x its slowest step (or a long phase's budget, which it
announces with `with ctl.phase("eval", budget_s=...)`) is stalled: the launcher prints
"host H rank R stalled: no step for S s ...", then its Python stacks (faulthandler on
SIDECAR_STACKS_SIGNAL, SIGUSR2 unless set), looks again (one that stepped meanwhile is
spared), kills it and restarts it as a crash; with no restart left the job ends with
exit code {stall.EXIT_CODE}. Only a pid in the process group of a trainer this launcher
started is ever signalled. The goodput ledger counts it as badput "stall"
(docs/elastic.md).
"""
_ERROR_LINE = re.compile(rb"^\s*([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*)$")
_LINE_CHARS = 300


@dataclasses.dataclass(frozen=True, slots=True)
class Stall:
  """A trainer its sidecar found stalled."""
  host: int
  rank: int
  pid: int  # the process its Worker runs in, as its sidecar lists it (unverified)
  since_s: float  # seconds since its last step
  timeout_s: float
  restart: int = -1

  @property
  def why(self) -> str:
    return f"stalled ({self.since_s:.1f} s without a step)"


@dataclasses.dataclass(frozen=True, slots=True)
class _Failure:
  code: int
  line: str  # its output's last error line (or last line)
  stepped: bool  # its sidecar saw its first completed step
  seen: bool  # its sidecar saw it attach: "no step" means something
  position: int | None  # the step it resumed from + the batches it took (None: unknown)

  def same(self, other: _Failure) -> bool:
    """The same failure: the same exit status and last error line, both before a first
    step, or both at one and the same known step."""
    if (self.code, self.line, self.seen, self.stepped) != (
        other.code, other.line, other.seen, other.stepped):
      return False
    return not self.stepped or self.position is not None and self.position == other.position


class _Tap:
  """A trainer's output on its way out: remembers its last error line."""

  def __init__(self, out: BinaryIO, note: Callable[[bytes], None]):
    self._out, self._note = out, note

  def write(self, data: bytes) -> int:
    for line in data.splitlines():
      self._note(line)
    return self._out.write(data)

  def flush(self) -> None:
    self._out.flush()


class Watchdog:
  """Polls the sidecars' step signals for one launch; see the module docstring.

  Args:
    addresses: host -> its sidecar's gRPC address, read at each poll (a restarted
      sidecar keeps its address).
    token: the sidecars' token, if any.
    say: prints a line of the launcher's.
    enabled: whether stalls are watched (``--stall-timeout`` above 0); the restart rule
      holds either way.
  """

  def __init__(self, addresses: Callable[[], Mapping[int, str]], *, token: str | None,
               say: Callable[[str], None], enabled: bool = True, poll_s: float = POLL_S):
    self._addresses, self._token, self._say = addresses, token, say
    self._poll_s, self.enabled = poll_s, enabled
    self._lock = threading.Lock()
    self._latest: dict[int, list] = {}  # host -> its Status.trainers, last read
    self._stepped: set[tuple[int, int]] = set()  # (rank, restart) seen with a step
    self._seen: set[tuple[int, int]] = set()  # (rank, restart) seen attached
    self._taken: dict[tuple[int, int], int] = {}  # (rank, restart) -> batches it took
    self._resumed: dict[int, int | None] = {0: 0}  # restart -> the newest step held then
    self._newest = 0  # the newest step any sidecar held committed, as last read
    self._refused: set[tuple[int, int, int, int]] = set()  # stalls not acted on, said once
    self._lines: dict[int, str] = {}  # rank -> its output's last error line
    self._last: dict[int, str] = {}  # rank -> its output's last line
    self._failures: list[_Failure] = []  # the job's, in order, those before a step
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  # ---- the poller ---------------------------------------------------------------------

  def start(self) -> None:
    """Starts polling (idempotent)."""
    if self._thread is None:
      self._thread = threading.Thread(target=self._run, name="sidecar-launch-watchdog",
                                      daemon=True)  # daemon: a safety net; close() joins
      self._thread.start()

  def close(self) -> None:
    """Stops polling and joins the thread. Idempotent."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=STATUS_TIMEOUT_S + 1.0)
      self._thread = None

  def _run(self) -> None:
    while not self._stop.wait(self._poll_s):
      self.refresh()

  def refresh(self) -> None:
    """Reads every sidecar's Status now (one that does not answer keeps its last)."""
    # gRPC is imported once polling starts: `sidecar launch --help` stays fast (cli.py).
    from sidecar._src.controller import status as status_lib
    for host, address in dict(self._addresses()).items():
      if self._stop.is_set() and self._thread is not None:
        return
      try:
        status = status_lib.fetch(address, timeout=STATUS_TIMEOUT_S, token=self._token)
      except Exception:  # noqa: BLE001 - a dead sidecar is the launcher's to notice
        continue
      got = list(status.trainers)
      held = [int(s) for c in status.checkpoints for s in c.ram_steps]  # committed
      with self._lock:
        self._newest = max([self._newest, *held])
        self._latest[host] = got
        self._stepped.update((t.rank, t.restart) for t in got if t.since_step_s >= 0)
        self._seen.update((t.rank, t.restart) for t in got)
        for t in got:
          key = (t.rank, t.restart)
          self._taken[key] = max(self._taken.get(key, 0), int(t.steps))

  def life(self, restart: int) -> None:
    """Start ``restart`` begins: the step its trainers resume from is the newest step the
    sidecars held when last read (:meth:`recurs` reads them as a trainer fails)."""
    with self._lock:
      self._resumed[restart] = self._newest

  # ---- stalls ---------------------------------------------------------------------------

  def stalled(self, running: Mapping[int, int], restart: int) -> Stall | None:
    """A stall among ``running`` (rank -> its process's pid, of start ``restart``), as
    last read; None where there is none (or stalls are not watched)."""
    if not self.enabled:
      return None
    with self._lock:
      latest = [(h, t) for h, ts in self._latest.items() for t in ts]
    for host, t in latest:
      if t.stalled and not t.ended and t.restart == restart and t.rank in running:
        key = (host, t.rank, t.restart, int(t.pid))
        if key in self._refused:
          continue
        if not trainers.in_group(int(t.pid), running[t.rank]):
          self._refused.add(key)
          self._say(f"host {host} lists rank {t.rank} stalled with pid {t.pid}, which is not "
                    f"in the process group of the trainer this launcher started for it "
                    f"({running[t.rank]}); signalling nothing")
          continue
        return Stall(host, t.rank, int(t.pid), t.since_step_s, t.stall_timeout_s, t.restart)
    return None

  def check(self, running: Mapping[int, subprocess.Popen], restart: int) -> Stall | None:
    """A stall among ``running`` (rank -> its trainer, of start ``restart``), its stacks
    printed and its process group killed (:meth:`kill`); None where there is none, or
    where it stepped while its stacks were written."""
    found = self.stalled({r: p.pid for r, p in running.items() if p.poll() is None},
                         restart)
    if found is None:
      return None
    began = time.monotonic()
    if not self.kill(found, running[found.rank].pid):
      return None
    self.report(found, since_s=found.since_s + time.monotonic() - began)
    return found

  def report(self, stall: Stall, *, since_s: float,
             to: Callable[[], Mapping[int, str]] | None = None) -> None:
    """Tells every sidecar (those this watchdog polls, or ``to``'s) that ``stall``'s
    trainer, its last step ``since_s`` ago, was killed stalled: the ledger of its start's
    life, process 0's, records its death as the stall's (the Stalled RPC). A sidecar that
    does not answer is said, once each."""
    from sidecar._src.controller import connection  # gRPC, as refresh()
    from sidecar._src.wire import protocol
    from sidecar._src.wire.protocol import pb
    request = pb.StalledRequest(rank=stall.rank, restart=stall.restart, since_step_s=since_s)
    meta = ((protocol.AUTH_KEY, f"Bearer {self._token}"),) if self._token else ()
    for host, address in dict((to or self._addresses)()).items():
      try:
        channel, pin = connection.open_channel(
            address, timeout=STATUS_TIMEOUT_S, options=connection.CHANNEL_OPTIONS,
            credentials=protocol.tls_credentials(None, None, None))
        with channel, pin or contextlib.nullcontext():
          channel.unary_unary(f"/{protocol.SERVICE}/Stalled",
                              request_serializer=pb.StalledRequest.SerializeToString,
                              response_deserializer=pb.StalledResponse.FromString)(
              request, timeout=STATUS_TIMEOUT_S, metadata=meta)
      except Exception as e:  # noqa: BLE001 - the ledger only: the restart goes on
        self._say(f"host {host}'s sidecar did not hear of rank {stall.rank}'s stall "
                  f"({type(e).__name__}: {e}); its goodput ledger may count it as a crash")

  def kill(self, stall: Stall, group: int) -> bool:
    """Prints the stall line, has the trainer write its stacks, looks again, and kills
    process group ``group`` (the trainer's, which this launcher started) where it is
    still stalled; forgets the stall, which the sidecars will list as ended. Returns
    whether it killed: a pid not in ``group`` is never signalled (:func:`trainers.in_group`)."""
    if not trainers.in_group(stall.pid, group):
      self._say(f"host {stall.host} rank {stall.rank}'s pid {stall.pid} is not in the "
                f"process group of the trainer this launcher started ({group}); "
                "signalling nothing")
      return False
    self._say(f"host {stall.host} rank {stall.rank} stalled: no step for "
              f"{stall.since_s:.1f} s since its last step (its stall timeout "
              f"{stall.timeout_s:.1f} s, --stall-timeout); pid {stall.pid}'s Python stacks "
              "follow, then it is killed if it is still stalled")
    sig = _stacks_signal()
    targets = [] if sig is None else stack_targets(group, sig)
    for pid in targets if sig is not None else ():
      with contextlib.suppress(OSError):
        os.kill(pid, sig)
    if not targets:
      self._say(f"no stacks: no process of trainer group {group} catches "
                f"{env_lib.STACKS_SIGNAL}={sig.name if sig else 'unset'} (its Worker arms "
                "faulthandler when it attaches)")
    time.sleep(STACKS_S)  # its handler writes at once; the pump forwards the lines
    if (moved := self._stepped_since(stall)) is not None:
      self._say(f"host {stall.host} rank {stall.rank} stepped while its stacks were written "
                f"({moved}); not killing it")
      return False
    trainers.signal_group(group, signal.SIGKILL)
    with self._lock:
      for ts in self._latest.values():
        ts[:] = [t for t in ts if t.rank != stall.rank]
    return True

  def _stepped_since(self, stall: Stall) -> str | None:
    """How ``stall``'s trainer shows a step since it was found stalled, its sidecar read
    again now; None where it is still stalled (or its sidecar does not answer)."""
    self.refresh()
    with self._lock:
      now = [t for t in self._latest.get(stall.host, ())
             if (t.rank, t.restart, int(t.pid)) == (stall.rank, stall.restart, stall.pid)]
    for t in now:  # one that stepped and then ended (it ran to its end) is no stall either
      if not t.stalled:
        return f"its last step {max(t.since_step_s, 0):.1f} s ago"
    return None

  # ---- failures that recur ------------------------------------------------------------------

  def tap(self, rank: int, out: BinaryIO) -> _Tap:
    """``out`` for rank ``rank``'s output, which notes its last error line."""
    with self._lock:
      self._lines.pop(rank, None)
      self._last.pop(rank, None)

    def note(line: bytes) -> None:
      text = line.decode(errors="replace").strip()
      if not text:
        return
      text = text.split("] ", 1)[1] if text.startswith("[host ") and "] " in text else text
      error = _ERROR_LINE.match(text.encode())
      with self._lock:
        self._last[rank] = text[:_LINE_CHARS]
        if error:
          self._lines[rank] = text[:_LINE_CHARS]
    return _Tap(out, note)

  def recurs(self, rank: int, restart: int, code: int) -> str | None:
    """Notes that rank ``rank`` of start ``restart`` failed with ``code``; the reason to
    end the job where this is the :data:`REPEATS`-th same failure in a row, before a
    first step or at the same step, else None."""
    self.refresh()  # its last step may have come since the last poll
    with self._lock:
      line = self._lines.get(rank) or self._last.get(rank) or ""
      key = (rank, restart)
      resumed = self._resumed.get(restart)
      position = None if resumed is None or key not in self._seen else (
          resumed + self._taken.get(key, 0))
      failure = _Failure(code, line, key in self._stepped, key in self._seen, position)
      self._failures.append(failure)
      last = self._failures[-REPEATS:]
    if not failure.seen or len(last) < REPEATS or not all(f.same(failure) for f in last):
      return None
    where = "before its first step" if not failure.stepped else (
        f"at the same step ({failure.position}: the step it resumed from plus the batches "
        "it took)")
    return (f"it failed the same way {REPEATS} times in a row {where} "
            f"({trainers.how(code)}" + (f"; its last error: {line}" if line else "")
            + "): a restart would fail again; not restarting it")


def probe(addresses: Sequence[str], *, token: str | None, timeout: float, send_stacks: bool,
          say: Callable[[str], None]) -> int:
  """``sidecar stalls``: 1 where a trainer attached to one of the sidecars at ``addresses``
  is stalled (a "stall" line for each; with ``send_stacks``, its stacks asked for where
  :func:`_unsignalled` finds no reason not to: the k8s trainer container's liveness probe
  runs beside it), else 0. A sidecar that does not answer is said, and is no stall: its own
  probes watch it."""
  from sidecar._src.arena import shm  # numpy: `sidecar launch --help` stays fast
  from sidecar._src.controller import status as status_lib  # gRPC, as refresh()
  here = (shm.boot_id(), ipc.pid_namespace())
  found = 0
  for address in addresses:
    try:
      got = status_lib.fetch(address, timeout=timeout, token=token)
    except Exception as e:  # noqa: BLE001 - any failure: no stall can be told
      say(f"cannot read the status of the sidecar at {address} ({type(e).__name__}: {e}); "
          "no stall can be told")
      continue
    for t in got.trainers:
      if not t.stalled or t.ended:
        continue
      found += 1
      say(f"host {got.identity.host_id} rank {t.rank} stalled: no step for "
          f"{t.since_step_s:.1f} s since its last step (its stall timeout "
          f"{t.stall_timeout_s:.1f} s; pid {t.pid if t.pid_verified else 'unverified'})")
      if not send_stacks:
        continue
      if (why := _unsignalled(t, got, here)) is not None:
        say(f"no stacks asked of host {got.identity.host_id} rank {t.rank}: {why}")
        continue
      sig = _stacks_signal()
      # Unknown (no SigCgt in /proc: gVisor) is sent too: an attached trainer's Worker
      # armed it where SIDECAR_STACKS_SIGNAL is set, as in this container's environment.
      if sig is not None and stacks.catches(t.pid, sig) is not False:
        with contextlib.suppress(OSError):
          os.kill(t.pid, sig)  # its stacks go to its own stderr: the container's log
  return 1 if found else 0


def _unsignalled(t: pb.TrainerStatus, got: pb.StatusResponse, here: tuple[str, str]
                 ) -> str | None:
  """Why ``sidecar stalls --stacks`` may not signal trainer ``t`` (a ``TrainerStatus`` of
  Status ``got``), None where it may: only a pid the sidecar had from the kernel (its
  worker socket's peer credentials), of the caller's own tenant, in this process's boot and
  PID namespace (``here``), where the number names the same process (issue 69)."""
  if not t.pid_verified or not 0 < t.pid < ipc.PID_LIMIT:
    return ("its pid is unverified: the sidecar had none from the kernel (a trainer in "
            "another PID namespace; in Kubernetes, shareProcessNamespace: true shares one)")
  if t.tenant != got.tenant:
    return (f"it is tenant {t.tenant!r}'s trainer, and this token is "
            + (f"tenant {got.tenant!r}'s" if got.tenant else "no tenant's")
            + ": a token acts on its own tenant's trainers only")
  boot, namespace = here
  if not boot or got.identity.boot_id != boot or not namespace or (
      got.identity.pid_namespace != namespace):
    return (f"its pid {t.pid} is the sidecar's view, from another "
            + ("kernel" if got.identity.boot_id != boot else "PID namespace")
            + " than this process's (or one /proc does not name), where it names another "
            "process: run `sidecar stalls --stacks` beside the trainer, sharing the sidecar's "
            "PID namespace")
  return None


def watch_one(proc: subprocess.Popen, host: int, addresses: Callable[[], Mapping[int, str]],
              *, token: str | None, rank: int, restart: int, say: Callable[[str], None],
              poll_s: float = POLL_S) -> int:
  """Waits for ``proc`` (the trainer of rank ``rank``, start ``restart``) to exit while
  watching its sidecar, host ``host`` of ``addresses`` (host -> gRPC address, every
  sidecar of the job, read when needed), for its stall (``sidecar slurm``'s trainer
  task): on one, its stacks and the kill, as :meth:`Watchdog.kill`, every sidecar told
  (:meth:`Watchdog.report`: process 0's ledger counts the stall, not a crash), and
  :data:`stall.EXIT_CODE`; else its return code (-N for signal N, as
  ``Popen.returncode``)."""
  own = {h: a for h, a in addresses().items() if h == host}  # read once, as polled often
  dog = Watchdog(lambda: own, token=token, say=say, poll_s=poll_s)
  while True:
    try:
      return proc.wait(timeout=poll_s)
    except subprocess.TimeoutExpired:
      pass
    dog.refresh()
    found = dog.stalled({rank: proc.pid}, restart)
    if found is None:
      continue
    began = time.monotonic()
    if dog.kill(found, proc.pid):  # it leads its own process group
      proc.wait()
      dog.report(found, since_s=found.since_s + time.monotonic() - began, to=addresses)
      return stall.EXIT_CODE


def stack_targets(group: int, sig: int) -> list[int]:
  """The processes of trainer group ``group`` (one this launcher started) to send the stacks
  signal ``sig``: those the kernel says catch it (their Worker armed faulthandler); where
  ``/proc`` cannot tell (no SigCgt: gVisor), the group's leader, the very process the
  launcher started, whose Worker arms it where ``SIDECAR_STACKS_SIGNAL`` is set. Never a pid
  a client or a sidecar named: a process that does not catch it would die of it."""
  members = procfs.in_groups([group])[group]
  caught = {m.pid: stacks.catches(m.pid, sig) for m in members}
  if any(c is None for c in caught.values()):
    return [group] if group in caught and caught[group] is not False else []
  return sorted(pid for pid, c in caught.items() if c)


def _stacks_signal() -> signal.Signals | None:
  """The signal the trainers arm (the launcher's own value, else what it sets)."""
  try:
    return stacks.parse(env_lib.get(env_lib.STACKS_SIGNAL) or stacks.DEFAULT)
  except ValueError:
    return None
