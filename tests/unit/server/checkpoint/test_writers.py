"""A step's writer thread starts with its first part that has something to write, and the
steps one tenant holds begun are bounded (issue 76, attack 9): a step begun with nothing
staged holds no thread; the reaper fails one whose part never comes, as its writer would
have; an abort ends one at once. Through the wire: tests/server/server/checkpoint/
test_begun_steps.py."""

import threading

import numpy as np
import pytest

from sidecar._src.ckptfmt import spec as spec_lib
from sidecar._src.ckptfmt.save_values import Abort, Begin, Prepared, Stage
from sidecar._src.core import errors
from sidecar._src.server import metrics as metrics_lib
from sidecar._src.server.checkpoint import (
  ram_tier,
  roots as roots_lib,
  save as checkpoint_save,
  step as step_lib,
  write as write_lib,
)
from sidecar._src.server.checkpoint.caller import Caller
from tests.support.staged import staged

pytestmark = pytest.mark.unit

LEAF = spec_lib.LeafSpec(key_path=("w",), shape=(4,), dtype=np.float32)


@pytest.fixture
def writer(tmp_path):
  """A StepWriter whose spawned threads are counted (``started``) and joined after."""
  started: list[threading.Thread] = []

  def spawn(target, *args, name):
    started.append(threading.Thread(target=target, args=args, name=name, daemon=True))
    started[-1].start()

  tier = ram_tier.RamTier(0, uncommitted_s=3600.0)
  w = checkpoint_save.StepWriter(0, tier=tier, roots=roots_lib.Roots(0, (str(tmp_path),)),
                                 spawn=spawn, metrics=metrics_lib.Recorder())
  w.started, w.tier = started, tier
  yield w
  w.close(errors.ClosedError("the test ends"))
  for own in tier.steps():
    own.stop(errors.ClosedError("the test ends"))
  for t in started:
    t.join(30)


def _begin(writer, directory: str, step: int, *, shards=(), last=False, owner="a", tenant=None):
  """A Stage that begins ``step`` (as a trainer's first part does), carrying ``shards``."""
  tmp = writer.tmp_of(directory, step)
  stage = Stage(directory, step, f"{tmp}/default", f"{directory}/{step}/default", [LEAF],
                list(shards), last=last, begin=Begin(directory, step, "orbax"))
  caller = Caller(owner=owner, tenant=tenant)
  begun, finish = writer.begin_staged(stage, caller)
  return writer.stage(stage, caller, finish_tmp=finish)


def test_a_step_begun_with_nothing_staged_holds_no_thread_until_its_first_shard(writer,
                                                                               tmp_path):
  directory = str(tmp_path / "ck")
  writer.open(directory)
  _begin(writer, directory, 1)
  assert writer.started == []  # begun, nothing to write: no thread
  tmp = writer.tmp_of(directory, 1)
  w = np.arange(4, dtype=np.float32)
  writer.stage(Stage(directory, 1, f"{tmp}/default", f"{directory}/1/default", [LEAF],
                     [staged(("w",), 0, ((0, 4),), w)], last=True), Caller(owner="a"))
  assert [t.name for t in writer.started] == ["sidecar-ckpt-1"]
  assert [r.crc32c is not None for r in writer.prepared(Prepared(f"{directory}/1/default"),
                                                        Caller(wait_s=30))] == [True]


def test_a_begun_step_whose_part_never_comes_fails_as_its_writer_would_have(
    writer, tmp_path, monkeypatch):
  directory = str(tmp_path / "ck")
  writer.open(directory)
  _begin(writer, directory, 2)
  writer.forget_ended()  # the reaper, before the wait is over: it waits on
  (own,) = writer.tier.steps()
  assert own.state is step_lib.State.STAGING
  monkeypatch.setattr(write_lib, "STAGE_TIMEOUT_S", 0.0)
  writer.forget_ended()  # the reaper, once it is over
  assert own.state is step_lib.State.FAILED and own.wait_written(0)
  with pytest.raises(errors.DeadlineExceededError, match="step 2: no part staged for 0 s"):
    writer.prepared(Prepared(f"{directory}/2/default"), Caller(wait_s=5))
  assert writer.started == []


def test_an_abort_of_a_begun_step_ends_it_at_once(writer, tmp_path):
  directory = str(tmp_path / "ck")
  writer.open(directory)
  _begin(writer, directory, 3)
  (own,) = writer.tier.steps()
  assert writer.abort(Abort(writer.tmp_of(directory, 3), f"{directory}/3/default"),
                      Caller(wait_s=5)) == ""
  assert own.wait_written(0) and isinstance(own.error, errors.ClosedError)
  assert writer.started == []


@pytest.mark.parametrize("tenant", ["bob", None], ids=["a-tenant", "no-tenants-a-session"])
def test_the_steps_being_staged_are_bounded_per_tenant(writer, tmp_path, tenant):
  directory = str(tmp_path / "ck")
  writer.open(directory)
  for step in range(write_lib.BEGUN_STEPS):
    _begin(writer, directory, step, tenant=tenant)
  who = f"tenant {tenant!r}" if tenant else "this session"
  with pytest.raises(errors.ResourceExhaustedError,
                     match=rf"stage: {who} holds 16 steps begun and not staged whole on host 0, "
                           r"the most one may \(BEGUN_STEPS = 16\)"):
    _begin(writer, directory, 99, tenant=tenant)
  # Another tenant (another session, with none) is not held up; one staged whole frees one.
  _begin(writer, directory, 100, tenant="alice" if tenant else None, owner="b")
  tmp = writer.tmp_of(directory, 0)
  writer.stage(Stage(directory, 0, f"{tmp}/default", f"{directory}/0/default", [LEAF],
                     [staged(("w",), 0, ((0, 4),),
                             np.zeros(4, np.float32))], last=True), Caller(owner="a",
                                                                           tenant=tenant))
  _begin(writer, directory, 101, tenant=tenant)
