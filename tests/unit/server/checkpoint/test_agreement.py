"""The sidecars' own commit of a step they took over (``agreement.Agreements``), on real
step writers and real files under tmp_path, two hosts whose ``Agree`` calls go straight to
each other in this process (a real fake of the link: a host "dies" by no longer answering,
HostLostError, as a link to a dead sidecar says). No server, no processes."""

import dataclasses
import errno
import json
import os
import threading

import numpy as np
import pytest

from sidecar._src.ckptfmt import records, registry as formats_lib, spec as spec_lib
from sidecar._src.ckptfmt.orbax.format import OrbaxFormat
from sidecar._src.ckptfmt.records import CommitPlan
from sidecar._src.ckptfmt.save_values import Abort, Begin, Commit, Stage
from sidecar._src.core import errors
from sidecar._src.server import metrics as metrics_lib
from sidecar._src.server.checkpoint import (
  agreement as agreement_lib,
  links as links_lib,
  ram_tier,
  roots as roots_lib,
  save as checkpoint_save,
)
from sidecar._src.server.checkpoint.caller import Caller
from sidecar._src.server.checkpoint.step import Takeover
from tests.conftest import eventually
from tests.support.staged import staged

pytestmark = pytest.mark.unit

POLL_S, SILENT_S = agreement_lib.POLL_S, agreement_lib.SILENT_S  # before `job` shortens them
SPECS = [spec_lib.LeafSpec(key_path=("w",), shape=(4, 2), dtype=np.float32, write_shape=(2, 2))]
STEP = 3


class Gated(OrbaxFormat):
  """The real Orbax format; each host's write waits for its gate, or fails with ``fail``."""

  def __init__(self):
    self.gates = {0: threading.Event(), 1: threading.Event()}
    self.fail: dict[int, BaseException] = {}

  def write(self, tmp_dir, host_id, numbering, incoming, *, progress, turn):
    assert self.gates[host_id].wait(30)
    if host_id in self.fail:
      raise self.fail[host_id]
    return super().write(tmp_dir, host_id, numbering, incoming, progress=progress, turn=turn)


class Host:
  """One sidecar's checkpoint parts: its RAM tier, step writer and agreements."""

  def __init__(self, host_id, tmp_path, fmt, links):
    self.id, self.threads, self.closed = host_id, [], threading.Event()
    self.tier = ram_tier.RamTier(host_id, uncommitted_s=3600.0)
    self.writer = checkpoint_save.StepWriter(
        host_id, tier=self.tier, roots=roots_lib.Roots(host_id, (str(tmp_path),)),
        spawn=self.spawn, metrics=metrics_lib.Recorder(),
        formats=formats_lib.DEFAULT.replacing(fmt),
        take_over=lambda record: self.agreements.take_over(record))
    self.agreements = agreement_lib.Agreements(
        host_id, tier=self.tier, writer=self.writer, links=links,
        hosts=links_lib.ReplicaHosts(["127.0.0.1:1", "127.0.0.1:2"]), spawn=self.spawn,
        closed=self.closed)

  def spawn(self, target, *args, name):
    t = threading.Thread(target=target, args=args, name=name, daemon=True)
    self.threads.append(t)
    t.start()

  def committing(self):
    return [s.step for s in self.tier.steps() if s.takeover is Takeover.PENDING]


class Links:
  """The hosts' Agree calls, in this process: to a host that is gone, HostLostError."""

  def __init__(self):
    self.hosts: dict[int, Host] = {}
    self.gone: set[int] = set()

  def agree(self, receiver, state, *, timeout):
    if receiver.host_id in self.gone:
      raise errors.HostLostError(f"host {receiver.host_id} is gone", host_id=receiver.host_id)
    return self.hosts[receiver.host_id].agreements.agree(state)


@pytest.fixture
def job(tmp_path, monkeypatch):
  monkeypatch.setattr(agreement_lib, "POLL_S", 0.05)
  monkeypatch.setattr(agreement_lib, "SILENT_S", 0.3)
  fmt, links = Gated(), Links()
  hosts = [Host(h, tmp_path, fmt, links) for h in (0, 1)]
  links.hosts = dict(enumerate(hosts))
  yield hosts, fmt, links
  for g in fmt.gates.values():
    g.set()
  for h in hosts:
    h.closed.set()
  for h in hosts:
    for t in h.threads:
      t.join(30)
      assert not t.is_alive(), t.name


def begin(hosts, tmp_path, *, alive=lambda: True):
  """Host 0 begins step 3; its item's tmp and final directories."""
  directory = str(tmp_path / "ck")
  hosts[0].writer.open(directory)
  tmp = hosts[0].writer.begin(Begin(directory, STEP, "orbax"), Caller(owner="trainer", alive=alive))
  return directory, os.path.join(tmp, spec_lib.ITEM), str(tmp_path / "ck" / str(STEP) /
                                                           spec_lib.ITEM)


def stage(host, directory, tmp_dir, final, *, rows, plan, alive):
  """The host's part of step 3 (rows ``rows`` of ``w``), its last, with ``plan``."""
  data = np.full((rows[1] - rows[0], 2), float(host.id + 1), np.float32)
  return host.writer.stage(Stage(directory, STEP, tmp_dir, final, SPECS,
                                 [staged(("w",), 0, (rows, (0, 2)), data)], last=True,
                                 plan=plan), Caller(owner="trainer", worker=f"w{host.id}",
                                                    alive=alive))


def plan(hosts=(0, 1), **kw):
  return CommitPlan(save="s1", committer=0, hosts=tuple(hosts), lead=True,
                    data_state_json='{"batch": 9}', **kw)


def test_two_hosts_commit_a_step_whose_trainers_died_once_it_was_staged(job, tmp_path):
  """Staged whole on both hosts (taken over before each last Stage answered), then every
  trainer gone while the writes are held: the sidecars commit it, with both parts and the
  lead's data position; the host that did not commit learns it; an open waits for it."""
  hosts, fmt, _ = job
  alive = [True]
  directory, tmp_dir, final = begin(hosts, tmp_path, alive=lambda: alive[0])
  for h, rows in zip(hosts, ((0, 2), (2, 4)), strict=True):
    stage(h, directory, tmp_dir, final, rows=rows, plan=plan(), alive=lambda: alive[0])
  assert [h.committing() for h in hosts] == [[STEP], [STEP]]
  alive[0] = False  # every trainer dies
  steps: list = []
  reopen = threading.Thread(target=lambda: steps.extend(hosts[0].writer.open(directory)))
  reopen.start()  # the restarted trainer's: it waits, and sweeps nothing
  reopen.join(0.3)
  assert reopen.is_alive() and os.path.isdir(os.path.dirname(tmp_dir))
  for g in fmt.gates.values():
    g.set()
  reopen.join(30)
  assert steps == [STEP]
  assert eventually(lambda: [h.committing() for h in hosts] == [[], []], timeout=30)
  assert all(h.tier.find(final).committed for h in hosts)  # both RAM tiers hold it
  with open(os.path.join(final, records.MANIFEST_FILE)) as f:
    manifest = json.load(f)
  assert manifest["data_state"] == {"batch": 9}
  assert sorted(s["host"] for s in manifest["shards"]) == [0, 1]


def test_a_host_whose_write_fails_makes_the_step_abandoned_with_its_error(job, tmp_path):
  hosts, fmt, _ = job
  fmt.fail[1] = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "f"))
  directory, tmp_dir, final = begin(hosts, tmp_path)
  for h, rows in zip(hosts, ((0, 2), (2, 4)), strict=True):
    stage(h, directory, tmp_dir, final, rows=rows, plan=plan(), alive=lambda: True)
  for g in fmt.gates.values():
    g.set()
  with pytest.raises(errors.CheckpointWriteError,
                     match=r"host 1 could not write step 3: No space left on device") as e:
    hosts[0].agreements.await_commit(os.path.realpath(tmp_dir), STEP, "trainer", 30)
  assert (e.value.errno, e.value.host_id) == (errno.ENOSPC, 1)
  assert eventually(lambda: [h.committing() for h in hosts] == [[], []], timeout=30)
  assert hosts[0].writer.open(directory) == []


def test_a_host_whose_sidecar_dies_before_its_part_is_written_leaves_the_step_unlisted(
    job, tmp_path):
  """Host 1 takes the step over, then its sidecar dies mid-write: the committer hears
  nothing, asks it, finds it gone, and abandons the step (its trainers gone too); the
  torn step is never listed, and the next open sweeps it."""
  hosts, fmt, links = job
  alive = [True]
  directory, tmp_dir, final = begin(hosts, tmp_path, alive=lambda: alive[0])
  for h, rows in zip(hosts, ((0, 2), (2, 4)), strict=True):
    stage(h, directory, tmp_dir, final, rows=rows, plan=plan(), alive=lambda: alive[0])
  alive[0] = False  # staged everywhere, then every trainer gone
  links.gone.add(1)
  hosts[1].closed.set()  # its threads stop with it
  fmt.gates[0].set()  # host 1's part is never written
  with pytest.raises(errors.HostLostError, match="host 1's sidecar is gone before its part"):
    hosts[0].agreements.await_commit(os.path.realpath(tmp_dir), STEP, "trainer", 30)
  assert hosts[0].committing() == [] and hosts[0].tier.find(final) is None  # its part let go
  assert hosts[0].writer.open(directory) == []
  assert os.listdir(directory) == []  # swept


def test_a_host_gone_mid_save_is_found_within_a_few_heartbeats_not_seconds(
    job, tmp_path, monkeypatch):
  """Issue 69: a save in flight at a host loss held the trainer's next save ~5 s: its
  committer waited SILENT_S=5 s of silence before asking the lost host. With the real
  heartbeat, host 1's death mid-write is found and the save abandoned within 4 s (the old
  wait could not end before 5 s); the trainers, alive, learn it from their Commit."""
  monkeypatch.setattr(agreement_lib, "POLL_S", POLL_S)
  monkeypatch.setattr(agreement_lib, "SILENT_S", SILENT_S)
  hosts, fmt, links = job
  directory, tmp_dir, final = begin(hosts, tmp_path)
  for h, rows in zip(hosts, ((0, 2), (2, 4)), strict=True):
    stage(h, directory, tmp_dir, final, rows=rows, plan=plan(), alive=lambda: True)
  links.gone.add(1)
  hosts[1].closed.set()  # its threads stop with it: no heartbeat any more
  fmt.gates[0].set()  # host 1's part is never written
  with pytest.raises(errors.HostLostError, match="host 1's sidecar is gone before its part"):
    hosts[0].agreements.await_commit(os.path.realpath(tmp_dir), STEP, "trainer", 4.0)


def test_hosts_of_a_committer_that_died_let_their_part_go(job, tmp_path):
  hosts, fmt, links = job
  alive = [True]
  directory, tmp_dir, final = begin(hosts, tmp_path, alive=lambda: alive[0])
  for h, rows in zip(hosts, ((0, 2), (2, 4)), strict=True):
    stage(h, directory, tmp_dir, final, rows=rows, plan=plan(), alive=lambda: alive[0])
  alive[0] = False  # staged everywhere, then every trainer gone
  links.gone.add(0)
  hosts[0].closed.set()
  fmt.gates[1].set()
  assert eventually(lambda: hosts[1].committing() == [], timeout=30)
  assert hosts[1].tier.find(final) is None  # its trainers gone: its blocks go back now


def test_a_part_never_whole_with_its_trainers_gone_is_abandoned_and_refused_later(
    job, tmp_path):
  """Host 0's part is whole, host 1's never came, and the trainers are gone: the
  committer abandons the step; host 1's last part, come late, is refused (its trainer's
  save fails: it had not returned)."""
  hosts, fmt, _ = job
  alive = [True]
  directory, tmp_dir, final = begin(hosts, tmp_path, alive=lambda: alive[0])
  stage(hosts[0], directory, tmp_dir, final, rows=(0, 2), plan=plan(), alive=lambda: alive[0])
  alive[0] = False
  fmt.gates[0].set()
  with pytest.raises(errors.ClosedError, match=r"host\(s\) \[1\] never had their part whole"):
    hosts[0].agreements.await_commit(os.path.realpath(tmp_dir), STEP, "trainer", 30)
  with pytest.raises(errors.ClosedError, match="abandoned this save before this host's part"):
    stage(hosts[1], directory, tmp_dir, final, rows=(2, 4), plan=plan(), alive=lambda: True)
  assert hosts[1].committing() == []


def test_one_host_commits_a_step_whose_trainer_died_and_refuses_the_trainers_commit(job,
                                                                                   tmp_path):
  hosts, fmt, _ = job
  directory, tmp_dir, final = begin(hosts, tmp_path, alive=lambda: False)
  stage(hosts[0], directory, tmp_dir, final, rows=(0, 4), plan=plan(hosts=(0,)),
        alive=lambda: False)
  with pytest.raises(errors.PermissionDeniedError, match="being committed already"):
    hosts[0].writer.commit(Commit(tmp_dir=tmp_dir, step=STEP, num_hosts=1, leaves=SPECS, shards=[],
                                  data_state_json="", whole_step=True), Caller(owner="trainer"))
  fmt.gates[0].set()
  assert hosts[0].agreements.await_commit(os.path.realpath(tmp_dir), STEP, "trainer",
                                          30) == str(tmp_path / "ck" / str(STEP))
  assert hosts[0].tier.find(final).committed and hosts[0].committing() == []
  with pytest.raises(errors.PermissionDeniedError, match="this session staged"):
    hosts[0].agreements.await_commit(os.path.realpath(tmp_dir), STEP, "another", 30)


def test_a_part_whose_committer_never_began_the_save_is_refused(job, tmp_path):
  """A plan naming a committer that began no such save (a client's made-up plan) makes
  that committer keep nothing: the Stage that would take the step over fails."""
  hosts, _, _ = job
  directory = str(tmp_path / "ck")
  hosts[1].writer.open(directory)
  tmp_dir = os.path.join(hosts[1].writer.begin(Begin(directory, STEP, "orbax"),
                                               Caller(owner="trainer")),
                         spec_lib.ITEM)
  final = str(tmp_path / "ck" / str(STEP) / spec_lib.ITEM)
  with pytest.raises(errors.ClosedError, match="its committer, host 0, knows no such save"):
    stage(hosts[1], directory, tmp_dir, final, rows=(2, 4), plan=plan(), alive=lambda: True)
  assert hosts[1].committing() == [] and hosts[0].agreements._saves == {}


def test_a_step_saved_again_after_an_abort_waits_for_its_own_commit(job, tmp_path):
  """The trainers abort step 3 (a host lost), then save it again: their Commit waits for the
  new save's commit, not the aborted one's end (kept a while for hosts that ask late)."""
  hosts, fmt, _ = job
  directory, tmp_dir, final = begin(hosts, tmp_path)
  stage(hosts[0], directory, tmp_dir, final, rows=(0, 4), plan=plan(hosts=(0,)),
        alive=lambda: True)
  hosts[0].agreements.abort(final)  # as the service's Abort: the agreement, then the part
  fmt.gates[0].set()  # (its write ends, abandoned)
  hosts[0].writer.abort(Abort(os.path.dirname(tmp_dir), final), Caller())
  directory, tmp_dir, final = begin(hosts, tmp_path)
  stage(hosts[0], directory, tmp_dir, final, rows=(0, 4),
        plan=dataclasses.replace(plan(hosts=(0,)), save="s2"), alive=lambda: True)
  assert hosts[0].agreements.await_commit(os.path.realpath(tmp_dir), STEP, "trainer",
                                          30) == str(tmp_path / "ck" / str(STEP))
