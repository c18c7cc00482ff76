"""A sidecar step's states: each legal transition, the failure edges, and a transition
from a state the step does not leave raising StateError.

Steps made of plain arrays, driven as the sidecar's stage, writer, agreement, replication
and RAM tier drive them; no writer thread, no server.
"""

import sys
import threading

import numpy as np
import pytest

from sidecar._src.ckptfmt.records import ReplicaTarget, Replicated, ShardId
from sidecar._src.core import errors
from sidecar._src.server.checkpoint import ram_tier, step as step_lib
from sidecar._src.server.checkpoint.step import State, StateError, Takeover
from tests.conftest import eventually
from tests.support.ram_steps import AsStaged, make_step, shards_of

pytestmark = pytest.mark.unit

D = "/ck/run"
FINAL = f"{D}/1/default"


def shard(i: int) -> dict[ShardId, np.ndarray]:
  return {ShardId(("w",), ((i, i + 1),)): np.full(4, i, np.float32)}


def fresh(writers: int = 1) -> step_lib.Step:
  return step_lib.Step(D, 1, FINAL, tmp_dir=f"{FINAL}.tmp", writers=writers,
                       numbering=AsStaged())


def test_a_step_goes_staging_staged_written_committed_dropped():
  own = fresh()
  assert own.state is State.STAGING and not own.wait_whole(0)
  assert not own.take("a", None, shards_of(shard(0)), last=False, writers=1)
  assert own.state is State.STAGING and own.nbytes == 16
  assert own.take("a", None, shards_of(shard(1)), last=True, writers=1)
  assert own.state is State.STAGED and own.wait_whole(0) and own.owners == {"a"}
  arrived = list(own.arrivals(0.0))  # the writer's: every shard, then the end
  assert [s.record.id for s in arrived] == [*shard(0), *shard(1)]
  assert list(own.shards) == [*shard(0), *shard(1)]  # one map: records and bytes together
  np.testing.assert_array_equal(own.shards[ShardId(("w",), ((1, 2),))], np.full(4, 1))
  own.count_written(32)
  own.end_write([s.record for s in arrived])
  assert own.state is State.WRITTEN and own.wait_written(0)
  assert own.written == 32 and own.error is None and len(own.written_records) == 2
  own.commit()
  own.commit()  # told again (the sidecars' commit, then the trainers'): nothing more
  assert own.state is State.COMMITTED and own.committed
  own.drop()
  assert own.state is State.DROPPED and own.shards == {} and own.staged() == []


def test_two_writers_make_it_whole_only_with_both_last_parts():
  own = fresh(writers=2)
  assert not own.take("a", None, shards_of(shard(0)), last=True, writers=2)
  assert own.state is State.STAGING and not own.wait_whole(0)
  assert own.take("b", None, shards_of(shard(1)), last=True, writers=2)
  assert own.state is State.STAGED and own.wait_whole(0) and own.owners == {"a", "b"}


@pytest.mark.parametrize("last", [False, True], ids=["mid-stage", "staged-whole"])
def test_a_failed_write_is_failed_then_dropped(last):
  own = make_step(D, 1, FINAL, shard(0), written=False, staged=last)
  own.end_write(error=OSError(28, "No space left on device"))
  assert own.state is State.FAILED and isinstance(own.error, OSError) and own.wait_written(0)
  with pytest.raises(StateError, match=r"step 1 at '/ck/run/1/default' is failed: it cannot "
                                       r"become committed \(only from written\)"):
    own.commit()
  own.drop()
  assert own.state is State.DROPPED


def test_a_step_failed_mid_stage_lets_its_bytes_go_and_keeps_its_error():
  """Kept in the tier for its trainer to learn why (write.write_step), without its bytes."""
  own = make_step(D, 1, FINAL, shard(0), written=False, staged=False)
  with pytest.raises(StateError, match=r"is STAGING: only a failed step lets its bytes go"):
    own.let_go()
  own.end_write(error=OSError(28, "No space left on device"))
  own.let_go()
  assert own.state is State.FAILED and isinstance(own.error, OSError)
  assert own.shards == {} and own.staged() == [] and own.owners


def test_an_abort_mid_write_drops_it_and_stops_its_writer():
  """Dropped while staging: the writer waiting for shards stops with why, and its end is
  recorded on the step, which stays dropped."""
  own = make_step(D, 1, FINAL, shard(0), written=False, staged=False)
  own.drop()
  with pytest.raises(errors.ClosedError, match=r"^the save of step 1 was aborted$"):
    list(own.arrivals(0.0))  # the shard first, then the abort
  own.end_write(error=errors.ClosedError("aborted"))
  assert own.state is State.DROPPED and isinstance(own.error, errors.ClosedError)
  assert own.wait_whole(0) and own.wait_written(0)


def test_a_writer_with_no_part_for_too_long_gives_up():
  own = fresh()
  with pytest.raises(errors.DeadlineExceededError,
                     match=r"step 1: no part staged for 0 s; the trainer stopped mid-save"):
    list(own.arrivals(0.0))


def test_a_stopping_sidecar_stops_the_writer_and_the_replication():
  own = fresh()
  own.stop(errors.ClosedError("stopping"))
  with pytest.raises(errors.ClosedError, match="stopping"):
    list(own.arrivals(0.0))
  assert own.state is State.STAGING  # its writer's end makes it failed


@pytest.mark.parametrize(("state", "move", "match"), [
    (State.STAGED, lambda s: s.take("a", None, [], last=True, writers=1),
     r"is staged: it takes no more parts \(only while staging\)"),
    (State.WRITTEN, lambda s: s.end_write([]), r"its write ended already"),
    (State.STAGING, lambda s: s.end_write([]),
     r"is staging: it cannot become written \(only from staged\)"),
    (State.STAGED, lambda s: s.commit(), r"is staged: it cannot become committed"),
    (State.DROPPED, lambda s: s.drop(), r"is dropped: it cannot become dropped"),
    (State.STAGING, lambda s: s.take_over(threading.Event()),
     r"only a whole step is taken over, once"),
    (State.STAGING, lambda s: s.start_replication(lambda: step_lib.Replication([])),
     r"is staging: only a whole step is replicated"),
    (State.DROPPED, lambda s: s.start_replication(lambda: step_lib.Replication([])),
     r"is dropped: only a whole step is replicated"),
], ids=["take-staged", "end-write-twice", "written-while-staging", "commit-unwritten",
        "drop-twice", "take-over-staging", "replicate-staging",
        "replicate-dropped"])
def test_a_transition_from_a_state_it_does_not_leave_raises(state, move, match):
  own = make_step(D, 1, FINAL, shard(0), written=state in (State.WRITTEN, State.DROPPED),
                  staged=state is not State.STAGING)
  if state is State.DROPPED:
    own.drop()
  assert own.state is state
  with pytest.raises(StateError, match=match):
    move(own)
  assert own.state is state  # unchanged


def test_a_step_taken_over_is_pending_until_its_agreement_ends():
  own = make_step(D, 1, FINAL, shard(0), written=False)
  assert own.takeover is Takeover.NONE and own.wait_agreed(0)
  ended = threading.Event()  # its agreement's (agreement.Agreement.ended)
  own.take_over(ended)
  assert own.takeover is Takeover.PENDING and not own.wait_agreed(0)
  with pytest.raises(StateError, match="taken over already"):
    own.take_over(threading.Event())
  ended.set()  # committed or abandoned by the sidecars: the step keeps no copy of it
  assert own.takeover is Takeover.ENDED and own.wait_agreed(0)


def test_a_refused_takeover_leaves_it_as_before():
  own = make_step(D, 1, FINAL, shard(0))
  own.take_over(threading.Event())
  own.refuse_takeover()
  assert own.takeover is Takeover.NONE


def test_its_commit_ends_its_agreement_in_the_same_transition():
  """A step committed here (its trainers' Committed, or the sidecars' commit, through the
  RAM tier) is never committed and pending: its commit ends its takeover, in one place."""
  own = make_step(D, 1, FINAL, shard(0))
  ended = threading.Event()
  own.take_over(ended)
  own.commit()
  assert own.committed and own.takeover is Takeover.ENDED and own.wait_agreed(0)
  assert ended.is_set()  # its agreement's wait for it ends too
  again = make_step(D, 2, FINAL + "2", shard(0))
  again.take_over(threading.Event())
  tier = ram_tier.RamTier(0, uncommitted_s=3600.0)
  tier.add(again)
  tier.mark_committed(again.final_dir)  # its trainers told it (Committed)
  assert again.committed and again.takeover is Takeover.ENDED and again.wait_agreed(0)
  tier.clear()


def test_a_replication_starts_once_and_a_drop_cancels_it():
  own = make_step(D, 1, FINAL, shard(0), written=False)
  receivers = [ReplicaTarget(host_id=2, address="127.0.0.1:1")]
  job, made = own.start_replication(lambda: step_lib.Replication(receivers, tenant="t"))
  again, made_again = own.start_replication(lambda: step_lib.Replication([]))
  assert made and not made_again and again is job and own.replication is job
  assert job.receivers == tuple(receivers) and not job.cancelled and not job.wait(0)
  job.succeeded(Replicated((2,), 1, 16, 0.1))
  assert job.wait(0) and job.result is not None and job.error is None
  own.drop()
  assert job.cancelled


def test_a_failed_replication_keeps_its_error():
  job = step_lib.Replication([])
  job.failed(errors.HostLostError("gone", host_id=2))
  assert job.wait(0) and isinstance(job.error, errors.HostLostError) and job.result is None


def test_a_write_ends_once_even_racing_a_drop():
  """The writer's end and an abort's drop from two threads, many times: the step is
  dropped either way, its write's end recorded once."""
  for _ in range(200):
    own = make_step(D, 1, FINAL, shard(0), written=False)
    go = threading.Barrier(2)

    def writer(own=own, go=go):
      go.wait()
      own.end_write([])

    t = threading.Thread(target=writer)
    t.start()
    go.wait()
    own.drop()
    t.join()
    assert own.state is State.DROPPED and own.wait_written(0) and own.error is None


def test_a_replicate_waiting_for_a_step_whose_save_is_aborted_is_told_it_is_gone():
  """Issue 69 review: a Replicate of a step one of whose two writers sent its last part
  waits for the other's (``wait_whole``); the save is aborted meanwhile: the Replicate got
  StateError (an internal error: 'dropped: only a whole step is replicated'), where a
  moment later it got InvalidArgumentError ('has not staged'). Now InvalidArgumentError
  either way, saying why."""
  from sidecar._src.server import metrics as metrics_lib
  from sidecar._src.server.checkpoint import links as links_lib, replication

  tier = ram_tier.RamTier(0, uncommitted_s=3600.0)
  own = fresh(writers=2)
  tier.add(own)
  assert not own.take("a", None, shards_of(shard(0)), last=True, writers=2)
  replicator = replication.Replicator(
      0, tier=tier, links=None, path=lambda p, what: p, spawn=None,
      metrics=metrics_lib.Recorder(), hosts=links_lib.ReplicaHosts(["127.0.0.1:1", "127.0.0.1:2"]))
  raised: list[BaseException] = []

  def replicate():
    try:
      replicator.replicate(FINAL, [1], timeout=30)
    except BaseException as e:  # noqa: BLE001 - what the rpc would answer
      raised.append(e)

  t = threading.Thread(target=replicate)
  t.start()
  assert eventually(lambda: "wait_whole" in _functions_of(t))  # the other writer's part
  tier.remove_item(FINAL)  # the save aborted
  t.join(30)
  [e] = raised
  assert type(e) is errors.InvalidArgumentError, repr(e)
  assert str(e) == (f"host 0 holds step 1 at {FINAL!r} no more: its save was aborted (or "
                    "its RAM tier let it go) before its replication began; nothing to "
                    "replicate")


def _functions_of(t: threading.Thread) -> list[str]:
  """The functions thread ``t`` is in now, innermost first."""
  frame = sys._current_frames().get(t.ident)
  names = []
  while frame is not None:
    names.append(frame.f_code.co_name)
    frame = frame.f_back
  return names
