"""Tier 2: what a Stage that begins its step does before it answers, which ``save()`` waits
for (issue 69 item 5: ``save()`` within 2x a Status round trip): each path it names is
resolved once in the call, its step's writer starts once it answered."""

import os
import threading

import numpy as np
import pytest

from sidecar._src.ckptfmt.spec import LeafKind, LeafSpec
from sidecar._src.server.checkpoint import checkpoints as checkpoints_lib, roots as roots_lib
from sidecar._src.wire import checkpoint_wire as wire
from sidecar._src.wire.protocol import ckpt_pb
from tests.conftest import eventually
from tests.support.raw_client import Raw
from tests.support.staged import staged

pytestmark = pytest.mark.server


def test_a_stage_that_begins_its_step_resolves_its_directory_once(make_server, tmp_path,
                                                                 monkeypatch):
  # Its directory was resolved twice (Begin's part, then the Stage's), its tmp directories
  # once each, part by part: 5 realpaths of 6-7 parts each.
  server = make_server(token="t")
  raw = Raw(server.port, token="t")
  directory = str(tmp_path / "ck")
  tmp = f"{directory}/1.orbax-checkpoint-tmp"
  raw.ckpt.Open(ckpt_pb.CheckpointOpenRequest(directory=directory), metadata=raw.metadata,
                timeout=10)
  full = []
  realpath = os.path.realpath
  # Each call with its thread: the step's writer, started once the Stage answered, may
  # resolve paths of its own (PosixPaths too) while this test reads the list.
  monkeypatch.setattr(roots_lib.os.path, "realpath",
                      lambda p: full.append((threading.get_ident(), str(p))) or realpath(p))
  leaf = LeafSpec(key_path=("w",), shape=(8,), dtype=np.dtype(np.float32),
                  kind=LeafKind.NUMPY)
  request = ckpt_pb.CheckpointStageRequest(
      directory=directory, step=1, tmp_dir=f"{tmp}/default", final_dir=f"{directory}/1/default",
      leaves=[wire.leaf_to_pb(leaf)], last=True, begin_format="orbax")
  wire.staged_to_pb(request, [staged(("w",), 0, ((0, 8),), np.ones(8, np.float32))], None)
  answer = raw.ckpt.Stage(request, metadata=raw.metadata, timeout=10)
  assert answer.staged_bytes == 32
  calls = list(full)
  handler = next(t for t, p in calls if p == directory)  # the Stage's, which resolved it first
  mine = [p for t, p in calls if t == handler and p.startswith(directory)]
  assert mine == [directory], mine  # the others below it: their last parts lstat-ed
  assert eventually(lambda: os.path.exists(f"{tmp}/_CHECKPOINT_METADATA"))  # written on


def test_threads_spawned_in_a_held_block_start_at_its_start(tmp_path):
  """A Stage's writer and commit threads start once it answered
  (``service._threads_after_answer``): held until ``start()``, which queues them to the
  starter thread; after close() it starts them itself."""
  cps = checkpoints_lib.Checkpoints(0, roots=(str(tmp_path),))
  ran: list[str] = []
  try:
    with cps.holding_spawns() as start:
      cps._spawn(ran.append, "held", name="sidecar-test-held")
      held = [t for t in threading.enumerate() if t.name == "sidecar-test-held"]
      assert not held and ran == []  # not started: not even queued
    cps._spawn(ran.append, "free", name="sidecar-test-free")  # outside: as before
    assert eventually(lambda: ran == ["free"])
    start()
    assert eventually(lambda: ran == ["free", "held"])
    start()  # once only
    with cps.holding_spawns() as late:
      cps._spawn(ran.append, "late", name="sidecar-test-late")
  finally:
    cps.close()
  late()  # the starter has ended: started here, and run
  assert eventually(lambda: ran == ["free", "held", "late"])
