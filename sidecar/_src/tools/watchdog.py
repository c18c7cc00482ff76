"""``sidecar launch``'s watchdog: stalled trainers, slow or hung, and failures that recur.

**Stalls.** Every sidecar knows each attached trainer's step progress (its feed's
batches taken, its saves: ``server/goodput/steps.py``) and says in ``Status.trainers`` which are
stalled (the rule: ``core/stall.py``: timed from its first completed step). :class:`Watchdog`
reads each sidecar's Status in a thread of its own, every :data:`POLL_S` and again
:data:`AHEAD_S` after the moment a trainer's timeout would pass without a step (as its last
reading said: a stall is found at once, not up to a poll later), and reads meanwhile the CPU
time of each trainer's process group (``core/busy.py``); it wakes the launcher (``wake``)
when a trainer is stalled. The launcher asks it then for its verdict on the trainers of its
current start (:meth:`Watchdog.check`, the rule's :func:`stall.judge`):

- **hung** (it burns nothing, nor does any other trainer of its start work; or it made no
  step for :data:`stall.SLOW_MULTIPLE` x its timeout): :meth:`Watchdog.kill` prints the
  stall line (with the phase API: what to declare if it was waiting on purpose), has the
  trainer write its Python stacks (``core/stacks.py``: faulthandler on
  ``$SIDECAR_STACKS_SIGNAL``, every thread) and waits for them to arrive (they are written
  in one go: the trainer's output quiet for :data:`QUIET_S` after their first line, at most
  :data:`STACKS_S`), **looks again** at its sidecar (a trainer that stepped meanwhile is
  spared), and kills its process group. The launcher restarts it like a crash;
- **slow** (its processes burn CPU: an evaluation nobody declared, a recompile): the slow
  line, once, with its stacks and the fix (declare the phase with ``ctl.phase`` /
  ``Worker.phase``, or raise ``--stall-timeout``); it is left to work;
- **waiting** (it burns nothing, but another trainer of its start works: burns CPU, or is in
  a phase it announced): one line, once; it is left to wait.

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

**Only processes the launcher started are signalled**: the process groups of the trainers
it started, known from its own fork; the stacks signal to the members of such a group that
the kernel says catch it (:func:`stack_targets`). The pid a sidecar lists (the kernel's, while
its process lives: issue 76) only tells which trainer a stalled session is: its stall is
acted on only where ``/proc`` shows that pid in the process group of the trainer the
launcher started for that rank (:func:`trainers.in_group`); any other is said once and
left alone. Its CPU is read from that group, never from a listed pid.

**Failures that recur.** A trainer that fails the same way before its first step, or at
the same step, is not restarted again: the rule is ``recurring.py``'s; the watchdog gives it
what the sidecars saw of each trainer (attached, stepped, its position: :meth:`Watchdog.recurs`)
and each one's last output lines (:meth:`Watchdog.tap`).
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
from typing import BinaryIO

from sidecar._src.core import busy, env as env_lib, procfs, stacks, stall
from sidecar._src.tools import recurring, trainers

POLL_S = 1.0  # how often each sidecar's Status is read (and the trainers' CPU)
AHEAD_S = 0.02  # a stall is looked for this long after its timeout would pass
SAMPLE_S = 0.2  # the trainers' CPU is read at most this often
STATUS_TIMEOUT_S = 5.0
STACKS_S = 1.0  # the longest a stalled trainer's stacks are waited for
QUIET_S = 0.1  # its stacks are whole once its output is quiet this long after they began
FIX = ("declare it: `with ctl.phase(\"eval\", budget_s=...)` (a Controller's; "
        "`Worker.phase` for a Worker used alone; docs/elastic.md), or raise --stall-timeout")
# What `sidecar launch --help` says of the watchdog's two rules (recurring.py's first).
HELP = f"""\
{recurring.HELP}
--stall-timeout SECONDS (default {stall.DEFAULT_FLOOR_S:g}; 0: off): a trainer is timed from
its first completed step (its start, a restore, its first compile are never watched);
one that then makes no step (no feed batch taken, no save: its sidecar watches) for the
larger of SECONDS and {stall.MULTIPLE:g}x its slowest step (or a long phase's budget, which it
announces with `with ctl.phase("eval", budget_s=...)`) is stalled. Busy is not hung: one
whose processes burn CPU (an evaluation it did not announce, a recompile) is slow: the
launcher prints "host H rank R is slow: ..." and its Python stacks once, with the fix
(announce the phase, or raise --stall-timeout), and lets it work; so does one that burns
nothing while another trainer of its start works (it waits for it). One that burns nothing
while none works is hung: "host H rank R stalled: no step for S s ...", its Python stacks
(faulthandler on SIDECAR_STACKS_SIGNAL, SIGUSR2 unless set), one more look (one that
stepped meanwhile is spared), then it is killed and restarted as a crash; so is a slow or
waiting one after {stall.SLOW_MULTIPLE:g}x its timeout without a step. With no restart left
the job ends with exit code {stall.EXIT_CODE}. Only the process groups of the trainers this
launcher started are ever signalled. The goodput ledger counts a hang as badput "stall",
slow time as "slow", an announced phase by its name (docs/goodput.md).
"""
# faulthandler's lines: a thread's head, a frame, a thread with no Python frame.
_STACK_LINE = re.compile(r"^((Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):|"
                         r"  File \".*\", line \d+ in |  <no Python frame>)")


@dataclasses.dataclass(frozen=True, slots=True)
class Stall:
  """A trainer its sidecar found stalled, and the watchdog's verdict on it."""
  host: int
  rank: int
  pid: int  # the process its Worker runs in, as its sidecar lists it (in the group: checked)
  since_s: float  # seconds since its last step
  timeout_s: float
  restart: int = -1
  verdict: stall.Verdict = stall.Verdict.HUNG
  cpu: float | None = None  # cores its process group burned lately (None: not known)
  waits_for: str = ""  # what works meanwhile, where it waits: "rank 1 (in phase 'eval')"
  late_s: float = 0.0  # how long after its timeout it was found

  @property
  def why(self) -> str:
    return f"stalled ({self.since_s:.1f} s without a step)"

  @property
  def bound_s(self) -> float:
    """How long a slow or waiting trainer may go without a step before it is stopped."""
    return stall.SLOW_MULTIPLE * self.timeout_s


class _Tap:
  """A trainer's output on its way out: each line noted (``note``) as it passes."""

  def __init__(self, out: BinaryIO, note: Callable[[bytes], None]):
    self._out, self._note = out, note

  def write(self, data: bytes) -> int:
    for line in data.splitlines():
      self._note(line)
    return self._out.write(data)

  def flush(self) -> None:
    self._out.flush()


class Watchdog:
  """Polls the sidecars' step signals and the trainers' CPU for one launch; see the module
  docstring.

  Args:
    addresses: host -> its sidecar's gRPC address, read at each poll (a restarted
      sidecar keeps its address).
    token: the sidecars' token, if any.
    say: prints a line of the launcher's.
    enabled: whether stalls are watched (``--stall-timeout`` above 0); the restart rule
      holds either way.
    groups: rank -> the process group of its trainer (one this launcher started), of the
      current start: whose CPU is read.
    wake: called from the polling thread when a trainer is stalled (the launcher then
      calls :meth:`check` at once).
  """

  def __init__(self, addresses: Callable[[], Mapping[int, str]], *, token: str | None,
               say: Callable[[str], None], enabled: bool = True, poll_s: float = POLL_S,
               groups: Callable[[], Mapping[int, int]] | None = None,
               wake: Callable[[], None] | None = None):
    self._addresses, self._token, self._say = addresses, token, say
    self._poll_s, self.enabled = poll_s, enabled
    self._groups, self._wake = groups or (lambda: {}), wake
    self._lock = threading.Lock()
    self._latest: dict[int, list] = {}  # host -> its Status.trainers, last read
    self._read_at: dict[int, float] = {}  # host -> when it was last read (monotonic)
    self._cpu = busy.Samples()  # by process group: the trainers' CPU seconds
    self._sampled = -SAMPLE_S  # when they were last read (monotonic)
    self._stepped: set[tuple[int, int]] = set()  # (rank, restart) seen with a step
    self._seen: set[tuple[int, int]] = set()  # (rank, restart) seen attached
    self._taken: dict[tuple[int, int], int] = {}  # (rank, restart) -> batches it took
    self._resumed: dict[int, int | None] = {0: 0}  # restart -> the newest step held then
    self._newest = 0  # the newest step any sidecar held committed, as last read
    self._directories: set[str] = set()  # the checkpoint directories the sidecars held
    self._refused: set[tuple[int, int, int, int]] = set()  # stalls not acted on, said once
    self._noted: dict[tuple[int, int, str], float] = {}  # slow/waiting said: its last step
    self._stack_line: dict[int, float] = {}  # rank -> when a line of its stacks came
    self._output = threading.Condition(self._lock)  # notified at each such line
    self._failures = recurring.Failures()  # the restart rule's: its failures, their lines
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
    while not self._stop.wait(self._pause()):
      self.refresh()
      self.sample()
      if self._wake is not None and self.enabled and self._any_stalled():
        self._wake()

  def _pause(self) -> float:
    """Seconds until the next reading: :data:`POLL_S`, or less where a trainer's timeout
    (or a slow one's bound) would pass sooner without a step, as last read."""
    now, wait = time.monotonic(), self._poll_s
    with self._lock:
      for host, ts in self._latest.items():
        at = self._read_at.get(host, now)
        for t in ts:
          if t.ended or t.since_step_s < 0 or t.stall_timeout_s <= 0:
            continue
          limit = t.stall_timeout_s * (stall.SLOW_MULTIPLE if t.stalled else 1.0)
          if t.since_step_s < limit:
            wait = min(wait, at + limit - t.since_step_s + AHEAD_S - now)
    return max(wait, 0.005)

  def _any_stalled(self) -> bool:
    with self._lock:
      return any(t.stalled and not t.ended for ts in self._latest.values() for t in ts)

  def refresh(self, hosts: Sequence[int] | None = None) -> None:
    """Reads every sidecar's Status now (or ``hosts``'s; one that does not answer keeps
    its last)."""
    # gRPC is imported once polling starts: `sidecar launch --help` stays fast (cli.py).
    from sidecar._src.controller import status as status_lib
    for host, address in dict(self._addresses()).items():
      if hosts is not None and host not in hosts:
        continue
      if self._stop.is_set() and self._thread is not None:
        return
      try:
        status = status_lib.fetch(address, timeout=STATUS_TIMEOUT_S, token=self._token)
      except Exception:  # noqa: BLE001 - a dead sidecar is the launcher's to notice
        continue
      got = list(status.trainers)
      held = [int(s) for c in status.checkpoints for s in c.ram_steps]  # committed
      with self._lock:
        self._directories.update(c.directory for c in status.checkpoints)
        self._read_at[host] = time.monotonic()
        self._newest = max([self._newest, *held])
        self._latest[host] = got
        self._stepped.update((t.rank, t.restart) for t in got if t.since_step_s >= 0)
        self._seen.update((t.rank, t.restart) for t in got)
        for t in got:
          key = (t.rank, t.restart)
          self._taken[key] = max(self._taken.get(key, 0), int(t.steps))

  def directories(self) -> frozenset[str]:
    """The checkpoint directories any sidecar held steps of, as read so far: where a job
    whose sidecar died resumes from (``drain.after_stop``)."""
    with self._lock:
      return frozenset(self._directories)

  def sample(self) -> None:
    """Reads the CPU time of each trainer's process group now (``core/busy.py``; at most
    every :data:`SAMPLE_S`: a stall listed for minutes is judged at each of the launcher's
    turns, and a read of ``/proc`` is one of every process)."""
    now = time.monotonic()
    if now - self._sampled < SAMPLE_S:
      return
    self._sampled = now
    groups = set(dict(self._groups()).values())
    cpu = busy.groups_cpu(groups)
    with self._lock:
      self._cpu.keep_only(groups)
      for group, seconds in cpu.items():
        self._cpu.add(group, seconds)

  def life(self, restart: int) -> None:
    """Start ``restart`` begins: the step its trainers resume from is the newest step the
    sidecars held when last read (:meth:`recurs` reads them as a trainer fails)."""
    with self._lock:
      self._resumed[restart] = self._newest

  # ---- stalls ---------------------------------------------------------------------------

  def stalled(self, running: Mapping[int, int], restart: int) -> list[Stall]:
    """The stalls among ``running`` (rank -> its process group, of start ``restart``), as
    last read, each with its verdict: the hung first, the longest without a step first;
    none where stalls are not watched."""
    if not self.enabled:
      return []
    now = time.monotonic()
    with self._lock:
      latest = [(h, t, self._read_at.get(h, now)) for h, ts in self._latest.items()
                for t in ts if t.restart == restart and not t.ended and t.rank in running]
      # Each one's work since its last step (within busy.WINDOW_S), not before it.
      last = {t.rank: at - t.since_step_s for _, t, at in latest if t.since_step_s >= 0}
      rates = {r: self._cpu.rate(g, since=last.get(r)) for r, g in running.items()}
    found = []
    for host, t, at in latest:
      if not t.stalled:
        continue
      key = (host, t.rank, t.restart, int(t.pid))
      if key in self._refused:
        continue
      if not trainers.in_group(int(t.pid), running[t.rank]):
        self._refused.add(key)
        self._say(f"host {host} lists rank {t.rank} stalled with pid {t.pid}, which is not "
                  f"in the process group of the trainer this launcher started for it "
                  f"({running[t.rank]}); signalling nothing")
        continue
      since = t.since_step_s + (now - at)
      rate = rates.get(t.rank)
      if rate is None and since < t.stall_timeout_s + busy.WINDOW_S:
        continue  # its work since its last step not known yet: read again (check's turns)
      works = _working(t.rank, latest, rates)
      verdict = stall.judge(since, t.stall_timeout_s,
                            busy=None if rate is None else rate >= busy.BUSY_SHARE,
                            others_work=bool(works))
      found.append(Stall(host, t.rank, int(t.pid), since, t.stall_timeout_s, t.restart,
                         verdict, rate, works, max(0.0, since - t.stall_timeout_s)))
    return sorted(found, key=lambda x: (x.verdict is not stall.Verdict.HUNG, -x.since_s))

  def check(self, running: Mapping[int, subprocess.Popen], restart: int) -> Stall | None:
    """The hung trainer among ``running`` (rank -> its trainer, of start ``restart``), its
    stacks printed and its process group killed (:meth:`kill`); a slow or waiting one is
    said once (:meth:`note`). None where none was killed (none hung, or it stepped while
    its stacks were written)."""
    live = {r: p.pid for r, p in running.items() if p.poll() is None}
    if not self.enabled or not self._any_stalled():
      return None
    self.sample()  # a reading now: the verdict is on the work of the last moments
    stalls = self.stalled(live, restart)
    for s in stalls:
      if s.verdict is not stall.Verdict.HUNG:
        self.note(s, live[s.rank])
    if not stalls or stalls[0].verdict is not stall.Verdict.HUNG:
      return None
    found = stalls[0]
    began = time.monotonic()
    if not self.kill(found, live[found.rank]):
      return None
    self.report(found, since_s=found.since_s + time.monotonic() - began)
    return found

  def note(self, found: Stall, group: int) -> None:
    """Says a slow trainer (its stacks with it) or a waiting one, once a stall."""
    last_step = time.monotonic() - found.since_s
    key = (found.rank, found.restart, found.verdict.value)
    if abs(self._noted.get(key, -1e9) - last_step) < 1.0:
      return  # said already, this stall
    self._noted[key] = last_step
    head = (f"host {found.host} rank {found.rank} is {found.verdict.value}: no step for "
            f"{found.since_s:.1f} s since its last step (its stall timeout "
            f"{found.timeout_s:.1f} s, --stall-timeout)")
    if found.verdict is stall.Verdict.SLOW:
      self._say(f"{head}, but it works (its processes burn {share(found.cpu)} of a core): "
                f"it is not stopped unless it makes no step for {found.bound_s:.1f} s "
                f"({stall.SLOW_MULTIPLE:g}x its timeout). If this is an evaluation or "
                f"another long phase, {FIX}. Its Python stacks follow")
      self._stacks(found, group)
    else:
      self._say(f"{head} and burns nothing, but {found.waits_for} works: it waits for it, "
                f"and is not stopped unless it makes no step for {found.bound_s:.1f} s "
                f"({stall.SLOW_MULTIPLE:g}x its timeout)")

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

  def kill(self, found: Stall, group: int) -> bool:
    """Prints ``found``'s stall line, has the trainer write its stacks and waits for them,
    looks again, and kills process group ``group`` (the trainer's, which this launcher
    started) where it is still stalled; forgets the stall, which the sidecars will list as
    ended. Returns whether it killed: a stall whose pid is not in ``group`` is never acted
    on (:func:`trainers.in_group`)."""
    if not trainers.in_group(found.pid, group):
      self._say(f"host {found.host} rank {found.rank}'s pid {found.pid} is not in the "
                f"process group of the trainer this launcher started ({group}); "
                "signalling nothing")
      return False
    why = (f"working all the while ({share(found.cpu)} of a core lately), past "
           f"{stall.SLOW_MULTIPLE:g}x its timeout: a loop that never steps"
           if found.since_s > found.bound_s and found.cpu is not None
           and found.cpu >= busy.BUSY_SHARE else
           f"and idle ({share(found.cpu)} of a core lately"
           + (f", and {found.waits_for} no longer works" if found.waits_for else
              ", nor does another trainer of its start work") + "): hung")
    self._say(f"host {found.host} rank {found.rank} stalled: no step for "
              f"{found.since_s:.1f} s since its last step (its stall timeout "
              f"{found.timeout_s:.1f} s, --stall-timeout; found {found.late_s:.2f} s after "
              f"it), {why}; its Python stacks follow, then it is killed if it is still "
              f"stalled. If it waited for something that takes this long (a computation on "
              f"its device, a slow read), {FIX}")
    self._stacks(found, group)
    if (moved := self._stepped_since(found)) is not None:
      self._say(f"host {found.host} rank {found.rank} stepped while its stacks were written "
                f"({moved}); not killing it")
      return False
    trainers.signal_group(group, signal.SIGKILL)
    with self._lock:
      for ts in self._latest.values():
        ts[:] = [t for t in ts if t.rank != found.rank]
    return True

  def _stacks(self, stall: Stall, group: int) -> None:
    """Has trainer group ``group`` write its stacks and waits until they came: its output
    quiet for :data:`QUIET_S` after their first line (faulthandler writes them in one go),
    at most :data:`STACKS_S`; not at all where no process of it catches the signal."""
    sig = stacks_signal()
    targets = [] if sig is None else stack_targets(group, sig)
    if sig is None or not targets:
      self._say(f"no stacks: no process of trainer group {group} catches "
                f"{env_lib.STACKS_SIGNAL}={sig.name if sig else 'unset'} (its Worker arms "
                "faulthandler when it attaches)")
      return
    sent = time.monotonic()
    for pid in targets:
      with contextlib.suppress(OSError):
        os.kill(pid, sig)
    deadline = sent + STACKS_S
    with self._output:
      while True:
        now = time.monotonic()
        came = self._stack_line.get(stall.rank, 0.0)
        if now >= deadline or (came > sent and now - came >= QUIET_S):
          return
        self._output.wait(min(deadline, came + QUIET_S if came > sent else deadline) - now)

  def _stepped_since(self, stall: Stall) -> str | None:
    """How ``stall``'s trainer shows a step since it was found stalled, its sidecar read
    again now; None where it is still stalled (or its sidecar does not answer)."""
    self.refresh([stall.host])
    with self._lock:
      now = [t for t in self._latest.get(stall.host, ())
             if (t.rank, t.restart, int(t.pid)) == (stall.rank, stall.restart, stall.pid)]
    for t in now:  # one that stepped and then ended (it ran to its end) is no stall either
      if not t.stalled:
        return f"its last step {max(t.since_step_s, 0):.1f} s ago"
    return None

  # ---- failures that recur ------------------------------------------------------------------

  def tap(self, rank: int, out: BinaryIO) -> _Tap:
    """``out`` for rank ``rank``'s output, which notes its last lines (the restart rule's)
    and when a line of its Python stacks came (:meth:`kill` waits for them)."""
    self._failures.begin(rank)

    def note(line: bytes) -> None:
      self._failures.note(rank, line)
      if _STACK_LINE.match(line.decode(errors="replace").split("] ", 1)[-1]):
        with self._lock:
          self._stack_line[rank] = time.monotonic()
          self._output.notify_all()
    return _Tap(out, note)

  def recurs(self, rank: int, restart: int, code: int) -> str | None:
    """Notes that rank ``rank`` of start ``restart`` failed with ``code``; the reason to
    end the job where it failed the same way as before, before a first step or at the same
    step (the rule: ``recurring.Failures.recurs``), else None."""
    self.refresh()  # its last step may have come since the last poll
    with self._lock:
      key = (rank, restart)
      resumed = self._resumed.get(restart)
      seen, stepped = key in self._seen, key in self._stepped
      position = None if resumed is None or not seen else resumed + self._taken.get(key, 0)
    return self._failures.recurs(rank, code, seen=seen, stepped=stepped, position=position)


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
  dog = Watchdog(lambda: own, token=token, say=say, poll_s=poll_s,
                 groups=lambda: {rank: proc.pid})  # it leads its own process group
  while True:
    try:
      return proc.wait(timeout=dog._pause())
    except subprocess.TimeoutExpired:
      pass
    dog.refresh()
    dog.sample()
    stalls = dog.stalled({rank: proc.pid}, restart)
    if not stalls:
      continue
    found = stalls[0]
    if found.verdict is not stall.Verdict.HUNG:
      dog.note(found, proc.pid)
      continue
    began = time.monotonic()
    if dog.kill(found, proc.pid):
      proc.wait()
      dog.report(found, since_s=found.since_s + time.monotonic() - began, to=addresses)
      return stall.EXIT_CODE


def _working(rank: int, latest: list, rates: Mapping[int, float | None]) -> str:
  """Which other trainer of the start works, for ``rank`` to wait for ("" none): one whose
  process group burns CPU, or one in a phase it announced (its budget not run out)."""
  for r, rate in sorted(rates.items()):
    if r != rank and rate is not None and rate >= busy.BUSY_SHARE:
      return f"rank {r} ({share(rate)} of a core)"
  for _, t, _ in latest:
    if t.rank != rank and t.phase and not t.stalled:
      return f"rank {t.rank} (in phase {t.phase!r})"
  return ""


def share(rate: float | None) -> str:
  return "an unknown share" if rate is None else f"{100 * rate:.0f}%"


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


def stacks_signal() -> signal.Signals | None:
  """The signal the trainers arm (the launcher's own value, else what it sets)."""
  try:
    return stacks.parse(env_lib.get(env_lib.STACKS_SIGNAL) or stacks.DEFAULT)
  except ValueError:
    return None
