"""Tier 1: Checkpointer's step deletion against a fake transport, no sockets."""

import concurrent.futures
import logging
import types

import numpy as np

from sidecar._src import errors
from sidecar._src.controller.checkpoint import Checkpointer


class FakeSidecars:
  """Answers the ``sidecar.ckpt.*`` calls a save makes; ``delete`` fails as a lost host."""

  def __init__(self, steps):
    self.steps = list(steps)
    self.calls = []

  def call(self, name, *args, hosts, timeout=None):
    self.calls.append(name)
    if name == "sidecar.ckpt.open":
      return [{"steps": self.steps} for _ in hosts]
    if name == "sidecar.ckpt.delete":
      raise errors.HostLostError(f"host {hosts[0]} is gone", host_id=hosts[0])
    return [None for _ in hosts]

  def call_async(self, name, *args, hosts, timeout=None):
    self.calls.append(name)
    result = [] if name == "sidecar.ckpt.prepared" else None
    futures = []
    for _ in hosts:
      f = concurrent.futures.Future()
      f.set_result(result)
      futures.append(f)
    return futures

  def status(self):
    return [types.SimpleNamespace(identity=types.SimpleNamespace(host_id=0),
                                  arena_size=1 << 20, arena_used=0, checkpoints=[])]


def test_a_failed_delete_is_logged_and_the_step_stays_listed(caplog):
  fake = FakeSidecars(steps=[1, 2])
  ckpt = Checkpointer(directory="/ckpt/run", call=fake.call, call_async=fake.call_async,
                      put=lambda host, data: data, hosts=[0], device_hosts={},
                      status=fake.status, max_to_keep=2, keep_period=None, ram_steps=1,
                      ram_budget=None, if_busy="wait")
  with caplog.at_level(logging.WARNING, logger="sidecar._src.controller.checkpoint"), ckpt:
    handle = ckpt.save(3, {"x": np.arange(4, dtype=np.int32)})
    ckpt.wait()
  assert handle.durable.result() == 3
  assert "sidecar.ckpt.commit" in fake.calls and "sidecar.ckpt.delete" in fake.calls
  assert ckpt.all_steps() == [1, 2, 3]  # step 1 is listed again, to be retried next save
  assert "could not delete step 1 of /ckpt/run: host 0 is gone" in caplog.text
