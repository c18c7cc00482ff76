"""Tier 1: the one Checkpointer's own logic (fakes, threads as processes): the processes'
agreement on each save, the tmp directory Begin answered, the format chosen, and close()
joining every thread a save started."""

import concurrent.futures
import dataclasses
import threading

import numpy as np
import pytest

from sidecar._src.ckptfmt import registry as formats_lib
from sidecar._src.controller.checkpoint import (
  checkpointer as checkpointer_lib,
  orbax_items,
  rollback,
)
from sidecar._src.controller.checkpoint.options import CheckpointOptions
from sidecar._src.controller.checkpoint.save_protocol import Target
from sidecar._src.controller.checkpoint.sidecars import SidecarsSnapshot
from sidecar._src.controller.framework import DeviceCopy, NumpyArrays
from sidecar._src.controller.peers import LocalPeers
from sidecar._src.core import errors
from tests.conftest import eventually
from tests.support.fake_sidecars import DictPeers, FakeSidecars, checkpointer

pytestmark = pytest.mark.unit


class HeldWrites(FakeSidecars):
  """Step 1's writes end (prepared) only once ``release`` is set."""

  def __init__(self, **kw):
    super().__init__(**kw)
    self.release = threading.Event()

  def written(self, host, final_dir):
    if "/1/" in final_dir + "/":
      assert self.release.wait(30)
    return super().written(host, final_dir)


def test_a_save_after_a_skipped_one_agrees_on_its_own_step_in_every_process():
  """A skipped save left the agreement's key to the next save, which read the skipped
  one's values: 'the 2 processes disagree on the step of save 2: process 0: step 3;
  process 1: step 2'."""
  fake, store = HeldWrites(hosts=(0, 1)), {}
  both = threading.Barrier(2)
  outcomes: list = [None, None]

  def process(p: int) -> None:
    with checkpointer(fake, hosts=[0, 1], local=[p], peers=DictPeers(store, p, 2),
                      if_busy="skip") as ckpt:
      first = ckpt.save(1, {"x": np.ones(3, np.float32)})
      skipped = ckpt.save(2, {"x": np.ones(3, np.float32)})
      both.wait(30)
      fake.release.set()
      first.durable.result(30)
      outcomes[p] = (skipped.durable.result(30), ckpt.save(3, {"x": np.zeros(3, np.float32)})
                     .durable.result(30))

  threads = [threading.Thread(target=process, args=(p,)) for p in (0, 1)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  assert outcomes == [(None, 3), (None, 3)]


def rollbacks_in_two_processes(fake):
  """Each of two processes saves step 1 (its writes held: not durable) and rolls back to
  the step taken over (``rollback.restore_taken_over``); their answers."""
  store, outcomes, latest = {}, [None, None], ["?", "?"]
  both = threading.Barrier(2)

  def process(p: int) -> None:
    with checkpointer(fake, hosts=[0, 1], local=[p], peers=DictPeers(store, p, 2)) as ckpt:
      ckpt.save(1, {"x": np.full(3, 7, np.float32)}, data_state={"at": 1})
      try:
        got = rollback.restore_taken_over(ckpt, {"x": np.zeros(3, np.float32)})
        outcomes[p] = got if got is None else (got[0], got[1]["x"].tolist(), got[2])
        latest[p] = ckpt.latest_step()
        both.wait(30)  # neither lets the writes go before both rolled back
      finally:
        fake.release.set()

  threads = [threading.Thread(target=process, args=(p,)) for p in (0, 1)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  assert latest == [None, None]  # not durable while they rolled back
  return outcomes


def test_every_process_rolls_back_to_the_step_taken_over_before_it_is_durable():
  assert rollbacks_in_two_processes(HeldWrites(hosts=(0, 1))) == [
      (1, [7.0, 7.0, 7.0], {"at": 1})] * 2


class NoPartOnHost0(HeldWrites):
  """Host 0 holds no part of a step taken over (its write failed: it let it go)."""

  def info(self, host, final_dir, *, taken_over=False):
    if taken_over and host == 0:
      return self._call("info", 5)  # host 5 is none of them: HostLostError
    return super().info(host, final_dir, taken_over=taken_over)


def test_a_step_taken_over_that_does_not_restore_whole_is_rolled_back_to_by_no_process():
  assert rollbacks_in_two_processes(NoPartOnHost0(hosts=(0, 1))) == [None, None]


class OwnTmp(FakeSidecars):
  """A sidecar whose begin answers a tmp directory of its own naming; records where each
  stage and the commit write."""

  def __init__(self, **kw):
    super().__init__(**kw)
    self.tmp_dirs: list[tuple[str, str]] = []

  def begin(self, host, begin):
    return self._call("begin", host, f"{begin.directory}/{begin.step}.orbax-checkpoint-tmp-1234")

  def stage(self, host, stage):
    self.tmp_dirs.append(("stage", stage.tmp_dir))
    return super().stage(host, stage)

  def commit(self, host, commit):
    self.tmp_dirs.append(("commit", commit.tmp_dir))
    return super().commit(host, commit)

  def await_commit(self, host, wait):
    self.tmp_dirs.append(("commit", wait.tmp_dir))
    return super().await_commit(host, wait)


def test_a_step_is_written_in_the_tmp_directory_begin_answered():
  """Target once worked the directory out itself and ignored begin's answer (a process
  that stages on two hosts begins its steps with a Begin of their own)."""
  fake = OwnTmp(hosts=(0, 1))
  with checkpointer(fake) as ckpt:
    assert ckpt.save(7, {"x": np.ones(3, np.float32)}).durable.result(30) == 7
  assert ("begin", 0) in fake.calls
  assert {d for _, d in fake.tmp_dirs} == {"/ckpt/run/7.orbax-checkpoint-tmp-1234/default"}


class BeginsByStage(FakeSidecars):
  """Records the format of the Begin each stage carries (empty: none)."""

  def __init__(self, **kw):
    super().__init__(**kw)
    self.begins: list[tuple[int, str]] = []

  def stage(self, host, stage):
    self.begins.append((host, stage.begin.format if stage.begin is not None else ""))
    return super().stage(host, stage)


def test_a_process_that_stages_on_one_host_begins_its_step_with_its_first_stage():
  """One round trip: the step's first Stage begins it (issue 69, item 5)."""
  fake = BeginsByStage(hosts=(0,))
  with checkpointer(fake) as ckpt:
    assert ckpt.save(7, {"x": np.ones(3, np.float32)}).durable.result(30) == 7
  assert fake.begins == [(0, "orbax")]
  assert [c for c in fake.calls if c[0] == "begin"] == [("begin", 0)]  # by the stage


def test_a_first_stage_that_cannot_begin_the_step_fails_the_save_and_removes_nothing():
  fake = BeginsByStage(hosts=(0,), fail={"begin": errors.PermissionDeniedError(
      "begin: step 7 is being saved by another checkpointer")})
  with checkpointer(fake) as ckpt:
    handle = ckpt.save(7, {"x": np.ones(3, np.float32)})
    with pytest.raises(errors.PermissionDeniedError, match="being saved by another"):
      handle.durable.result(30)
    assert fake.aborted == []  # never begun here: another's files are not removed
    assert ckpt.all_steps() == []


def test_the_format_is_chosen_explicitly_and_one_the_framework_cannot_write_is_refused():
  # A JAX (or numpy) save writes Orbax's layout unless told; it makes none of DCP's parts.
  fake = FakeSidecars()
  ckpt = checkpointer(fake, format="orbax")
  assert ckpt.save(1, {"w": np.ones(3, np.float32)}).durable.result() == 1
  with pytest.raises(errors.InvalidArgumentError, match=r"'dcp' is not one a JAX save writes"):
    checkpointer(FakeSidecars(), format="dcp")


def ours(prefix: str) -> list[threading.Thread]:
  return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


class SlowReplicas(FakeSidecars):
  """Replication that ends when the test says (``replicated[step].set()``)."""

  def __init__(self, **kw):
    super().__init__(**kw)
    self.pending: list[tuple[str, concurrent.futures.Future]] = []

  def replicate(self, host, final_dir, peers, *, bandwidth, timeout):
    self.calls.append(("replicate", host))
    out: concurrent.futures.Future = concurrent.futures.Future()
    self.pending.append((final_dir, out))
    return out

  def finish(self, step: int) -> None:
    for item, f in self.pending:
      if f"/{step}/" in item + "/" and not f.done():
        f.set_result({"peers": [], "shards": 0, "bytes": 0, "seconds": 0.0})


def test_close_joins_an_older_saves_finisher_still_settling_its_replication():
  """With replicas, save 1's finisher waits for its replication after durable, while
  save 2 runs: it was no longer the SaveRunner's, and close() did not wait for it."""
  fake = SlowReplicas(hosts=(0, 1))
  ckpt = checkpointer(fake, hosts=[0, 1], replicas=1)
  assert ckpt.save(1, {"x": np.ones(3, np.float32)}).durable.result(30) == 1
  second = ckpt.save(2, {"x": np.ones(3, np.float32)})
  assert second.durable.result(30) == 2
  fake.finish(2)
  assert second.replicated.result(30) == 2
  closing = threading.Thread(target=ckpt.close, name="test-close")
  closing.start()
  closing.join(0.5)
  assert closing.is_alive()  # step 1's finisher still settles: close waits for it
  fake.finish(1)
  closing.join(30)
  assert not closing.is_alive() and ours("sidecar-save-") == []


def test_a_restore_without_a_target_says_how_to_build_one():
  # Issue 55 item 7: it said only "restore needs a target: the tree (or state dict) to
  # restore onto", not how to make one without the state in hand.
  fake = FakeSidecars(hosts=(0,))
  with checkpointer(fake, hosts=[0], local=[0]) as ckpt:
    ckpt.save(0, {"x": np.ones(3, np.float32)}).durable.result(30)
    with pytest.raises(errors.InvalidArgumentError, match=(
        r"restore needs a target: .* jax\.eval_shape\(init\) with a jax\.ShapeDtypeStruct\("
        r"shape, dtype, sharding=NamedSharding\(mesh, spec\)\) for each leaf; under "
        r"sidecar\.torch\.Checkpointer: model\.state_dict\(\)")):
      ckpt.restore(0)


class FailsStep(FakeSidecars):
  """The writes of steps ``steps`` fail with a full disk on host 0."""

  def __init__(self, *steps: int, **kw):
    super().__init__(**kw)
    self.failing = set(steps)

  def _full(self, host, step):
    failed: concurrent.futures.Future = concurrent.futures.Future()
    failed.set_exception(errors.CheckpointWriteError(
        f"host {host} could not write step {step}: No space left on device (ENOSPC)",
        host_id=host))
    return failed

  def written(self, host, final_dir):
    step = next((s for s in self.failing if f"/{s}/" in final_dir + "/"), None)
    if step is not None and host == 0:
      return self._full(host, step)
    return super().written(host, final_dir)


def _save(ckpt, step):
  return ckpt.save(step, {"x": np.full(3, step, np.float32)})


@pytest.mark.parametrize("hosts", [(0,), (0, 1)], ids=["one-host", "two-hosts"])
def test_a_failed_save_costs_that_save_and_the_next_commit_continues_the_run(hosts, caplog):
  """Issue 79 item 2: a save that failed in the background was raised by the next save()
  (which saved nothing), ending the run though the disk had room again. Now it is said at
  once, the next save goes on, and its commit says which step failed and which is the
  latest; nothing raises it later."""
  ckpt = checkpointer(FailsStep(2, hosts=hosts))
  _save(ckpt, 1).durable.result(30)
  failed = _save(ckpt, 2)
  concurrent.futures.wait([failed.durable], 30)
  said = lambda: [r.getMessage() for r in caplog.records]  # noqa: E731
  assert eventually(lambda: any(  # its durable's callback, on the save's thread
      "the save of step 2 into /ckpt/run failed in the background: CheckpointWriteError: "
      "host 0 could not write step 2: No space left on device" in m
      and "Training goes on" in m and "the latest committed step is 1" in m
      and "3 failed saves in a row end it" in m for m in said())), said()
  assert _save(ckpt, 3).durable.result(30) == 3
  ckpt.wait()
  assert any("step 3 is committed in /ckpt/run and the run goes on from it, after the "
             "failed save of step 2 (CheckpointWriteError). The latest committed step is 3"
             in m for m in said()), said()
  ckpt.close()  # settled: nothing raised
  assert ckpt.all_steps() == [1, 3]


def test_saves_that_keep_failing_end_the_run_at_max_failed_saves_in_a_row():
  """A disk that stays full: the save after max_failed_saves failures in a row raises the
  first one's error (the others in its notes) and saves nothing; a commit between
  failures starts the count anew."""
  ckpt = checkpointer(FailsStep(2, 4, 5, hosts=(0,)), max_failed_saves=2)
  for step in (1, 2, 3, 4, 5):  # 2 fails, 3 commits, 4 and 5 fail: two in a row
    concurrent.futures.wait([_save(ckpt, step).durable], 30)
  with pytest.raises(errors.CheckpointWriteError, match="could not write step 4") as raised:
    _save(ckpt, 6)
  notes = "\n".join(raised.value.__notes__)
  assert "the save of step 4 into /ckpt/run failed in the background (host 0); raised by " \
         "save(6). The latest committed step is 3" in notes, notes
  assert "the save of step 5 failed too: CheckpointWriteError" in notes, notes
  assert "2 saves in a row failed (max_failed_saves=2): the run ends here; save(6) saved " \
         "nothing (step 6 not saved)" in notes, notes
  assert ckpt.all_steps() == [1, 3]
  ckpt.close()  # raised once: nothing more


def test_max_failed_saves_1_raises_a_failure_at_the_next_save_as_orbax_does():
  ckpt = checkpointer(FailsStep(2, hosts=(0,)), max_failed_saves=1)
  _save(ckpt, 1).durable.result(30)
  concurrent.futures.wait([_save(ckpt, 2).durable], 30)
  with pytest.raises(errors.CheckpointWriteError, match="could not write step 2") as raised:
    _save(ckpt, 3)
  assert "raised by save(3). The latest committed step is 1" in "\n".join(
      raised.value.__notes__)
  assert _save(ckpt, 3).durable.result(30) == 3  # raised once: the next save goes on
  ckpt.close()
  assert ckpt.all_steps() == [1, 3]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_max_failed_saves_is_an_int_of_at_least_one(bad):
  with pytest.raises(errors.InvalidArgumentError, match=r"max_failed_saves must be an int >= 1"):
    CheckpointOptions(max_failed_saves=bad)


@pytest.mark.parametrize("read", ["result", "exception"])
def test_a_failed_save_whose_error_its_caller_read_is_not_raised_again(read):
  """The caller who read a save's error from its handle (``durable.result()`` raised it,
  or ``durable.exception()`` returned it) was told: the next save saves; one who waited
  without reading it (``concurrent.futures.wait``) is told by the next wait() or close()."""
  ckpt = checkpointer(FailsStep(1, hosts=(0,)))
  failed = _save(ckpt, 1)
  if read == "result":
    with pytest.raises(errors.CheckpointWriteError, match="could not write step 1"):
      failed.durable.result(30)
  else:
    assert "could not write step 1" in str(failed.durable.exception(30))
  assert _save(ckpt, 2).durable.result(30) == 2
  ckpt.close()
  assert ckpt.all_steps() == [2]


@pytest.mark.parametrize("how", ["close", "wait", "with"])
def test_a_failed_last_save_is_raised_by_close_or_wait(how):
  ckpt = checkpointer(FailsStep(1, hosts=(0,)))
  if how == "with":
    with pytest.raises(errors.CheckpointWriteError, match="could not write step 1"):
      with ckpt:
        _save(ckpt, 1)
  else:
    _save(ckpt, 1)
    with pytest.raises(errors.CheckpointWriteError, match="could not write step 1") as raised:
      getattr(ckpt, how)()
    assert f"raised by {how}()" in "\n".join(raised.value.__notes__)
  ckpt.close()  # raised once: closing (again) raises nothing more


def test_a_with_block_that_raises_keeps_its_error_and_notes_the_failed_save():
  ckpt = checkpointer(FailsStep(1, hosts=(0,)))
  with pytest.raises(KeyError, match="the training step's own") as raised:
    with ckpt:
      _save(ckpt, 1)
      raise KeyError("the training step's own")
  assert any("also, a save failed: CheckpointWriteError: host 0 could not write step 1" in n
             for n in raised.value.__notes__)


def item_target(step: int) -> Target:
  """An item of step ``step`` that an ``ocp.CheckpointManager`` writes and commits."""
  return Target.in_step(formats_lib.DEFAULT.get(formats_lib.ORBAX), "/ckpt/run",
                        f"/ckpt/run/{step}.orbax-checkpoint-tmp/state", step)


def test_an_orbax_managers_item_through_the_integrations_seam():
  """sidecar.orbax's handler saves, commits and restores an item through the module's
  functions, not the public Checkpointer's methods."""
  fake, state = FakeSidecars(), {"w": np.arange(6, dtype=np.float32)}
  with checkpointer(fake) as ckpt:
    target = item_target(3)
    assert orbax_items.save_item(ckpt, target, state).durable.result(30) == 3
    orbax_items.item_committed(ckpt, target)
    assert (0, "/ckpt/run/3/state") in [(h, d) for h, d, *_ in fake.told]
    assert ckpt.all_steps() == []  # the manager lists its steps, not this checkpointer
    restored = orbax_items.restore_item(ckpt, "/ckpt/run/3/state", 3,
                                        {"w": np.zeros(6, np.float32)})
    np.testing.assert_array_equal(restored["w"], state["w"])


def test_an_orbax_managers_item_is_saved_on_the_live_hosts_a_loss_leaves():
  """Issue 69: an Orbax manager's item follows the controller's live hosts as save()
  does: once host 2 is seen lost, the next item is saved on hosts 0 and 1 only (before,
  it was addressed to the dead host 2 and failed)."""
  fake, watch = FakeSidecars(hosts=(0, 1, 2)), [0, 1, 2]
  state = {"x": np.full(3, 1, np.float32)}
  with checkpointer(fake, live=lambda: tuple(watch)) as ckpt:
    assert orbax_items.save_item(ckpt, item_target(1), state).durable.result(30) == 1
    fake.hosts.remove(2)  # its sidecar dies, and the watch sees it
    watch.remove(2)
    fake.calls.clear()
    assert orbax_items.save_item(ckpt, item_target(2), state).durable.result(30) == 2
    assert {h for _, h in fake.calls} == {0, 1} and ("stage", 1) in fake.calls


def test_the_deprecated_save_to_saves_on_the_live_hosts_a_loss_leaves():
  """Issue 69: ``Checkpointer.save_to`` follows the controller's live hosts as save() and
  save_item do: once host 2 is seen lost, its next item is saved on hosts 0 and 1 only."""
  fake, watch = FakeSidecars(hosts=(0, 1, 2)), [0, 1, 2]
  state = {"x": np.full(3, 1, np.float32)}
  with checkpointer(fake, live=lambda: tuple(watch)) as ckpt:
    with pytest.warns(DeprecationWarning, match="Checkpointer.save_to is deprecated"):
      assert ckpt.save_to(item_target(1), state).durable.result(30) == 1
    fake.hosts.remove(2)  # its sidecar dies, and the watch sees it
    watch.remove(2)
    fake.calls.clear()
    with pytest.warns(DeprecationWarning, match="Checkpointer.save_to is deprecated"):
      assert ckpt.save_to(item_target(2), state).durable.result(30) == 2
    assert {h for _, h in fake.calls} == {0, 1} and ("stage", 1) in fake.calls


def test_the_orbax_managers_old_doors_warn_and_still_work():
  fake, state = FakeSidecars(), {"w": np.arange(6, dtype=np.float32)}
  new = "use sidecar.orbax.SidecarCheckpointHandler"
  with checkpointer(fake) as ckpt:
    target = item_target(4)
    with pytest.warns(DeprecationWarning, match=rf"Checkpointer.save_to is deprecated since "
                                                rf"0.3.0 and goes in 0.4.0: {new}") as said:
      handle = ckpt.save_to(target, state)
    assert said[0].filename == __file__  # the warning names the caller's line
    assert handle.durable.result(30) == 4
    with pytest.warns(DeprecationWarning, match=f"Checkpointer.mark_committed .*: {new}"):
      ckpt.mark_committed(target)
    assert (0, "/ckpt/run/4/state") in [(h, d) for h, d, *_ in fake.told]
    with pytest.warns(DeprecationWarning, match=f"Checkpointer.restore_from .*: {new}"):
      restored = ckpt.restore_from("/ckpt/run/4/state", 4, {"w": np.zeros(6, np.float32)})
    np.testing.assert_array_equal(restored["w"], state["w"])


def test_key_value_warns_and_makes_ctl_checkpointers_checkpointer():
  fake, peers = FakeSidecars(), LocalPeers()
  site = SidecarsSnapshot(client=fake, hosts=(0,), local=(0,), device_hosts={},
                          handshakes={0: {}}, mapped=frozenset(), writers={})
  with pytest.warns(DeprecationWarning,
                    match=r"Checkpointer.key_value .*: use ctl.checkpointer\(directory\)"):
    ckpt = checkpointer_lib.Checkpointer.key_value(
        "/ckpt/run", site=site, options=CheckpointOptions(), peers=peers,
        framework=NumpyArrays(), key="ckpt")
  with ckpt:
    assert ckpt.save(1, {"x": np.ones(2, np.float32)}).durable.result(30) == 1
    assert ckpt.all_steps() == [1]


def test_a_checkpointer_follows_the_live_hosts_a_loss_leaves():
  """Issue 69: a checkpointer made on 3 hosts saves on the 2 left once the controller
  sees host 2 lost (as ``sidecar.elastic.retry``'s next attempt does), with the replica
  placement of those 2, and restores from them."""
  fake, watch = FakeSidecars(hosts=(0, 1, 2)), [0, 1, 2]
  with checkpointer(fake, live=lambda: tuple(watch), replicas=1) as ckpt:
    assert ckpt.placement == {0: [1], 1: [2], 2: [0]}
    assert _save(ckpt, 1).durable.result(30) == 1
    fake.hosts.remove(2)  # its sidecar dies, and the watch sees it
    watch.remove(2)
    fake.calls.clear()
    assert _save(ckpt, 2).durable.result(30) == 2
    assert {h for _, h in fake.calls} == {0, 1} and ("begin", 0) in fake.calls
    assert ckpt.placement == {0: [1], 1: [0]} and ckpt.replicas == 1
    restored = ckpt.restore(2, target={"x": np.zeros(3, np.float32)})
    np.testing.assert_array_equal(restored["x"], np.full(3, 2, np.float32))
  assert ckpt.all_steps() == [1, 2]


def test_a_save_begun_before_a_loss_is_not_raised_by_the_next_attempt(caplog):
  """Issue 69: a save addressed to host 2, which died before the watch saw it, fails in
  the background; the next save, once the loss is seen, saves on hosts 0 and 1 and
  raises nothing: the failed step is told once, as a warning naming it."""
  fake, watch = FakeSidecars(hosts=(0, 1, 2)), [0, 1, 2]
  ckpt = checkpointer(fake, live=lambda: tuple(watch))
  assert _save(ckpt, 1).durable.result(30) == 1
  fake.hosts.remove(2)  # dead; the watch has not seen it yet
  failed = _save(ckpt, 2)
  concurrent.futures.wait([failed.durable], 30)
  assert isinstance(failed.durable.error(), errors.HostLostError)
  watch.remove(2)  # seen: the retry's next attempt saves
  assert _save(ckpt, 3).durable.result(30) == 3
  warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert len(warned) == 1 and warned[0].startswith(
      "step 2 was not saved into /ckpt/run: its save, begun before hosts [2] were lost, "
      "failed (HostLostError: host 2 is lost). Not raised: this checkpointer saves on the "
      "live hosts [0, 1] since; the latest committed step is "), warned
  ckpt.close()  # told once: nothing more
  assert ckpt.all_steps() == [1, 3]
  assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1


def test_a_host_back_has_the_directory_opened_before_a_save_reaches_it():
  fake, watch = FakeSidecars(hosts=(0, 1)), [0]
  with checkpointer(fake, hosts=(0,), live=lambda: tuple(watch)) as ckpt:
    assert _save(ckpt, 1).durable.result(30) == 1
    watch.append(1)  # a new sidecar at host 1's address rejoined
    fake.calls.clear()
    assert _save(ckpt, 2).durable.result(30) == 2
    assert fake.calls[0] == ("open", 1) and ("stage", 1) in fake.calls


def test_the_next_save_waits_for_one_in_flight_at_the_loss_and_says_why(caplog):
  """A save in flight when host 2 died ends (failed) only once its writes give up; the
  next save waits for it (one save at a time), and says so as the loss's, not as
  storage slower than the saves come."""
  fake, watch = HeldWrites(hosts=(0, 1, 2)), [0, 1, 2]
  ckpt = checkpointer(fake, live=lambda: tuple(watch))
  _save(ckpt, 1).staged.result(30)  # its writes are held
  fake.hosts.remove(2)
  watch.remove(2)
  threading.Timer(2 * checkpointer_lib.BUSY_WARN_S, fake.release.set).start()
  with caplog.at_level("INFO", logger=checkpointer_lib.__name__):
    assert _save(ckpt, 2).durable.result(30) == 2
  said = [r.getMessage() for r in caplog.records]
  assert not any("stood still" in m for m in said), said
  assert any(m.startswith("save(2) in /ckpt/run waited ") and m.endswith(
      "s for the save of step 1, begun before hosts [2] were lost, to end") for m in said)
  assert [m for m in said if m.startswith("step 1 was not saved")], said
  ckpt.close()
  assert ckpt.all_steps() == [2]


class _OnItsWay(DeviceCopy):
  """A host array standing for a copy still on its way from a device."""

  def __init__(self, data):
    self.data, self.shape, self.dtype = data, data.shape, data.dtype

  def result(self):
    return np.array(self.data)


class LateArrays(NumpyArrays):
  """Numpy arrays saved as an accelerator's are: each shard a copy on its way (process 0
  saves every leaf, as NumpyArrays does), restored from those copies where they make the
  whole target."""

  def save_leaves(self, tree):
    return [dataclasses.replace(leaf, shards=tuple(
        dataclasses.replace(s, data=_OnItsWay(s.data)) for s in leaf.shards))
        for leaf in super().save_leaves(tree)]

  def restore_on_device(self, target, copies):
    held = {record.key_path: copy.result() for record, copy in copies}
    if set(held) != {("x",)}:
      return None
    return {"x": held[("x",)]}


class HeldStages(FakeSidecars):
  """Host 0 takes the Stages of step 1 only once ``release`` is set."""

  def __init__(self, **kw):
    super().__init__(**kw)
    self.release = threading.Event()

  def stage(self, host, stage):
    if host == 0 and stage.step == 1:
      assert self.release.wait(30)
    return super().stage(host, stage)


def test_a_save_not_staged_is_restored_from_the_devices_in_every_process_or_in_none():
  """Process 0 holds copies of the whole state (it saves every leaf), process 1 none: no
  process restores from its devices; once staged, all restore from the RAM tiers."""
  # Process 0 stages on two hosts (its step begun by a Begin of its own, not by its held
  # Stage, which process 1's save would wait for).
  fake, store = HeldStages(hosts=(0, 1, 2)), {}
  outcomes: list = [None, None]

  def process(p: int) -> None:
    with checkpointer(fake, hosts=[0, 1, 2], local=[[0, 2], [1]][p],
                      peers=DictPeers(store, p, 2), framework=LateArrays()) as ckpt:
      ckpt.save(1, {"x": np.full(3, 7, np.float32)}, data_state={"at": 1})
      got = rollback.restore_taken_over(ckpt, {"x": np.zeros(3, np.float32)})
      outcomes[p] = (got.step, got.tree["x"].tolist(), got.data_state,
                     ckpt.last_restore_stats().tier)

  threads = [threading.Thread(target=process, args=(p,)) for p in (0, 1)]
  for t in threads:
    t.start()
  try:  # both said whether they restored from their devices: step 1 is staged only then
    assert eventually(lambda: {"ckpt/rollback/1/device/0", "ckpt/rollback/1/device/1"}
                      <= set(store))
  finally:
    fake.release.set()
  for t in threads:
    t.join(60)
  assert outcomes == [(1, [7.0, 7.0, 7.0], {"at": 1}, "ram")] * 2
