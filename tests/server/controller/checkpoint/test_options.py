"""ctl.checkpointer takes the CheckpointOptions that sidecar.torch's checkpointers take
(issue 36 item 1), against an in-process sidecar: its options are kept, and given twice
they are refused before anything is opened."""

import numpy as np
import pytest

import sidecar
from sidecar._src.controller.checkpoint.options import CheckpointOptions
from tests.support.paths import entries

pytestmark = pytest.mark.server


def test_the_checkpointer_keeps_the_steps_its_options_say(make_server, tmp_path):
  server = make_server(shm_size=16 << 20)
  state = {"w": np.arange(1024, dtype=np.float32)}
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"]) as ctl:
    with pytest.raises(sidecar.InvalidArgumentError,
                       match=r"give either options=CheckpointOptions\(...\) or .*max_to_keep"):
      ctl.checkpointer(tmp_path / "ck", max_to_keep=3, options=CheckpointOptions())
    assert not (tmp_path / "ck").exists()
    options = CheckpointOptions(max_to_keep=2, keep_period=4, if_busy="skip")
    with ctl.checkpointer(tmp_path / "ck", options=options) as ckpt:
      for step in range(1, 7):
        ckpt.save(step, state).durable.result(60)
        ckpt.wait()
      assert ckpt.all_steps() == [4, 5, 6]  # the 2 newest, and 4 for keep_period
  assert entries(tmp_path / "ck") == ["4", "5", "6"]


def test_replicas_beyond_the_hosts_warn_once_per_controller_not_at_every_save(
    make_server, tmp_path, caplog):
  # Before: at every PyTorch save (DCP takes a new StorageWriter for each), the warning.
  from sidecar._src.torch import storage
  server = make_server(shm_size=16 << 20)
  warning = "replicas=1, but there are 1 hosts: each shard gets 0 replica copies"
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"]) as ctl:
    for step in range(3):
      writer = storage.StorageWriter(tmp_path / "torch" / str(step), replicas=1,
                                     controller=ctl)
      assert writer.replicas == 0
    with ctl.checkpointer(tmp_path / "jax", replicas=1) as ckpt:
      assert ckpt.replicas == 0
    assert caplog.text.count(warning) == 1
    with ctl.checkpointer(tmp_path / "jax", replicas=2):
      pass
    assert caplog.text.count("replicas=2, but there are 1 hosts") == 1
