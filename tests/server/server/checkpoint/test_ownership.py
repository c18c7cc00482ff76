"""Tier 2: one job per checkpoint directory (issue 62 item 5), with in-process sidecars,
real controllers and real lock files.

Before: two jobs on one directory both opened it and saved, ``max_to_keep`` of each
deleting the other's steps. Now the second job's open is refused naming the first (its
name, who opened it, through which sidecar); the processes of one job never refuse each
other (on many sidecars, or several on one sidecar, or a restarted trainer whose
predecessor's session is still live); and a job that is gone is taken over: at once
where its sidecar stopped, within ``ownership.RELEASE_S`` where its trainers left a
sidecar that goes on.
"""

import hashlib
import os

import numpy as np
import pytest

import sidecar
from sidecar._src.server.checkpoint import ownership
from tests.conftest import eventually
from tests.support.paths import entries

pytestmark = pytest.mark.server


def _controller(server):
  return sidecar.jax.Controller([f"127.0.0.1:{server.port}"], timeout=30)


def _open(ctl, directory, monkeypatch, job):
  monkeypatch.setenv("SIDECAR_JOB", job)
  return ctl.checkpointer(directory)


def test_a_second_job_is_refused_naming_the_first(make_server, tmp_path, monkeypatch):
  a, b = make_server(), make_server()
  directory = tmp_path / "ck"
  with _controller(a) as ctl_a, _controller(b) as ctl_b:
    with _open(ctl_a, directory, monkeypatch, "job A") as ckpt:
      ckpt.save(1, {"w": np.ones(4, np.float32)}).durable.result(30)
      with pytest.raises(sidecar.PermissionDeniedError) as refused:
        _open(ctl_b, directory, monkeypatch, "job B")
      text = str(refused.value)
      assert (f"checkpoint directory {str(directory)!r} is held by another live job, 'job A': "
              f"opened by process 0 (pid {os.getpid()} on ") in text, text
      assert "through the sidecar of host 0 (pid" in text and "give this job another" in text
      assert ckpt.all_steps() == [1]  # the holder goes on
      ckpt.save(2, {"w": np.ones(4, np.float32)}).durable.result(30)
  assert entries(directory) == ["1", "2"]


def test_the_processes_of_one_job_never_refuse_each_other(make_server, tmp_path, monkeypatch):
  a, b = make_server(), make_server()
  directory = tmp_path / "ck"
  with _controller(a) as one, _controller(a) as two, _controller(b) as three:
    opened = [_open(ctl, directory, monkeypatch, "job A") for ctl in (one, two, three)]
    for ckpt in opened:
      ckpt.close()


def test_a_job_whose_sidecar_stopped_is_taken_over_at_once(make_server, tmp_path, monkeypatch):
  a, b = make_server(), make_server()
  directory = tmp_path / "ck"
  ctl_a = _controller(a)
  ckpt = _open(ctl_a, directory, monkeypatch, "job A")
  a.stop()  # its locks go with it, as with a sidecar killed
  with _controller(b) as ctl_b, _open(ctl_b, directory, monkeypatch, "job B"):
    mine = hashlib.sha256(b"job B").hexdigest()[:24] + ".lock"
    assert os.listdir(directory / ownership.JOBS_DIR) == [mine]  # A's, gone, was removed
  ckpt.close()
  ctl_a.close()


def test_a_job_whose_trainers_left_a_live_sidecar_is_taken_over(make_server, tmp_path,
                                                                monkeypatch):
  a, b = make_server(), make_server()
  directory = tmp_path / "ck"
  with _controller(a) as ctl_a:  # its Worker detaches as it closes: the job is gone
    assert ctl_a.worker(0) is not None
    _open(ctl_a, directory, monkeypatch, "job A").close()
  with _controller(b) as ctl_b:
    def opens() -> bool:
      try:
        _open(ctl_b, directory, monkeypatch, "job B").close()
      except sidecar.PermissionDeniedError:
        return False
      return True
    assert eventually(opens, timeout=3 * ownership.RELEASE_S)


def test_a_restarted_trainer_of_the_job_goes_on_while_its_predecessor_is_held(
    make_server, tmp_path, monkeypatch):
  """A trainer SIGKILLed and restarted under sidecar launch --max-restarts: the same job,
  on the same sidecar, whose predecessor's session the sidecar has not seen go yet."""
  server = make_server()
  directory = tmp_path / "ck"
  with _controller(server) as before:
    held = _open(before, directory, monkeypatch, "sidecar launch 1234")
    with _controller(server) as after, _open(after, directory, monkeypatch,
                                             "sidecar launch 1234") as ckpt:
      ckpt.save(1, {"w": np.ones(4, np.float32)}).durable.result(30)
      with pytest.raises(sidecar.PermissionDeniedError, match="'sidecar launch 1234'"):
        _open(after, directory, monkeypatch, "sidecar launch 5678")
    held.close()
