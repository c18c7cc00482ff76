"""The save protocol on the sidecars, once for every framework and format: where a step
goes (:class:`Target`) and the calls that send its values there (:class:`SaveProtocol`).

A :class:`Target` is the address every call takes: the step's directories, which
are its format's (``ckptfmt.Format``; a Target places nothing itself, so a new format with
any layout changes nothing here), its tmp ones Begin's answer.

:class:`SaveProtocol` sends a step's save values (``ckptfmt/save_values``, whose docstring
gives their order) on the hosts it is given, format-neutral, and keeps the order an abort
goes in; :class:`Sends` is its lot pipeline, each lot a Stage as a :class:`Staging` says.
One save step (``save_run.SaveRun``) builds the values, in the same order for every
framework, and decides between the calls what follows what.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import pathlib
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from sidecar._src.arena import shm
from sidecar._src.ckptfmt.format import Format
from sidecar._src.ckptfmt.records import Replicated, ShardRecord
from sidecar._src.ckptfmt.save_values import (
  Abort,
  AwaitCommit,
  Begin,
  Commit,
  Committed,
  Prepared,
  Stage,
)
from sidecar._src.controller.checkpoint.client import CheckpointTransport
from sidecar._src.controller.checkpoint.staging import Lot
from sidecar._src.core import errors

log = logging.getLogger(__name__)
# The longest wait for a host's writes (prepared) and for the commit that follows.
LONG_S = 3600.0
# An abort waits for the host's writer to stop (up to a minute there).
_ABORT_S = 90.0


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
  """Where a step goes: the directory its save writes, and where that is once committed.

  ``directory``: where the step lies (what its save opens). ``tmp_step``: the whole
  uncommitted step, which an aborted save removes once every host let go of it (Begin's
  answer); empty where another commits the step (``whole_step`` False). ``fmt``: the
  format whose layout every directory here is.
  """
  directory: str
  step: int
  tmp_dir: str
  final_dir: str
  whole_step: bool  # True: our commit renames the step; False: another (Orbax's manager)
  tmp_step: str
  fmt: Format

  @classmethod
  def for_step(cls, fmt: Format, path: str, step: int, *, directory: str | None = None
               ) -> Target:
    """Step ``step`` of ``path`` (what Begin is given: a checkpoint root for Orbax's
    layout, the checkpoint itself for DCP's) in ``fmt``'s layout, not begun. Its
    ``final_dir`` is ``fmt``'s (:meth:`Format.final_dir`), made of ``path`` as the client
    spells it, never resolved: the manifest's directory, the RAM tier's key and what a
    restore reads. Its tmp directories are Begin's answer (:meth:`begun`). ``directory``:
    where the step lies, default ``path``."""
    return cls(path if directory is None else directory, step, "", fmt.final_dir(path, step),
               True, "", fmt)

  def begun(self, tmp_step: str) -> Target:
    """This step once a sidecar began it in ``tmp_step`` (Begin's answer): written where
    its format stages in that directory (:meth:`Format.staged_dirs`); its ``final_dir``
    stays the client's own."""
    tmp_dir, _ = self.fmt.staged_dirs(tmp_step)
    return dataclasses.replace(self, tmp_dir=tmp_dir, tmp_step=tmp_step)

  @classmethod
  def in_step(cls, fmt: Format, directory: str, tmp_dir: str, step: int) -> Target:
    """``tmp_dir``, a directory inside an uncommitted step of ``directory`` that another
    commits (an ``ocp.CheckpointManager``): written where it is; once committed, where
    ``fmt`` puts it (:meth:`Format.final_of`; itself if it lies in no uncommitted step)."""
    found = fmt.final_of(pathlib.Path(tmp_dir))
    final = tmp_dir if found is None else str(found.final)
    return cls(directory, step, tmp_dir, final, False, "", fmt)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Staging:
  """How one save's lots go to its sidecars (:class:`Sends`): each of ``hosts`` is sent its
  lots as Stages made of ``first``, the Stage of a host's first lot without its shards (the
  step's directories, its leaves, the format's extra, the plan a host's last lot carries
  where the sidecars commit the step, and the Begin where the first lot begins it). A
  host's later lots are ``first`` without leaves and Begin, a lot not a host's last
  without the plan; each says how many processes stage into its host (``writers``).

  ``told(error)``, with ``first.begin`` (one host only): called once the first lot
  answered (``error`` None: the step is begun there) or failed (then it was never begun);
  only that lot begins the step, so it is told once.
  ``whole()``: called once every host's last call answered (on the thread its answer came
  on)."""
  hosts: Sequence[int]
  first: Stage
  told: Callable[[BaseException | None], None] = lambda error: None
  whole: Callable[[], None] | None = None

  def __post_init__(self) -> None:
    object.__setattr__(self, "hosts", tuple(self.hosts))
    if self.first.begin is not None and len(self.hosts) != 1:
      raise errors.InvalidArgumentError(
          f"a step begun by its first Stage is staged on one host, got hosts {list(self.hosts)}")

  def stage_of(self, lot: Lot, first: bool, writers: int) -> Stage:
    """The Stage that sends ``lot`` (``first``: its host's first), ``writers`` processes
    staging into its host."""
    return dataclasses.replace(
        self.first, shards=lot.shards, last=lot.last, writers=writers,
        leaves=self.first.leaves if first else (),
        plan=self.first.plan if lot.last else None,
        begin=self.first.begin if first else None)


class SaveProtocol:
  """The calls of one step's save on the sidecars, each on the hosts it is given; the
  values each sends are ``ckptfmt/save_values``' (whose docstring gives their order).

  Format-neutral: a format's extra on a request travels as a typed value
  (``client.FormatExtra``: ``ckptfmt/dcp``'s ``DcpPart``/``DcpCommit``; none for stock
  Orbax's layout), never as a branch here. The caller coordinates with the other trainer
  processes between the calls.

  Args:
    client: the sidecars.
    directory: the checkpoint directory (absolute): where the steps are.
    format: the format's name (``ckptfmt/registry.py``: ``"orbax"``, ``"dcp"``), sent at
      Begin; ``CheckpointOptions.format_for`` chooses it.
    writers: the processes that stage into each host, where several share one (each
      sends its own last part; the host's step is whole once all of them have).
  """

  def __init__(self, *, client: CheckpointTransport, directory: str, format: str,
               writers: Mapping[int, Sequence[int]] | None = None):
    self.client, self.directory, self.format = client, directory, format
    self.writers = dict(writers or {})

  def begin(self, host: int, begin: Begin) -> str:
    """Makes the step's tmp directory on ``host``; returns it. ``begin.directory``: the
    checkpoint directory, or a one-directory checkpoint's own path (its tmp one beside
    it)."""
    try:
      return self.client.send(host, begin).result()
    except errors.SidecarError as e:
      e.add_note(f"host {host} could not begin step {begin.step} in {begin.directory}")
      raise

  def prepared(self, target: Target, hosts: Sequence[int]) -> list[ShardRecord]:
    """Waits for ``hosts`` to write their parts; returns their shards' records, written."""
    wait = Prepared(target.final_dir, LONG_S)
    prepared = [f.result() for f in [self.client.send(h, wait, timeout=LONG_S) for h in hosts]]
    return [c for host_sums in prepared for c in host_sums]

  def commit(self, host: int, commit: Commit | AwaitCommit) -> str:
    """``host`` commits the step (every host prepared), or, given the wait for the commit
    the sidecars agree on of a step they took over (``host`` its committer), waits for it;
    returns the committed directory, or raises why it was abandoned."""
    return self.client.send(host, commit, timeout=LONG_S).result()

  def abort(self, target: Target, hosts: Sequence[int], *, committer: int | None = None
            ) -> str | None:
    """Drops a failed save from every sidecar that answers, then its uncommitted files.

    ``committer``: the host whose sidecar commits the step (the sidecars' committer of a
    step they took over, or the host the trainer commits through), if it is one of
    ``hosts``. It is asked first, alone: every host's files lie in the step's one tmp
    directory, which its commit may be renaming, so the others remove them only once it
    said it did not commit the step (its abort refuses any commit of it from then on).
    Where it did, or did not say, nothing of the step is removed on any host: the others'
    RAM tiers let their parts go as their sidecars learn the committer's decision (a step
    taken over), or once they expire uncommitted; a tmp directory never committed is
    swept by the directory's next ``open()``.

    A host that does not answer keeps its part only until its writer gives up on the
    step (``STAGE_TIMEOUT_S`` there), and the next ``open()`` sweeps the tmp directory.

    Returns where the step is committed ("": it is not; None: not known, its committer
    did not answer).
    """
    if not target.tmp_dir:  # never begun: nothing of it on any sidecar
      return ""
    futures: dict[int, concurrent.futures.Future] = {}

    def abort_on(h: int) -> concurrent.futures.Future:
      futures[h] = self.client.send(h, Abort(target.tmp_dir, target.final_dir),
                                    timeout=_ABORT_S)
      return futures[h]

    lost = (f"step {target.step} is not saved, as expected when a host is lost during a "
            "save: it was never committed, so the job goes on from the last committed step "
            "(an elastic retry restores that one); the lost host's part is swept at the "
            "directory's next open()")
    others = list(hosts)
    if committer is not None and committer in hosts:
      others.remove(committer)
      said = self._abort_committer(target, committer, abort_on, lost)
      if said != "":  # committed, or not known: the files are the commit's to keep
        return said
    done = [h for h in futures if futures[h].exception() is None]  # the committer's
    done += on_each(
        abort_on,
        hosts=others, what=f"abort step {target.step}",
        then=(f"step {target.step} was not saved (never committed, so no restore sees it; "
              "restores take the last committed step), and that host's part of it goes "
              "when its writer gives up or at the directory's next open()"),
        lost=lost)
    # Without a committer named, one whose commit had begun (or ended) before the abort
    # came committed it: the abort left it whole, and says so.
    committed = {h: futures[h].result() for h in done if futures[h].result()}
    for h, where in committed.items():
      _committed_all_the_same(target.step, h, where)
    tmp = target.tmp_step
    if target.whole_step and done and tmp and tmp != target.tmp_dir and not committed:
      # Every host is done with the step: its tmp directory goes.
      on_each(lambda h: self.client.send(h, Abort(tmp, target.final_dir), timeout=_ABORT_S),
              hosts=done, what=f"remove step {target.step}'s tmp files")
    return next(iter(committed.values()), "")

  def _abort_committer(self, target: Target, committer: int,
                       abort_on: Callable[[int], concurrent.futures.Future], lost: str
                       ) -> str | None:
    """Aborts the step on its committer first (:meth:`abort`); returns where it committed
    it ("": it did not, and never will: it answered so, or its sidecar is gone; None: not
    known, it did not answer)."""
    try:
      committed = abort_on(committer).result()
    except errors.HostLostError as e:  # its sidecar is gone: it commits nothing any more
      _could_not(f"abort step {target.step}", committer, e, "", lost)
      return ""
    except errors.SidecarError as e:
      log.warning(
          "could not abort step %d on host %d, which commits it: %s; whether the step is "
          "committed is not known, so nothing of it is removed on any host (restores see it "
          "if its commit ends; if not, the directory's next open() sweeps its files)",
          target.step, committer, str(e))
      return None
    if committed:
      _committed_all_the_same(target.step, committer, committed)
    return committed

  def mark_committed(self, target: Target, hosts: Sequence[int], manifest_json: str = ""
                     ) -> None:
    """Tells ``hosts``' RAM tiers the step is visible (``manifest_json``: its manifest,
    where the committing sidecar alone wrote it: a DCP step's)."""
    # Durable all the same where a host does not answer: a lost host's RAM tier is gone anyway.
    told = Committed(target.final_dir, manifest_json)
    on_each(lambda h: self.client.send(h, told), hosts=hosts,
            what=f"mark step {target.step} committed in the RAM tier")

  def start_replication(self, target: Target, placement: Mapping[int, Sequence[int]], *,
                        bandwidth: int | None) -> concurrent.futures.Future | None:
    """Each host of ``placement`` sends its staged shards to its replica hosts (sidecar
    to sidecar, by host id); returns a future of their
    :class:`Replicated` once all of them hold their copies, or None where no host has
    any."""
    placement = {h: p for h, p in placement.items() if p}
    if not placement:
      return None
    # By host id only: each sidecar dials the address its own --replica-hosts gives.
    futures = [self.client.replicate(h, target.final_dir, list(to), bandwidth=bandwidth,
                                     timeout=LONG_S)
               for h, to in placement.items()]
    out: concurrent.futures.Future = concurrent.futures.Future()
    t0 = time.perf_counter()

    def done(_):
      if out.done() or not all(f.done() for f in futures):
        return
      failed = [f.exception() for f in futures if f.exception() is not None]
      try:
        if failed:
          out.set_exception(failed[0])
        else:
          results: list[Replicated] = [f.result() for f in futures]
          out.set_result(results)
          log.info("step %d: %s replicated from %d hosts in %.2f s", target.step,
                   shm.format_size(sum(r.nbytes for r in results)), len(futures),
                   time.perf_counter() - t0)
      except concurrent.futures.InvalidStateError:
        pass  # two last callbacks raced

    for f in futures:
      f.add_done_callback(done)
    return out


class Sends:
  """One save's stage calls on its hosts (:class:`Staging`), each lot sent as it is put (on
  the putting thread: a finisher's, or the copy's own under ``SaveRun.stage_copies``), a
  host's lots in order (each waits for the host's previous call to be answered)."""

  def __init__(self, protocol: SaveProtocol, staging: Staging):
    self._protocol, self._staging = protocol, staging
    self._answered = 0  # hosts whose last call answered
    self._lock = threading.Lock()
    self._last: dict[int, concurrent.futures.Future] = {}  # per host, its latest call
    self._closed = 0
    self._error: BaseException | None = None

  @property
  def done(self) -> bool:
    """Whether every host had its last lot."""
    return self._closed >= len(self._staging.hosts)

  def put(self, got: Lot | BaseException) -> None:
    """Sends ``got`` to its host; an exception fails the save (``wait`` raises it)."""
    if isinstance(got, BaseException):
      self._error = self._error or got
      return
    if self._error is not None:
      raise self._error
    host = got.host
    first = host not in self._last
    if not first:
      self._last[host].result()  # a host's lots arrive in order
    stage = self._staging.stage_of(
        got, first, len(self._protocol.writers.get(host, ())) or 1)
    try:
      self._last[host] = self._protocol.client.send(host, stage)
      if stage.begin is not None:  # the step is begun once this answers: say so at once
        self._last[host].result()
    except BaseException as e:
      if stage.begin is not None:
        self._staging.told(e)
      raise
    if stage.begin is not None:
      self._staging.told(None)
    if got.last and self._staging.whole is not None:
      self._last[host].add_done_callback(self._last_answered)
    self._closed += got.last

  def _last_answered(self, f: concurrent.futures.Future) -> None:
    """A host's last call answered: ``whole()`` once every host's has, each a success (a
    host's earlier calls were answered before its next was sent)."""
    if f.exception() is not None:
      return
    with self._lock:
      self._answered += 1
      now = self._answered == len(self._staging.hosts) and self._error is None
    if now and self._staging.whole is not None:
      self._staging.whole()

  def drain(self, lots: queue.SimpleQueue) -> None:
    """Sends the lots ``lots`` holds (``staging.Lot``s, as ``staging.Lots`` puts them;
    an exception aborts) as they come, until each of the hosts had its last: with a plan,
    each host has then taken the step over. ``whole()`` is called as soon as every host's
    last call answered (before this returns)."""
    try:
      while not self.done:
        got: Lot | BaseException = lots.get()  # no other local holds the shards, as
        if isinstance(got, BaseException):  # the raise would keep them in its frame
          raise got
        self.put(got)
    except BaseException:
      self.settle()
      raise
    self.wait()

  def settle(self) -> None:
    """Waits for every call sent, answered or failed: the abort that follows must reach
    each sidecar after its last stage call (one arriving later would stage the step
    anew, and hold its blocks until it times out)."""
    concurrent.futures.wait(list(self._last.values()))

  def wait(self) -> None:
    """Waits for every call sent; raises the save's failure, if any."""
    self.settle()
    if self._error is not None:
      raise self._error
    for f in self._last.values():
      f.result()


def on_each(start: Callable[[int], concurrent.futures.Future], *, hosts: Sequence[int],
            what: str, then: str = "", lost: str = "") -> list[int]:
  """Runs ``start(host)`` on each host at once; returns those that did it, logs the others
  (with ``then``: what that means for the user's data). With ``lost``, a host lost is the
  case expected (a save a host died in) and is logged calmly at info with that text."""
  futures: dict[int, concurrent.futures.Future] = {}
  for h in hosts:
    try:
      futures[h] = start(h)
    except errors.SidecarError as e:  # a host known lost: nothing to call
      _could_not(what, h, e, then, lost)
  ok = []
  for h, future in futures.items():
    try:
      future.result()
      ok.append(h)
    except errors.SidecarError as e:
      _could_not(what, h, e, then, lost)
  return ok


def _committed_all_the_same(step: int, host: int, where: str) -> None:
  log.warning("step %d was committed by host %d's sidecar before the abort reached it (at "
              "%s): it is saved, and restores see it; nothing of it was removed on any host; "
              "the save's error is raised all the same", step, host, where)


def _could_not(what: str, host: int, e: errors.SidecarError, then: str, lost: str) -> None:
  # The text, not the error: a handler that keeps records (pytest's, a MemoryHandler)
  # would keep its traceback's frames, and their arrays' arena blocks, alive.
  if lost and isinstance(e, errors.HostLostError):
    log.info("%s (host %d: %s)", lost, host, str(e))
  else:
    log.warning("could not %s on host %d: %s%s", what, host, str(e), f"; {then}" if then else "")
