"""Sidecars in process: what the controller's seams reach, with no process, socket, arena or disk.

One fake for every seam. ``FakeSidecars.connect(address, timeout)``, through which ``Sidecars``
reaches sidecars, answers from ``answers``: the :class:`FakeConnection` a handshake with that
address makes, or the error connecting raised. A FakeConnection's Call RPC answers each
request at once, behind a real CallWindow (``Calls``' seam). The checkpoint phases
(``FakeSidecars`` is a CheckpointTransport) keep what a step's shards become in dicts, so
Checkpointer's logic (staging in parts, commit or abort, max_to_keep, restore from the RAM
tier) runs in unit tests: ``fail={"delete": error}`` makes a phase fail with ``error``;
``calls`` records ``(phase, host)`` in order.
"""
import concurrent.futures
import json
import time

import grpc
import numpy as np

from sidecar._src.ckptfmt.dcp import distcp
from sidecar._src.ckptfmt.records import (
  CommitPlan,
  Manifest,
  Replicated,
  SavedLeaf,
)
from sidecar._src.ckptfmt.registry import DCP, ORBAX
from sidecar._src.ckptfmt.save_values import (
  Abort,
  AwaitCommit,
  Begin,
  Commit,
  Committed,
  Prepared,
  Stage,
)
from sidecar._src.ckptfmt.spec import LeafSpec
from sidecar._src.controller.checkpoint.checkpointer import Checkpointer
from sidecar._src.controller.checkpoint.client import CheckpointTransport, Held
from sidecar._src.controller.checkpoint.options import CheckpointOptions
from sidecar._src.controller.checkpoint.plugs import key_value_driver
from sidecar._src.controller.checkpoint.sidecars import SidecarsSnapshot
from sidecar._src.controller.connection import CallWindow, HostInfo
from sidecar._src.controller.framework import NumpyArrays
from sidecar._src.controller.peers import LocalPeers, Peers
from sidecar._src.core import errors
from sidecar._src.wire.protocol import pb

# The fake's method for each of a save's values (``FakeSidecars.send``).
_SENDS = {Begin: "begin", Stage: "stage", Prepared: "prepared", Commit: "commit",
          AwaitCommit: "await_commit", Committed: "committed", Abort: "abort"}


def _done(value=None, error=None) -> concurrent.futures.Future:
  f = concurrent.futures.Future()
  if error is not None:
    f.set_exception(error)
  else:
    f.set_result(value)
  return f


class FakeCallRpc:
  """``conn.call_rpc``: blocking, or ``.future()``; records each request."""

  def __init__(self, answer):
    self.answer = answer
    self.requests: list[pb.CallRequest] = []

  def __call__(self, request, *, timeout, metadata):
    self.requests.append(request)
    return self.answer(request)

  def future(self, request, *, timeout, metadata):
    out: concurrent.futures.Future = concurrent.futures.Future()
    try:
      out.set_result(self(request, timeout=timeout, metadata=metadata))
    except grpc.RpcError as e:
      out.set_exception(e)
    return out


class FakeConnection:
  """One sidecar's connection as the controller reads it: its address, what the handshake
  told (host id, devices, registry fingerprint), the status RPC, the Call RPC (``answer``,
  see :class:`FakeCallRpc`) behind a real CallWindow of ``window`` slots; close()."""

  def __init__(self, address: str = "fake:1", host_id: int = 0, *, fingerprint: str = "f1",
               device_ids: tuple[int, ...] = (), answer=None, window: int = 4):
    self.address = address
    self.info = HostInfo(host_id=host_id, slice_id=0, device_ids=device_ids,
                         hostname="fake", pid=100 + host_id, address=address,
                         functions=("double",), pipelines=(),
                         registry_fingerprint=fingerprint, versions={})
    self.reply = pb.HandshakeResponse()  # no boot id: never on this machine
    self.status_rpc = f"status of {address}"
    self.metadata = (("session", address),)
    self.calls = CallWindow(window, name=address)
    self.call_rpc = FakeCallRpc(answer)
    self.closed = False

  def close(self) -> None:
    self.closed = True


class DictPeers(Peers):
  """Trainer processes as threads of one Python process, agreeing through ``store``."""

  def __init__(self, store: dict, index: int, count: int):
    self._store, self.index, self.count = store, index, count

  def publish(self, key, value):
    self._store[f"{key}/{self.index}"] = value

  def read(self, key, process, *, timeout):
    deadline = time.monotonic() + timeout
    while f"{key}/{process}" not in self._store:
      if time.monotonic() > deadline:
        raise errors.DeadlineExceededError(f"process {process} gave no {key!r}")
      time.sleep(0.01)
    return self._store[f"{key}/{process}"]


class FakeSidecars(CheckpointTransport):
  """Sidecars ``hosts`` whose checkpoint directories hold ``steps`` already, reached at the
  addresses of ``answers`` (address -> FakeConnection, or the error connecting raises)."""

  def __init__(self, hosts=(0,), *, answers=None, steps=(), fail=None):
    self.hosts = list(hosts)
    self.answers = dict(answers or {})
    self.made: list[FakeConnection] = []  # the connections handed out, in order
    self.asked: list[str] = []  # the addresses connect was asked for, in order
    self.fail = dict(fail or {})
    self.calls: list[tuple[str, int]] = []
    self.steps: dict[str, set[int]] = {}
    self.initial = list(steps)
    self.leaves: dict[str, list[LeafSpec]] = {}  # final dir -> its leaves
    self.staged: dict[tuple[int, str], dict] = {}  # (host, final dir) -> {(kp, index): array}
    self.records: dict[tuple[int, str], dict] = {}  # (host, final dir) -> {(kp, index): record}
    self.manifests: dict[str, Manifest] = {}  # final dir -> its manifest, once committed
    self.aborted: list[tuple[int, str]] = []
    self.items: dict[tuple[str, int], int] = {}  # (final dir, DCP rank) -> its item count
    self.told: list[tuple[int, str, str]] = []  # committed: (host, final dir, manifest_json)
    self.plans: dict[str, CommitPlan] = {}  # final dir -> the plan its last Stages carried
    self.finals: dict[str, str] = {}  # tmp dir -> final dir, as staged

  def _call(self, name: str, host: int, value=None) -> concurrent.futures.Future:
    self.calls.append((name, host))
    if host not in self.hosts:
      raise errors.HostLostError(f"host {host} is lost", host_id=host)
    return _done(value, self.fail.get(name))

  def connect(self, address: str, timeout: float) -> FakeConnection:
    """Hosts' seam: the answer for ``address``, returned or raised."""
    del timeout
    self.asked.append(address)
    answer = self.answers[address]
    if isinstance(answer, Exception):
      raise answer
    self.made.append(answer)
    return answer

  def put(self, host, data):
    return np.array(data)

  def status(self, *, timeout=None):
    return [pb.StatusResponse(identity=pb.HostIdentity(host_id=h), arena_size=1 << 30)
            for h in self.hosts]

  def open(self, host, directory, *, ram_steps, ram_budget, sweep, job="", holder=""):
    steps = self.steps.setdefault(directory, set(self.initial))
    return self._call("open", host, sorted(steps))

  def send(self, host, value, *, timeout=None):
    """The transport's one call for a save's values: the method named for the value's
    type (a test's subclass overrides one to see, or change, what that value does)."""
    return getattr(self, _SENDS[type(value)])(host, value)

  def begin(self, host, begin):
    directory, step, format = begin.directory, begin.step, begin.format
    if format == DCP:  # the checkpoint's own directory: its tmp one beside it
      return self._call("begin", host, f"{directory}.dcp-checkpoint-tmp")
    assert format == ORBAX, format
    return self._call("begin", host, f"{directory}/{step}.orbax-checkpoint-tmp")

  def stage(self, host, stage):
    tmp_dir, final_dir = stage.tmp_dir, stage.final_dir
    leaves, shards, extra, plan = stage.leaves, stage.shards, stage.extra, stage.plan
    if stage.begin is not None:  # the step begun by its first part: a Begin's call and failure
      begun = self.begin(host, stage.begin)
      if begun.exception() is not None:
        return begun
    if leaves:
      self.leaves[final_dir] = list(leaves)
    if plan is not None and (plan.lead or final_dir not in self.plans):
      self.plans[final_dir] = plan
    self.finals[tmp_dir] = final_dir
    if extra is not None:  # a DCP rank's part: its item count, the same in each part
      assert self.items.setdefault((final_dir, extra.rank), extra.item_count) == extra.item_count
    held = self.staged.setdefault((host, final_dir), {})
    records = self.records.setdefault((host, final_dir), {})
    for s in shards:
      r = s.record
      if extra is not None:  # each item is its record
        assert 0 <= r.leaf < extra.item_count and r.rank == extra.rank
        distcp.Item.of_record(r)
      else:
        assert r.id.key_path == self.leaves[final_dir][r.leaf].key_path
      assert r.host == host
      held[r.id] = np.array(s.data)
      records[r.id] = r
    return self._call("stage", host, sum(a.nbytes for a in held.values()))

  def prepared(self, host, prepared):
    self.calls.append(("prepared", host))
    return self.written(host, prepared.final_dir)

  def written(self, host, final_dir) -> concurrent.futures.Future:
    """Future of ``host``'s records of the step once written (``fail["prepared"]``: its
    write fails), as Prepared answers, or as the sidecars' agreement learns it."""
    if host not in self.hosts:
      raise errors.HostLostError(f"host {host} is lost", host_id=host)
    return _done(list(self.records.get((host, final_dir), {}).values()),
                 self.fail.get("prepared"))

  def agreed(self, host, tmp_dir, *, final_dir=None):
    """What the sidecars' agreement commits a step taken over with, committer ``host``:
    (leaves, every host's written records, data position, replicas), or the error of
    a host whose write failed."""
    final = final_dir or self.finals[tmp_dir]
    plan = self.plans[final]
    assert plan.committer == host
    written = [self.written(h, final) for h in plan.hosts]
    failed = next((f.exception() for f in written if f.exception() is not None), None)
    if failed is not None:
      raise failed
    self.told.append((host, final, ""))  # the committer marks its RAM tier
    return (self.leaves[final], [r for f in written for r in f.result()],
            plan.data_state_json, plan.replicas)

  def commit(self, host, commit):
    return self._commit(host, commit.tmp_dir, commit.step, commit.extra, lambda: (
        commit.leaves, commit.shards, commit.data_state_json, commit.replicas))

  def await_commit(self, host, wait):
    """As the sidecars' agreement commits a step taken over: every host's records once
    written."""
    return self._commit(host, wait.tmp_dir, wait.step, None,
                        lambda: self.agreed(host, wait.tmp_dir), final=self.finals.__getitem__)

  def _commit(self, host, tmp_dir, step, extra, contents, final=None):
    future = self._call("commit", host, tmp_dir)
    if future.exception() is None:
      dcp = extra is not None
      try:
        leaves, shards, data_state_json, replicas = contents()
      except errors.SidecarError as e:
        return _done(error=e)
      found = final(tmp_dir) if final is not None else tmp_dir.replace(
          ".dcp-checkpoint-tmp" if dcp else ".orbax-checkpoint-tmp", "")
      self.manifests[found] = Manifest(DCP if dcp else ORBAX,
                                       tuple(SavedLeaf.of(s) for s in leaves), tuple(shards),
                                       json.loads(data_state_json) if data_state_json else None,
                                       {int(h): tuple(p) for h, p in (replicas or {}).items()},
                                       extras={"plan": extra.plan()} if dcp else None,
                                       step=step)
      directory = found.rsplit("/", 1 if dcp else 2)[0]
      self.steps.setdefault(directory, set()).add(step)
    return future

  def committed(self, host, committed):
    self.told.append((host, committed.final_dir, committed.manifest_json))
    return self._call("committed", host, [])

  def abort(self, host, abort):
    self.aborted.append((host, abort.tmp_dir))
    self.staged.pop((host, abort.final_dir), None)
    self.records.pop((host, abort.final_dir), None)
    return self._call("abort", host, "")  # aborted ("": no commit of it here)

  def delete(self, host, directory, step, *, set_aside=False):
    future = self._call("delete", host)
    if future.exception() is None:
      there = step in self.steps[directory]
      self.steps[directory].discard(step)
      if set_aside:
        moved: concurrent.futures.Future = concurrent.futures.Future()
        moved.set_result(f"{directory}/set-aside-{step}" if there else "")
        return moved
    return future

  def forget(self, host, directory, step):
    return self._call("forget", host)

  def replicate(self, host, final_dir, targets, *, bandwidth, timeout):
    assert all(type(t) is int for t in targets), targets  # host ids: never an address
    return self._call("replicate", host, Replicated(tuple(targets), 0, 0, 0.0))

  def held(self, host, directory, *, timeout=None):
    own = {item: list(shards) for (h, item), shards in self.staged.items()
           if h == host and item in self.manifests}
    return self._call("held", host, Held(own=own, replicas={}))

  def info(self, host, final_dir, *, taken_over=False):
    manifest = self._taken_over(host, final_dir) if taken_over else self.manifests.get(final_dir)
    if manifest is None:
      return _done(error=errors.InvalidArgumentError(f"cannot restore {final_dir}"))
    return self._call("info", host, manifest)

  def _taken_over(self, host, final_dir) -> Manifest | None:
    """``host``'s part of a step staged with a plan (taken over), as a sidecar's Info
    taken_over answers it: its records, the lead's data position on the committer."""
    plan = self.plans.get(final_dir)
    if plan is None or (host, final_dir) not in self.records:
      return None
    return Manifest.of_save(
        ORBAX, step=int(final_dir.rstrip("/").split("/")[-2]), leaves=self.leaves[final_dir],
        shards=list(self.records[(host, final_dir)].values()),
        data_state_json=plan.data_state_json if host == plan.committer else "", replicas=None)

  def read(self, host, final_dir, record, *, tier, checked=True, byte_range=None,
           private=False):
    data = self.staged.get((host, final_dir), {}).get(record.id)
    if data is None:
      return _done(error=errors.InvalidArgumentError(f"host {host} holds no copy of {record.id}"))
    return self._call("read", host, data)


def checkpointer(fake: CheckpointTransport, *, hosts=None, local=None, peers: Peers | None = None,
                 handshakes=None, directory: str = "/ckpt/run", framework=None, live=None,
                 **options) -> Checkpointer:
  """The one Checkpointer over ``fake`` (its hosts, or ``hosts``; this process stages into
  ``local``, default all) with the key-value driver and ``framework`` (default numpy
  arrays): ``options`` are CheckpointOptions'. ``live``: the live hosts as a controller's
  watch sees them now (a callable), which the checkpointer follows; None: fixed hosts."""
  hosts = tuple(getattr(fake, "hosts", (0,)) if hosts is None else hosts)

  def snapshot(hosts, local) -> SidecarsSnapshot:
    return SidecarsSnapshot(
        client=fake, hosts=hosts, local=local, device_hosts={}, mapped=frozenset(),
        writers={}, handshakes={h: {} for h in hosts} if handshakes is None else handshakes,
        live=live, now=None if live is None else lambda: snapshot(live(), live()))

  site = snapshot(hosts, tuple(hosts if local is None else local))
  o, peers = CheckpointOptions(**options), peers if peers is not None else LocalPeers()
  return Checkpointer(directory, site=site, options=o, peers=peers, key="ckpt",
                      driver=key_value_driver(options=o, peers=peers,
                                              framework=framework or NumpyArrays()))
