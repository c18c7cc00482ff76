"""``sidecar.jax.Recovery`` against one in-process sidecar, without the LM example: a step
that raises rolls back to the newest committed step (state from the RAM tier, the feed
moved back with ``Feed.seek``) and the loop repeats what an uninterrupted one computes;
the same step failing again is raised; a save in flight the sidecars took over is rolled
back to without waiting for its write (whose later failure the next save raises); one
not staged yet, from its copies on the devices without waiting for them to land; one
that failed is not rolled back to."""

import concurrent.futures
import threading

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from sidecar._src.core import env as env_lib, errors
from sidecar._src.jax import checkpoint as jax_checkpoint
from sidecar._src.jax.framework import JaxFramework
from sidecar._src.user import registry as registry_lib

pytestmark = pytest.mark.server

N, BATCH, SAVE_EVERY = 256, 4, 3
TARGET = {"w": np.zeros(N, np.float32)}


def rows(ctx):
  return grain.MapDataset.range(4096).map(lambda i: {"x": np.float32(i)})


@pytest.fixture
def ctl(make_server):
  reg = registry_lib.Registry()
  reg.add("pipeline", "rows", rows)
  server = make_server(registry=reg, device_ids=(0,), shm_size=16 << 20)
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], timeout=10) as c:
    yield c


@pytest.fixture
def copying_ctl(make_server):
  """As on an accelerator: a save copies the state on its devices and returns before the
  copies land in the arena (``JaxFramework(device_copies=True)``)."""
  reg = registry_lib.Registry()
  reg.add("pipeline", "rows", rows)
  server = make_server(registry=reg, device_ids=(0,), shm_size=16 << 20)
  # A deadline past the test's wait: a Stage held is never cut short meanwhile.
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], timeout=60,
                              framework=JaxFramework(device_copies=True)) as c:
    yield c


@pytest.fixture
def torch_ctl(make_server):
  import sidecar.torch
  reg = registry_lib.Registry()
  reg.add("pipeline", "rows", rows)
  server = make_server(registry=reg, shm_size=16 << 20)
  with sidecar.torch.Controller([f"127.0.0.1:{server.port}"], timeout=10) as c:
    yield c


def open_feed(ctl, state=None):
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
  return ctl.feed("rows", global_batch_size=BATCH, sharding=sharding, state=state)


def batches(ctl, n):
  """The first ``n`` batches of a fresh feed, as lists."""
  with open_feed(ctl) as feed:
    return [np.asarray(next(feed)["x"]).tolist() for _ in range(n)]


def train(ckpt, feed, steps, *, recovery=None, fail=()):
  """Steps 1..steps of a loop that saves every SAVE_EVERY: ``[(step, w)]`` of every step
  computed (re-done ones again); ``fail``: steps that raise once their batch is taken,
  once for each time they are listed."""
  fail, log = list(fail), []
  step, state = 0, {"w": np.zeros(N, np.float32)}
  while step < steps:
    try:
      batch = np.asarray(next(feed)["x"])
      if step + 1 in fail:
        fail.remove(step + 1)
        raise RuntimeError(f"step {step + 1} failed")
      state = {"w": state["w"] * np.float32(0.5) + batch.sum()}
    except RuntimeError as e:
      if recovery is None:
        raise
      state = None
      step, restored = recovery.recover(e, step=step + 1)
      state = {"w": np.array(restored["w"])}
      continue
    step += 1
    log.append((step, state["w"].copy()))
    if step % SAVE_EVERY == 0:
      ckpt.save(step, state, data_state=feed.state())
  ckpt.wait()
  return log


def test_a_failed_step_rolls_back_and_repeats_the_uninterrupted_run(ctl, tmp_path):
  with ctl.checkpointer(str(tmp_path / "whole")) as ckpt, open_feed(ctl) as feed:
    whole = dict(train(ckpt, feed, 12))
  with ctl.checkpointer(str(tmp_path / "failed")) as ckpt, open_feed(ctl) as feed:
    recovery = sidecar.jax.Recovery(ckpt, feed, target=TARGET)
    log = train(ckpt, feed, 12, recovery=recovery, fail=[8, 11])
  # Step 8 raised: back to step 6, its state and its data position; 11: back to 9.
  assert [s for s, _ in log] == [1, 2, 3, 4, 5, 6, 7, 7, 8, 9, 10, 10, 11, 12]
  for step, w in log:
    np.testing.assert_array_equal(w, whole[step])  # the re-done steps too: exactly
  assert [(r.failed_step, r.step, r.tier) for r in recovery.rollbacks] == [
      (8, 6, "ram"), (11, 9, "ram")]
  assert recovery.rollbacks[0].error == "RuntimeError: step 8 failed"
  assert "rolled back in-process to step 6 (ram tier" in recovery.rollbacks[0].summary()


def test_the_same_step_failing_again_is_raised_with_a_note(ctl, tmp_path):
  with ctl.checkpointer(str(tmp_path / "ck")) as ckpt, open_feed(ctl) as feed:
    recovery = sidecar.jax.Recovery(ckpt, feed, target=TARGET)
    with pytest.raises(RuntimeError, match="step 5 failed") as raised:
      train(ckpt, feed, 8, recovery=recovery, fail=[5, 5])
    assert [r.step for r in recovery.rollbacks] == [3]  # the first was recovered
  assert any("step 5 failed 2 times in this process (retries_per_step=1)" in note
             for note in raised.value.__notes__)


def test_retries_per_step_0_raises_the_first_failure(ctl, tmp_path):
  with ctl.checkpointer(str(tmp_path / "ck")) as ckpt, open_feed(ctl) as feed:
    recovery = sidecar.jax.Recovery(ckpt, feed, target=TARGET, retries_per_step=0)
    with pytest.raises(RuntimeError, match="step 5 failed"):
      train(ckpt, feed, 8, recovery=recovery, fail=[5])
    assert recovery.rollbacks == []
    with pytest.raises(errors.InvalidArgumentError, match="retries_per_step must be an int "
                                                           ">= 0, got -1"):
      sidecar.jax.Recovery(ckpt, feed, target=TARGET, retries_per_step=-1)


def test_the_feeds_end_is_no_failure(ctl, tmp_path):
  with ctl.checkpointer(str(tmp_path / "ck")) as ckpt, open_feed(ctl) as feed:
    recovery = sidecar.jax.Recovery(ckpt, feed, target=TARGET)
    end = StopIteration()
    with pytest.raises(StopIteration) as raised:
      recovery.recover(end, step=1)
    assert raised.value is end and recovery.rollbacks == []


def test_a_failure_before_any_commit_is_raised_naming_why(ctl, tmp_path):
  with ctl.checkpointer(str(tmp_path / "ck")) as ckpt, open_feed(ctl) as feed:
    recovery = sidecar.jax.Recovery(ckpt, feed, target=TARGET)
    with pytest.raises(RuntimeError, match="step 2 failed") as raised:
      train(ckpt, feed, 8, recovery=recovery, fail=[2])
  assert any("failed before any step was committed" in n for n in raised.value.__notes__)


def recover_while_held(recovery, release, *, held, within, waiting_for):
  """recover() of step 7's failure, on a thread of its own, while the save in flight is
  held: it returns within ``within`` s and ``held()`` is still true (it did not wait for
  ``waiting_for``); then ``release()`` lets the save go. Returns recover()'s answer."""
  done = []
  thread = threading.Thread(target=lambda: done.append(
      recovery.recover(RuntimeError("step 7 failed"), step=7)))
  thread.start()
  try:
    thread.join(within)
    assert done, f"recover() waited for {waiting_for}"
    assert held()
  finally:
    release()
    thread.join(30)
  [answer] = done
  return answer


def save_3_and_6(ckpt, feed):
  """Saves steps 3 and 6 (``w`` full of the step), each after SAVE_EVERY batches, and takes
  batch 7 (the step that fails)."""
  handles = []
  for step in (3, 6):
    for _ in range(SAVE_EVERY):
      next(feed)
    handles.append(ckpt.save(step, {"w": np.full(N, step, np.float32)},
                             data_state=feed.state()))
  next(feed)
  return handles


def test_a_save_in_flight_taken_over_is_rolled_back_to_without_waiting_for_its_write(
    ctl, tmp_path, monkeypatch):
  gate = tmp_path / "gate"
  monkeypatch.setenv(env_lib.CKPT_FAULT, f"slow@6:{gate}")  # step 6 not durable till gate
  with ctl.checkpointer(str(tmp_path / "ck")) as ckpt, open_feed(ctl) as feed:
    recovery = sidecar.jax.Recovery(ckpt, feed, target=TARGET)
    save_3_and_6(ckpt, feed)
    # The write of step 6 is held meanwhile (step 6 not durable yet): no waiting for it.
    step, restored = recover_while_held(
        recovery, gate.touch, held=lambda: ckpt.latest_step() == 3, within=30,
        waiting_for="the write of the save in flight")
    assert step == 6
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.full(N, 6, np.float32))
    [rollback] = recovery.rollbacks
    assert (rollback.step, rollback.tier, rollback.durable, rollback.waited_s) == (
        6, "ram", False, 0.0)
    assert "taken over and not durable yet" in rollback.summary()
    assert f"{rollback.staged_s:.3f} s waiting for its copy" in rollback.summary()
    # the feed was moved back to step 6's position: batch 7 is next
    assert np.asarray(next(feed)["x"]).tolist() == batches(ctl, 7)[6]
    ckpt.wait()  # and step 6 becomes durable as if nothing happened
    assert ckpt.latest_step() == 6


@pytest.mark.parametrize("pieces", [True, False], ids=["pieces", "whole-copies"])
def test_a_save_not_staged_yet_is_rolled_back_to_from_its_copies_on_the_devices(
    copying_ctl, tmp_path, monkeypatch, pieces):
  """The chip's case: a step raises while the save before it is still copied off the
  devices. The rollback restores it from the copies the save holds there, without
  waiting for it to be staged; the arrays are the trainer's own (a step that donates
  them leaves the save's copy whole), and the save commits all the same."""
  gate = tmp_path / "gate"
  monkeypatch.setenv(env_lib.CKPT_FAULT, f"slowstage@6:{gate}")  # step 6 not staged till gate
  # N float32 in 4 pieces of 64 rows; the other case a piece size of its own, whose split
  # is held back: the save copies each shard whole.
  monkeypatch.setattr(jax_checkpoint, "PIECE_BYTES", 256 if pieces else 512)
  if not pieces:
    held, compile_split = threading.Event(), jax_checkpoint._compile_split
    monkeypatch.setattr(jax_checkpoint, "_compile_split",
                        lambda *args: (held.wait(60), compile_split(*args)))
  device = jax.devices()[0]
  target = {"w": jax.ShapeDtypeStruct((N,), jnp.float32,
                                      sharding=jax.sharding.SingleDeviceSharding(device))}
  full = lambda step: {"w": jax.device_put(np.full(N, step, np.float32), device)}
  donating = jax.jit(lambda s: {"w": s["w"] * 2 + 1}, donate_argnums=0)
  ctl = copying_ctl
  with ctl.checkpointer(str(tmp_path / "ck")) as ckpt, open_feed(ctl) as feed:
    recovery = sidecar.jax.Recovery(ckpt, feed, target=target)
    for _ in range(SAVE_EVERY):
      next(feed)
    ckpt.save(3, full(3), data_state=feed.state()).durable.result(30)
    if pieces:
      assert jax_checkpoint.wait_for_splits(60)  # step 6 goes in pieces, split on the device
    for _ in range(SAVE_EVERY):
      next(feed)
    six = ckpt.save(6, full(6), data_state=feed.state())
    [(_, copy)] = ckpt._driver.runner.on_device.copies  # held till staged, off the device
    assert len(copy._rows) == (4 if pieces else 1)
    next(feed)  # the batch of step 7, which fails

    def release():
      gate.touch()
      if not pieces:
        held.set()

    # The Stage of step 6 is held meanwhile: no waiting for it.
    step, restored = recover_while_held(
        recovery, release, held=lambda: not six.staged.done(), within=20,
        waiting_for="the save in flight to be staged")
    assert step == 6
    [rollback] = recovery.rollbacks
    assert (rollback.tier, rollback.durable, rollback.staged_s, rollback.waited_s) == (
        "device", False, 0.0, 0.0)
    assert "not staged yet, from the save's copies on the devices" in rollback.summary()
    assert ckpt.restored_step == 6
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.full(N, 6, np.float32))
    donating(full(1))  # compiled for the loop's state: the restored one reuses it
    stepped = donating(restored)  # the trainer's own arrays: the save's copy is not these
    assert restored["w"].is_deleted() and donating._cache_size() == 1
    np.testing.assert_array_equal(np.asarray(stepped["w"]), np.full(N, 13, np.float32))
    # the feed was moved back to step 6's position: batch 7 is next
    assert np.asarray(next(feed)["x"]).tolist() == batches(ctl, 7)[6]
    ckpt.wait()  # and step 6 is staged and committed as if nothing happened
    assert ckpt.latest_step() == 6
    np.testing.assert_array_equal(np.asarray(ckpt.restore(6, target)["w"]),
                                  np.full(N, 6, np.float32))
  assert jax_checkpoint.wait_for_splits(60)


def test_a_state_with_host_and_replicated_leaves_not_staged_yet_is_rolled_back_to_from_the_devices(
    copying_ctl, tmp_path, monkeypatch):
  """A numpy leaf beside the jax.Arrays (a step counter, an RNG key kept on the host) and
  a leaf replicated across two devices do not make the rollback wait for the copy: the
  numpy leaf comes back as saved (a copy the save made, not the array the trainer goes on
  changing), a fresh array; the replicated one from its one saved shard onto both devices."""
  gate = tmp_path / "gate"
  monkeypatch.setenv(env_lib.CKPT_FAULT, f"slowstage@6:{gate}")  # step 6 not staged till gate
  device = jax.devices()[0]
  one = jax.sharding.SingleDeviceSharding(device)
  both = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("r",)), P())
  target = {"w": jax.ShapeDtypeStruct((N,), jnp.float32, sharding=one),
            "r": jax.ShapeDtypeStruct((8,), jnp.int32, sharding=both),
            "key": np.zeros(2, np.uint32), "count": np.int64(0)}

  def full(step):
    return {"w": jax.device_put(np.full(N, step, np.float32), device),
            "r": jax.device_put(np.arange(8, dtype=np.int32) + step, both),
            "key": np.array([step, 7], np.uint32), "count": np.int64(step)}

  donating = jax.jit(lambda a: a * 2 + 1, donate_argnums=0)  # each array on its devices
  ctl = copying_ctl
  with ctl.checkpointer(str(tmp_path / "ck")) as ckpt, open_feed(ctl) as feed:
    recovery = sidecar.jax.Recovery(ckpt, feed, target=target)
    for _ in range(SAVE_EVERY):
      next(feed)
    ckpt.save(3, full(3), data_state=feed.state()).durable.result(30)
    for _ in range(SAVE_EVERY):
      next(feed)
    state = full(6)
    six = ckpt.save(6, state, data_state=feed.state())
    state["key"][:] = 99  # the trainer goes on changing its host arrays in place
    next(feed)  # the batch of step 7, which fails
    # The Stage of step 6 is held meanwhile: no waiting for it.
    step, restored = recover_while_held(
        recovery, gate.touch, held=lambda: not six.staged.done(), within=20,
        waiting_for="the save in flight to be staged")
    assert step == 6
    [rollback] = recovery.rollbacks
    assert (rollback.tier, rollback.staged_s) == ("device", 0.0)
    np.testing.assert_array_equal(restored["key"], np.array([6, 7], np.uint32))
    assert isinstance(restored["key"], np.ndarray) and restored["key"] is not state["key"]
    assert restored["count"] == 6 and restored["count"].dtype == np.int64
    assert restored["r"].sharding == both
    for shard in restored["r"].addressable_shards:  # each device's, a copy of the one saved
      np.testing.assert_array_equal(np.asarray(shard.data), np.arange(8) + 6)
    restored["key"][:] = 0  # the trainer's own: the save's copy is not it
    stepped = {k: donating(restored[k]) for k in ("w", "r")}  # nor the save's device copies
    assert restored["w"].is_deleted() and restored["r"].is_deleted()
    np.testing.assert_array_equal(np.asarray(stepped["w"]), np.full(N, 13, np.float32))
    np.testing.assert_array_equal(np.asarray(stepped["r"]), (np.arange(8) + 6) * 2 + 1)
    assert np.asarray(next(feed)["x"]).tolist() == batches(ctl, 7)[6]
    ckpt.wait()  # and step 6 is staged and committed as saved
    assert ckpt.latest_step() == 6
    again = ckpt.restore(6, target)
    np.testing.assert_array_equal(np.asarray(again["w"]), np.full(N, 6, np.float32))
    np.testing.assert_array_equal(np.asarray(again["r"]), np.arange(8) + 6)
    np.testing.assert_array_equal(again["key"], np.array([6, 7], np.uint32))
    assert again["count"] == 6
  assert jax_checkpoint.wait_for_splits(60)


def test_a_step_rolled_back_to_whose_write_fails_later_is_said_and_the_next_save_goes_on(
    ctl, tmp_path, monkeypatch, caplog):
  """The step the rollback restored (taken over, not durable yet) fails to be written
  later: said at once, and the next save commits (issue 79 item 2: a failed save costs
  that save, not the run; it was raised by the next save)."""
  gate = tmp_path / "gate"
  monkeypatch.setenv(env_lib.CKPT_FAULT, f"enospc@6:{gate}")  # step 6's write fails at gate
  with ctl.checkpointer(str(tmp_path / "ck")) as ckpt, open_feed(ctl) as feed:
    recovery = sidecar.jax.Recovery(ckpt, feed, target=TARGET)
    save_3_and_6(ckpt, feed)
    try:
      step, restored = recovery.recover(RuntimeError("step 7 failed"), step=7)
    finally:
      gate.touch()
    assert (step, recovery.rollbacks[0].durable) == (6, False)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.full(N, 6, np.float32))
    assert ckpt.save(9, {"w": np.full(N, 9, np.float32)}).durable.result(60) == 9
    ckpt.wait()
    said = caplog.text
    assert "the save of step 6 into" in said and "No space left on device" in said, said
    assert "step 9 is committed in" in said and "after the failed save of step 6" in said
    assert ckpt.all_steps() == [3, 9]


def test_a_save_that_failed_before_the_rollback_is_not_rolled_back_to(
    ctl, tmp_path, monkeypatch):
  monkeypatch.setenv(env_lib.CKPT_FAULT, "enospc@6")
  with ctl.checkpointer(str(tmp_path / "ck")) as ckpt, open_feed(ctl) as feed:
    recovery = sidecar.jax.Recovery(ckpt, feed, target=TARGET)
    _, six = save_3_and_6(ckpt, feed)
    concurrent.futures.wait([six.durable])  # failed; not told (wait() raises it below)
    step, restored = recovery.recover(RuntimeError("step 7 failed"), step=7)
    assert step == 3
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.full(N, 3, np.float32))
    assert np.asarray(next(feed)["x"]).tolist() == batches(ctl, 4)[3]
    with pytest.raises(errors.SidecarError, match="No space left on device"):
      ckpt.wait()  # the failed save's own error is not lost


def test_seek_moves_a_feed_back_or_forward_and_reopens_a_closed_one(ctl):
  expected = batches(ctl, 5)
  with open_feed(ctl) as feed:
    assert [np.asarray(next(feed)["x"]).tolist() for _ in range(3)] == expected[:3]
    at_three = feed.state()
    feed.seek(None)  # back to the start
    assert np.asarray(next(feed)["x"]).tolist() == expected[0]
    feed.close()
    feed.seek(at_three)  # a closed feed opens again, at the position given
    assert feed.state() == at_three
    assert [np.asarray(next(feed)["x"]).tolist() for _ in range(2)] == expected[3:]
    with pytest.raises(errors.InvalidArgumentError, match="resume with the same pipeline"):
      feed.seek({**at_three, "seed": 7})


def train_torch(ctl, directory, steps, *, fail=()):
  """The same loop in PyTorch, as docs/pytorch.md writes it: a ``for`` over a
  ``sidecar.torch.DataLoader``, its position saved in the state dict; ``fail`` as in
  :func:`train`. Returns ``([(step, w)], rollbacks)``."""
  import torch

  import sidecar.torch
  fail, log = list(fail), []
  loader = sidecar.torch.DataLoader("rows", batch_size=BATCH, controller=ctl)
  with sidecar.torch.Checkpointer(directory, controller=ctl) as ckpt, loader:
    recovery = sidecar.torch.Recovery(
        ckpt, loader, target={"w": torch.zeros(N), "data": loader.state_dict()})
    step, w = 0, torch.zeros(N)
    for batch in loader:
      if step == steps:
        break
      try:
        if step + 1 in fail:
          fail.remove(step + 1)
          raise RuntimeError(f"step {step + 1} failed")
        w = w * 0.5 + batch["x"].sum()
      except RuntimeError as e:
        step, restored = recovery.recover(e, step=step + 1)
        w = restored["w"].clone()
        continue
      step += 1
      log.append((step, w.clone()))
      if step % SAVE_EVERY == 0:
        ckpt.save(step, {"w": w.clone(), "data": loader.state_dict()})
    ckpt.wait()
  return log, recovery.rollbacks


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_torch_loop_rolls_back_in_process_with_its_dataloader(torch_ctl, tmp_path):
  """sidecar.torch.Recovery: the core's rollback, the DataLoader sought to the position
  the restored state dict holds; the loop repeats what an uninterrupted one computes."""
  import torch

  import sidecar.torch
  assert issubclass(sidecar.torch.Recovery, sidecar.jax.Recovery)
  whole, _ = train_torch(torch_ctl, tmp_path / "whole", 12)
  log, rollbacks = train_torch(torch_ctl, tmp_path / "failed", 12, fail=[8, 11])
  assert [s for s, _ in log] == [1, 2, 3, 4, 5, 6, 7, 7, 8, 9, 10, 10, 11, 12]
  for step, w in log:
    assert torch.equal(w, dict(whole)[step]), step  # the re-done steps too: exactly
  assert [(r.failed_step, r.step, r.durable) for r in rollbacks] == [(8, 6, True), (11, 9, True)]
  # Each restored from the sidecar's RAM tier, and says so (it said "unknown tier": a DCP
  # load kept no stats).
  assert [r.tier for r in rollbacks] == ["ram", "ram"]
  assert "rolled back in-process to step 6 (ram tier" in rollbacks[0].summary()
