"""Tier 1: the one Checkpointer behind ``ctl.checkpointer`` and ``sidecar.torch.Checkpointer``:
the same handle, retention and busy decision whichever agreement plug saves (the key-value
store's, JAX's and numpy's; DCP's coordinator's), against the in-process fake sidecars."""

import numpy as np
import pytest
import torch

import sidecar.torch
from sidecar._src.controller.checkpoint.checkpointer import Checkpointer
from sidecar._src.core import errors
from tests.support import fake_sidecars
from tests.support.torch_sidecars import FakeController, Recording

pytestmark = [pytest.mark.unit,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def key_value(fake, **options) -> Checkpointer:
  return fake_sidecars.checkpointer(fake, **options)


def dcp(fake, **options) -> Checkpointer:
  return sidecar.torch.Checkpointer(
      "/ckpt/run", options=sidecar.CheckpointOptions(**options),
      controller=FakeController(fake))


PLUGS = pytest.mark.parametrize("make", [key_value, dcp], ids=["key-value", "dcp"])


def tree(make, value: float) -> dict:
  if make is dcp:
    return {"w": torch.full((4,), value)}
  return {"w": np.full(4, value, np.float32)}


@PLUGS
def test_one_checkpointer_class_whichever_framework_saves(make):
  # sidecar.torch.Checkpointer is a public class built on the core one: it adds only the
  # constructor that hands the core DCP's agreement plug, no save path of its own.
  with make(Recording(hosts=(0,))) as ckpt:
    assert isinstance(ckpt, Checkpointer)
    assert type(ckpt) is (Checkpointer if make is key_value else sidecar.torch.Checkpointer)
  assert [n for n in vars(sidecar.torch.Checkpointer) if n not in ("__module__", "__doc__")] == [
      "__init__"]


@PLUGS
def test_replicated_holds_the_step_with_no_replicas_for_every_framework(make):
  """It held None for JAX's and the step for PyTorch's."""
  with make(Recording(hosts=(0,))) as ckpt:
    handle = ckpt.save(3, tree(make, 1.0))
    assert (handle.staged.result(30), handle.durable.result(30),
            handle.replicated.result(30)) == (3, 3, 3)


@PLUGS
def test_replication_starts_before_the_commit_and_resolves_replicated(make):
  fake = Recording(hosts=(0, 1))
  with make(fake, replicas=1) as ckpt:
    assert ckpt.save(1, tree(make, 1.0)).replicated.result(30) == 1
  phases = [s[0] for s in fake.sent]
  assert phases.index("replicate") < phases.index("commit")
  assert (0, [1]) in fake.replicated_to  # host 0 sends its part to host 1


@PLUGS
def test_the_core_retention_keeps_max_to_keep_and_restores_the_latest(make):
  fake = Recording(hosts=(0,))
  with make(fake, max_to_keep=2) as ckpt:
    for step in (1, 2, 3):
      ckpt.save(step, tree(make, float(step))).durable.result(30)
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3
    restored = ckpt.restore(None, tree(make, 0.0))
  assert [c for c in fake.calls if c[0] == "delete"] == [("delete", 0)]
  assert float(restored["w"][0]) == 3.0


@PLUGS
def test_every_framework_skips_a_save_while_one_is_in_flight_with_if_busy_skip(make):
  fake = Recording(hosts=(0,))
  fake.writing.clear()  # step 1's writes go on until set
  with make(fake, if_busy="skip") as ckpt:
    first = ckpt.save(1, tree(make, 1.0))
    skipped = ckpt.save(2, tree(make, 2.0))
    assert (skipped.staged.result(), skipped.durable.result(),
            skipped.replicated.result()) == (None, None, None)
    assert not first.durable.done()
    fake.writing.set()
    assert first.durable.result(30) == 1 and ckpt.save(3, tree(make, 3.0)).durable.result(30) == 3


def test_a_dcp_checkpointer_refuses_data_state_and_names_where_it_goes():
  with dcp(Recording(hosts=(0,))) as ckpt, pytest.raises(
      errors.InvalidArgumentError, match=r"keeps the data position in the state dict"):
    ckpt.save(1, {"w": torch.zeros(2)}, data_state={"epoch": 1})


@PLUGS
def test_every_framework_refuses_to_save_a_committed_step_and_saves_a_lower_new_one(make):
  """issue 55 item 2: DCP's plug replaced a committed step, the key-value plug refused it."""
  with make(Recording(hosts=(0,))) as ckpt:
    for step in (3, 5):
      ckpt.save(step, tree(make, float(step))).durable.result(30)
    for step in (5, 3):
      with pytest.raises(errors.InvalidArgumentError,
                         match=rf"^step {step} is already saved in /ckpt/run \(committed steps: "
                         r"\[3, 5\]\); a save never replaces a committed step: to resume, "
                         r"restore the latest \(latest_step\(\) is 5\)"):
        ckpt.save(step, tree(make, 6.0))
    assert ckpt.save(4, tree(make, 4.0)).durable.result(30) == 4  # not committed: saved
    assert ckpt.all_steps() == [3, 4, 5]
    assert float(ckpt.restore(5, tree(make, 0.0))["w"][0]) == 5.0
