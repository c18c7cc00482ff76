"""Tier 2: an open's sweep never removes a step whose commit is under way on its sidecar.

A trainer with no worker session (``Controller(attach=False)``: its shards travel inline
in its Stages) saves a DCP step, which its trainer commits (the sidecars do not take a
DCP step over); the sidecar knows nothing of that trainer's liveness. Another
checkpointer of the same job opens the directory while the commit is held on the sidecar
(``slowcommit@STEP:PATH``): its sweep took the step's uncommitted directory as a dead
save's and removed it under the commit, which then failed ("rank 0's __0_0.distcp is
missing") and the step was lost. Now the step is committed whole, and the sweep still
removes a directory no save here writes.
"""

import logging

import pytest
import torch

import sidecar
import sidecar.torch
from sidecar._src.ckptfmt.dcp import commit as dcp_commit, distcp
from sidecar._src.core import env as env_lib
from sidecar._src.server.checkpoint import faults
from tests.conftest import eventually

pytestmark = [pytest.mark.server,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def test_an_open_during_a_trainers_commit_keeps_its_step_and_sweeps_a_dead_saves(
    make_server, tmp_path, monkeypatch, caplog):
  release = tmp_path / "release"
  monkeypatch.setenv(faults.FAULT_ENV, f"slowcommit@1:{release}")
  monkeypatch.setenv(env_lib.JOB, "one-job")  # both checkpointers: one job's
  caplog.set_level(logging.INFO, logger="sidecar")
  server = make_server(shm_size=16 << 20)
  ck = tmp_path / "ck"
  dead = dcp_commit.create_tmp(ck / "7")  # a save that died before its commit left it
  state = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.full((3,), 1)}
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], attach=False, timeout=30) as ctl, \
      sidecar.torch.Checkpointer(ck, controller=ctl) as ckpt:
    assert ctl.worker(0) is None and not dead.exists()  # no worker session; its open swept
    dead = dcp_commit.create_tmp(ck / "7")
    handle = ckpt.save(1, state)
    try:
      assert eventually(lambda: "holding slowcommit of step 1" in caplog.text, 30)
      tmp = ck / f"1{distcp.TMP_SUFFIX}"
      assert (tmp / distcp.file_name(0)).is_file()  # written; its commit held on the sidecar
      with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], attach=False,
                                  timeout=30) as other, \
          sidecar.torch.Checkpointer(ck, controller=other):  # its open sweeps ck
        kept = tmp.is_dir()
    finally:
      release.touch()
    handle.durable.result(60)  # was CheckpointWriteError: rank 0's __0_0.distcp is missing
    assert kept and not dead.exists()
    assert ckpt.all_steps() == [1]
    restored = {"w": torch.zeros(4096), "b": torch.zeros(3, dtype=torch.int64)}
    ckpt.restore(1, restored)  # in place, as dcp.load
    assert torch.equal(restored["w"], state["w"]) and torch.equal(restored["b"], state["b"])
  assert sorted(p.name for p in ck.iterdir() if not p.name.startswith(".")) == ["1"]
