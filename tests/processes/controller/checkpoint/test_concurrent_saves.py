"""Tier 3: two saves of one step from one trainer at once (issue 35 item 11)."""

import concurrent.futures
import threading

import numpy as np
import pytest

import sidecar
from sidecar._src.ckptfmt.save_values import Stage
from sidecar._src.core import errors

pytestmark = pytest.mark.processes


def test_a_second_save_of_a_step_in_flight_is_refused_at_once_and_the_first_is_durable(
    tmp_path):
  state = {"w": np.arange(1 << 20, dtype=np.float32), "b": np.ones(8, np.int32)}
  start = threading.Barrier(2)

  def save(ckpt):
    start.wait(10)
    return ckpt.save(3, state).durable.result(60)

  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="64MiB") as c:
    with c.controller() as ctl, ctl.checkpointer(tmp_path / "ck") as ckpt:
      with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outcomes = [f.exception(90) or f.result() for f in
                    [pool.submit(save, ckpt) for _ in range(2)]]
      assert sorted(map(type, outcomes), key=str) == [int, errors.InvalidArgumentError], outcomes
      refused = next(o for o in outcomes if isinstance(o, Exception))
      assert "step 3 is being saved already" in str(refused)
      assert ckpt.all_steps() == [3]
      restored = ckpt.restore(3, target=state)
      np.testing.assert_array_equal(restored["w"], state["w"])


def test_two_checkpointers_saving_one_step_in_one_directory_name_the_save_in_flight(tmp_path):
  # Issue 55 item 6: the second save used to wipe the first's files ("staged already", then
  # the first failed to write); it is refused at its begin, and the first is durable.
  state = {"w": np.ones((1024, 1024, 4), np.float32)}
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="64MiB") as c:
    with c.controller() as ctl, ctl.checkpointer(tmp_path) as a, \
        ctl.checkpointer(tmp_path) as b:
      first = a.save(1, state)
      assert first.staged.result(60) == 1
      with pytest.raises(sidecar.PermissionDeniedError,
                         match="step 1 of .* is being saved by another checkpointer of this "
                               "directory in the same process( on host 0)?: another save of "
                               "step 1 into this directory is in flight; wait for that save to "
                               "end"):
        b.save(1, state).durable.result(60)
      assert first.durable.result(60) == 1 and a.all_steps() == [1]


# A trainer of its own job (its own process, session and worker) whose save of step 1 stops
# until the file GO exists: at HOLD "stage" (the client's first stage: Begin is done,
# nothing staged), or "write" (save() returned: staged whole and taken over by the sidecar,
# whose write waits for GO: its fault "slow@1:GO"). A process that stages on one host
# begins its step with its first Stage (issue 69): no moment between them to hold at; held
# at "stage", this one begins with a Begin of its own, as a process staging on several
# hosts does.
FIRST = """
    import os, sys, time, numpy as np
    import sidecar
    from sidecar._src.ckptfmt.save_values import Stage
    from sidecar._src.controller.checkpoint import client as client_lib, save_run
    real = client_lib.CheckpointClient.send
    if {hold!r} == "stage":
      save_run.SaveRun._begins_with_stage = lambda self: False

    def held(self, host, value, **kwargs):
      if isinstance(value, Stage):
        open({held!r}, "w").close()
        while not os.path.exists({go!r}):
          time.sleep(0.02)
      return real(self, host, value, **kwargs)
    if {hold!r} == "stage":
      client_lib.CheckpointClient.send = held
    with sidecar.jax.Controller({addresses!r}) as ctl, ctl.checkpointer({directory!r}) as ckpt:
      handle = ckpt.save(1, {{"w": np.full(1 << 16, 1.0, np.float32)}})
      open({held!r}, "w").close()
      print("DURABLE", handle.durable.result(), flush=True)
"""
REFUSED = (r"begin: step 1 of '.*ck' is being saved by another session \(another trainer "
           r"process or Controller\) on host 0: another save of step 1 into this directory is "
           r"in flight; wait for that save to end, or save each step from one checkpointer")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("hold", ["stage", "write"], ids=["begun", "staged"])
@pytest.mark.parametrize("first_ends", ["commits", "is-killed"])
def test_another_trainers_save_of_a_step_is_refused_from_its_begin_until_it_ends(
    tmp_path, hold, first_ends, monkeypatch):
  # Issue 55 item 6: a second trainer's Begin of the step between the first's Begin and its
  # first Stage (or its open's sweep) removed the first's tmp directory; it is refused
  # from the first's Begin on, until the first commits, or its process dies before its
  # save() returned. Once it returned, the step is the sidecar's to commit (issue 62):
  # the first's, whether it lives or not. Both trainers are one job's (another job's open
  # of the directory is refused before any of this: issue 62 item 5,
  # tests/processes/server/test_checkpoint_jobs.py).
  import os
  import subprocess
  import sys
  import textwrap

  from tests.conftest import eventually
  from tests.support.paths import ROOT
  directory, go, held = tmp_path / "ck", tmp_path / "go", tmp_path / "held"
  mine = {"w": np.full(1 << 16, 2.0, np.float32)}
  monkeypatch.setenv("SIDECAR_JOB", f"one job of {tmp_path.name}")
  fault = {0: {"SIDECAR_CKPT_FAULT": f"slow@1:{go}"}} if hold == "write" else {}
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="32MiB",
                                    host_env=fault) as c:
    code = FIRST.format(hold=hold, held=str(held), go=str(go), addresses=c.addresses,
                        directory=str(directory))
    first = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
    try:
      with c.controller() as ctl:
        # Opened once the first's save is in flight: its open sweeps no tmp directory in
        # flight. A step taken over (staged), an open waits for: opened before it then.
        early = ctl.checkpointer(directory) if hold == "write" else None
        assert eventually(held.exists, timeout=120), first.stdout.read() if first.poll() else ""
        with early or ctl.checkpointer(directory) as ckpt:
          ckpt.save(1, mine)
          with pytest.raises(sidecar.PermissionDeniedError, match=REFUSED):
            ckpt.wait()  # its Begin was refused: raised once, by wait()
          assert (directory / "1.orbax-checkpoint-tmp").is_dir()
        if first_ends == "commits":
          go.touch()
          assert "DURABLE 1" in first.communicate(timeout=120)[0]
          expected = np.full(1 << 16, 1.0, np.float32)  # the first's, whole
        elif hold == "write":  # killed once its save() returned: the sidecar commits it
          first.kill()
          first.wait()
          threading.Timer(1.0, go.touch).start()  # written while the next job opens
          with ctl.checkpointer(directory) as ckpt:  # its open waits for that commit
            with pytest.raises(sidecar.InvalidArgumentError, match="step 1 is already saved"):
              ckpt.save(1, mine)
          expected = np.full(1 << 16, 1.0, np.float32)
        else:
          first.kill()
          first.wait()
          # Its worker's connection closed: the sidecar lets its save go.
          assert eventually(lambda: ctl.status()[0].workers == 1, timeout=30)
          with ctl.checkpointer(directory) as ckpt:
            assert ckpt.save(1, mine).durable.result(60) == 1
          expected = mine["w"]
        with ctl.checkpointer(directory) as ckpt:
          assert ckpt.all_steps() == [1]
          restored = ckpt.restore(1, target={"w": np.zeros(1 << 16, np.float32)})
          np.testing.assert_array_equal(restored["w"], expected)
    finally:
      if first.poll() is None:
        first.kill()
      first.communicate()


def test_a_second_checkpointer_of_the_process_is_refused_between_the_firsts_begin_and_stage(
    tmp_path, monkeypatch):
  # Issue 55 item 6: one Controller's session is both checkpointers': the sidecar cannot
  # tell the second's Begin from a retry of the first's, so this process refuses it.
  from sidecar._src.controller.checkpoint import client as client_lib
  begun, go = threading.Event(), threading.Event()
  real = client_lib.CheckpointClient.send

  def held(self, host, value, **kwargs):
    if isinstance(value, Stage):
      begun.set()
      assert go.wait(60)
    return real(self, host, value, **kwargs)
  monkeypatch.setattr(client_lib.CheckpointClient, "send", held)
  state = {"w": np.full(1 << 16, 1.0, np.float32)}
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="32MiB") as c:
    with c.controller() as ctl, ctl.checkpointer(tmp_path) as a, \
        ctl.checkpointer(tmp_path) as b, concurrent.futures.ThreadPoolExecutor(1) as pool:
      saving = pool.submit(a.save, 1, state)  # it returns once staged
      assert begun.wait(60)  # a's Begin is done, nothing of it staged
      with pytest.raises(sidecar.PermissionDeniedError,
                         match="step 1 of .* is being saved by another checkpointer of this "
                               "directory in the same process: another save of step 1 into "
                               "this directory is in flight"):
        b.save(1, {"w": np.zeros(1 << 16, np.float32)})
      go.set()
      assert saving.result(60).durable.result(60) == 1
      np.testing.assert_array_equal(a.restore(1, target=state)["w"], state["w"])
