"""The RAM tier's steps, replicas and budgets: which committed steps stay, which go, and
that their arena blocks go back.

A real arena: each staged shard is a leased view of an arena block, as the sidecar
stages it; a block returns to the allocator once no step or replica (and no test) holds
its view. No server, no processes.
"""

import logging
import threading

import numpy as np
import pytest

from sidecar._src.arena import shm
from sidecar._src.ckptfmt.records import Held, ReplicaTarget, ShardId
from sidecar._src.core import errors
from sidecar._src.server.arenas.leases import Leases
from sidecar._src.server.checkpoint import ram_tier, step as step_lib
from tests.support.ram_steps import make_step

pytestmark = pytest.mark.unit

D = "/ck/run"
KB = shm.ALIGN  # one arena block per shard


@pytest.fixture
def arena():
  arena = shm.Arena.create(shm.MIN_SIZE)
  leases = Leases(shm.Allocator(arena.size))
  yield arena, leases
  assert leases.allocator.used_bytes == 0, "a staged block was never freed"
  arena.close()


@pytest.fixture
def tier(arena):
  tier = ram_tier.RamTier(0, uncommitted_s=3600.0)
  yield tier
  forget_all(tier)


def forget_all(tier):
  tier.clear()


def staged(arena, nbytes=KB) -> np.ndarray:
  """A view of a fresh arena block that frees the block once the view dies."""
  arena, leases = arena
  pin = leases.new_pin()
  block = leases.alloc(nbytes, pin, timeout=0)
  return arena.lease(block.offset, nbytes,
                     lambda: leases.release(block.offset, block.generation, pin))


def item(step, directory=D):
  return f"{directory}/{step}/default"


def add_step(tier, arena, step, *, blocks=1, directory=D, committed=False, done=True):
  """This host's own shards of ``step`` (``blocks`` of them), as a finished write
  (``done``), committed or not, or one still being written."""
  shards = {ShardId(("w",), ((i, i + 1),)): staged(arena) for i in range(blocks)}
  own = make_step(directory, step, item(step, directory), shards, written=done)
  tier.add(own)
  if committed:
    tier.mark_committed(own.final_dir)
  return own


def add_replica(tier, arena, step, source, *, blocks=1, whole=True, committed=False):
  replica = tier.open_replica(D, step, item(step), source)  # held at once: none is whole
  for i in range(blocks):
    replica.add_shard(ShardId(("w",), ((i, i + 1),)), staged(arena))
  if whole:
    replica.mark_whole()
  if committed:
    replica.commit()


def replica_of(tier, final_dir, source):
  (replica,) = [r for r in tier.replicas() if r.final_dir == final_dir and r.source == source]
  return replica


def commit(tier, arena, step, **kw):
  add_step(tier, arena, step, **kw)
  return tier.mark_committed(item(step, kw.get("directory", D)))


def used_blocks(arena) -> int:
  """Blocks in use now: a view's block goes back as its last reference dies, no GC needed."""
  return arena[1].allocator.num_blocks


def test_the_newest_ram_steps_stay_and_the_rest_go_back_to_the_arena(tier, arena):
  tier.configure(D, 2, None)
  assert [commit(tier, arena, s) for s in (1, 2, 3)] == [[1], [1, 2], [2, 3]]
  assert [s.state for s in tier.steps()] == [step_lib.State.COMMITTED] * 2
  assert used_blocks(arena) == 2
  assert sorted(s.step for s in tier.steps()) == [2, 3]
  assert tier.holdings().commits == (item(1), item(2), item(3))  # step 1's: gone since


def test_a_directory_never_opened_keeps_one_step(tier, arena):
  assert [commit(tier, arena, s) for s in (4, 9, 6)] == [[4], [9], [9]]
  assert used_blocks(arena) == 1  # step 6 came after 9 but is older: it went at once


@pytest.mark.parametrize(("budget", "kept"), [
    (3 * KB, [3, 4]), (3 * KB - 1, [4]), (2 * KB, [4]), (2 * KB - 1, [3]), (KB - 1, []),
], ids=["both-fit-exactly", "one-byte-short", "newest-fits-exactly",
        "newest-too-big-older-stays", "none-fit"])
def test_the_budget_edge(tier, arena, budget, kept):
  """Newest first, a step stays if its bytes fit what the steps kept so far leave of
  the budget; one that does not fit goes, even the one just committed, and an older,
  smaller one may still stay."""
  tier.configure(D, 5, budget)
  commit(tier, arena, 3, blocks=1)
  assert commit(tier, arena, 4, blocks=2) == kept
  assert used_blocks(arena) == sum({3: 1, 4: 2}[s] for s in kept)


def test_replicas_count_toward_the_budget_and_leave_with_their_step(tier, arena):
  tier.configure(D, 2, 4 * KB)
  add_replica(tier, arena, 1, source=2)
  assert commit(tier, arena, 1) == [1]  # own + host 2's replica: 2 blocks
  add_replica(tier, arena, 2, source=2)
  assert commit(tier, arena, 2) == [1, 2]  # 4 blocks: fits
  add_replica(tier, arena, 3, source=2)
  add_replica(tier, arena, 3, source=3)
  assert commit(tier, arena, 3) == [3]  # 3 blocks; with step 2's 2 it would not fit
  assert sorted((r.final_dir, r.source) for r in tier.replicas()) == [(item(3), 2), (item(3), 3)]
  assert tier.holdings().commits == (item(1), item(2), item(3))
  assert used_blocks(arena) == 3


def test_a_step_held_only_as_a_replica_is_committed_and_kept(tier, arena):
  tier.configure(D, 1, None)
  add_replica(tier, arena, 7, source=1)
  assert tier.mark_committed(item(7)) == [7]
  assert replica_of(tier, item(7), 1).committed
  assert tier.held(D) == Held({}, {item(7): {1: (ShardId(("w",), ((0, 1),)),)}})


def test_a_step_this_host_never_held_is_not_recorded(tier):
  assert tier.mark_committed(item(5)) == []
  assert tier.holdings().commits == ()


def test_an_evicted_step_is_marked_gone_for_its_late_replicas(tier, arena):
  """A peer's replica that becomes whole after its step was committed here learns the
  step's fate from committed_dirs: False once the step left the RAM tier, so the
  replica is dropped, not kept for a step deleted since (checkpoint_replication)."""
  tier.configure(D, 1, None)
  commit(tier, arena, 1)
  commit(tier, arena, 2)
  tier.drop([(D, 2)])  # forget: max_to_keep deleted it
  assert tier.steps() == [] and used_blocks(arena) == 0
  for step in (1, 2):  # evicted, then forgotten: each late replica is dropped on arrival
    late = tier.open_replica(D, step, item(step), 3)
    tier.add_replica_shard(late, ShardId(("w",), ((0, 1),)), staged(arena))
    assert tier.replica_whole(late) and late.committed and tier.replicas() == []
    del late  # its block goes back with it: nothing holds it
    assert used_blocks(arena) == 0


def test_drop_cancels_the_replication_of_a_dropped_step(tier, arena):
  commit(tier, arena, 1)
  own = tier.find(item(1))
  job, made = own.start_replication(
      lambda: step_lib.Replication([ReplicaTarget(host_id=1, address="127.0.0.1:1")]))
  assert made and job.receivers[0].host_id == 1
  tier.drop([(D, 1)])
  assert job.cancelled and used_blocks(arena) == 0 and own.state is step_lib.State.DROPPED


def test_drop_keeps_uncommitted_steps_and_other_directories(tier, arena):
  add_step(tier, arena, 1)  # written, commit not yet in
  add_step(tier, arena, 1, directory="/ck/other", committed=True)
  tier.drop([(D, 1)])
  assert sorted(s.final_dir for s in tier.steps()) == ["/ck/other/1/default", item(1)]


def test_steps_whose_commit_never_comes_expire_and_free_their_blocks(arena, caplog):
  tier = ram_tier.RamTier(4, uncommitted_s=0.0)
  add_step(tier, arena, 1, blocks=2)  # written, never committed
  add_step(tier, arena, 2, done=False)  # still being written: never expires
  add_step(tier, arena, 3, committed=True)
  stale = tier.find(item(1))
  job, _ = stale.start_replication(lambda: step_lib.Replication([]))
  with caplog.at_level(logging.WARNING, logger="sidecar._src.server.checkpoint.ram_tier"):
    assert tier.expire_uncommitted() == [1]
  assert "step 1 of /ck/run was staged and written" in caplog.text
  assert ("never committed (the controller that staged it is gone?): its "
          f"{shm.format_size(2 * KB)} are freed") in caplog.text
  assert job.cancelled and stale.shards == {} and stale.state is step_lib.State.DROPPED
  assert sorted(s.step for s in tier.steps()) == [2, 3]
  assert used_blocks(arena) == 2  # the step is still referenced here; its blocks are not
  assert tier.expire_uncommitted() == []
  forget_all(tier)


def test_step_at_names_the_host_and_the_item(tier, arena):
  add_step(tier, arena, 1)
  assert tier.step_at(item(1)).step == 1
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"^host 0 has not staged /ck/run/2/default$"):
    tier.step_at(item(2))


def test_status_and_usage_say_what_is_held_and_written(tier, arena):
  tier.configure(D, 3, None)
  commit(tier, arena, 1, blocks=2)
  add_step(tier, arena, 2)  # written, commit not yet in
  add_step(tier, arena, 3, blocks=3, done=False).count_written(KB)
  add_replica(tier, arena, 1, source=2)
  replica_of(tier, item(1), 2).commit()
  add_replica(tier, arena, 0, source=2, committed=True)
  add_replica(tier, arena, 1, source=3, whole=False, committed=True)  # still arriving
  [status] = tier.status()
  assert status.directory == D
  assert (list(status.ram_steps), list(status.uncommitted), list(status.writing)) == ([1], [2], [3])
  assert (status.written_bytes, status.total_bytes) == (KB, 3 * KB) and status.writing_s >= 0
  assert ([(r.source_host, list(r.steps), r.nbytes) for r in status.replicas]
          == [(2, [0, 1], 2 * KB)])
  assert tier.usage() == {"ram_steps": 1, "ram_bytes": 2 * KB, "replica_steps": 2,
                          "replica_bytes": 2 * KB, "writing_steps": 1, "writing_bytes": 2 * KB}
  assert tier.held(D).own == {item(1): (ShardId(("w",), ((0, 1),)), ShardId(("w",), ((1, 2),)))}
  # Steps the sidecars took over are committing until their end is known here, written
  # or not, and never counted as uncommitted meanwhile.
  for step in (2, 3):
    tier.find(item(step)).take_over(threading.Event())
  [status] = tier.status()
  assert (list(status.committing), list(status.uncommitted), list(status.writing)) == (
      [2, 3], [], [3])
  tier.mark_committed(item(2))  # its trainers told it (Committed)
  assert list(tier.status()[0].committing) == [3]


def test_a_group_budget_that_reads_the_tier_back_does_not_deadlock(arena):
  """The tier runs no caller's code under its lock: the pool's budget of a group (its
  quotas) may read the tier (here its group's use) while a commit evicts within it; under
  the lock it deadlocked (the lock is not reentrant)."""
  asked: list[tuple[int, int]] = []

  def budget(group):
    asked.append(tier.group_use().get(group, (0, 0)))
    return 1 * KB

  tier = ram_tier.RamTier(0, uncommitted_s=3600.0, group_budget=budget)
  tier.set_group(D, "alice")
  tier.configure(D, 5, None)
  kept: list = []
  committing = threading.Thread(
      target=lambda: kept.append([commit(tier, arena, s) for s in (1, 2)]), daemon=True)
  committing.start()
  committing.join(10)
  assert not committing.is_alive(), "a commit deadlocked on the group's budget"
  assert kept == [[[1], [2]]] and asked  # the newest commit stays within 1 KB
  tier.clear()


def test_a_groups_directories_keep_their_newest_commits_within_its_budget(arena):
  """A pool tenant's directories are one group: its newest commits (not its highest step
  numbers) stay within its budget, whichever directory they are in, replicas counted; a
  directory of no group, or of another, is untouched."""
  budgets = {"alice": 3 * KB}
  tier = ram_tier.RamTier(0, uncommitted_s=3600.0, group_budget=budgets.get)
  other = "/ck/other"
  for directory, group in ((D, "alice"), ("/ck/alice2", "alice"), (other, "bob")):
    tier.set_group(directory, group)
    tier.configure(directory, 5, None)
  try:
    assert commit(tier, arena, 1) == [1]
    assert commit(tier, arena, 9, directory=other, blocks=4) == [9]  # bob: no budget
    add_replica(tier, arena, 2, source=1)
    assert commit(tier, arena, 2) == [1, 2]  # own shard and replica: 3 KB in all
    assert commit(tier, arena, 5, directory="/ck/alice2") == [5]  # step 1 goes for it
    assert sorted((s.directory, s.step) for s in tier.steps()) == [
        ("/ck/alice2", 5), (other, 9), (D, 2)]
    assert tier.group_use() == {"alice": (0, 3 * KB), "bob": (0, 4 * KB)}
    assert commit(tier, arena, 3, blocks=4) == [2]  # larger than the budget: never kept
    assert tier.find(item(3)) is None and item(3) in tier.holdings().commits
    assert used_blocks(arena) == 3 + 4
    add_step(tier, arena, 4, committed=False, done=False)  # a save in progress
    assert tier.group_use()["alice"] == (1, 3 * KB)
  finally:
    forget_all(tier)


def test_a_commit_told_of_a_step_not_written_here_leaves_it(tier, arena, caplog):
  """Only a written step becomes committed (``Step.commit``): one still being written (a
  save of the step again, staged since that commit) stays as it is, kept from eviction
  and expiry as before, its write going on."""
  own = add_step(tier, arena, 1, done=False)
  with caplog.at_level(logging.INFO, logger="sidecar._src.server.checkpoint.ram_tier"):
    assert tier.mark_committed(item(1)) == []
  assert "told it is committed while staged here; left as it is" in caplog.text
  assert own.state is step_lib.State.STAGED and tier.find(item(1)) is own
  own.end_write([])
  assert tier.mark_committed(item(1)) == [1] and own.committed


def test_a_replica_is_assembled_made_whole_and_replaces_the_one_held(tier, arena):
  """A replica's shards come whole or in pieces; it is whole once its sender says so, and
  one sent again takes the place of the whole one held, committed as that was."""
  old = ram_tier.Replica(D, 1, item(1), 2)
  old.add_shard(ShardId(("w",), ((0, 1),)), staged(arena))
  old.mark_whole()
  old.commit()
  new = ram_tier.Replica(D, 1, item(1), 2, replaces=old)
  key = ShardId(("w",), ((0, 1),))
  assert new.piece_block(key) is None  # no block yet: its caller makes one
  entry = new.piece_block(key, staged(arena))
  assert new.piece_block(key) is entry and new.partial == 1
  assert not new.piece_received(key, entry, KB // 2)
  assert new.piece_received(key, entry, KB // 2) and new.partial == 0
  new.add_shard(key, entry[0])
  assert (new.nbytes, new.whole, new.committed) == (KB, False, False)
  new.mark_whole()
  new.take_place_of(old)
  assert new.whole and new.committed and new.replaces is None and list(new.shards) == [key]
  with pytest.raises(TypeError):
    new.shards[key] = entry[0]  # a read-only view


# ---- the tier behind its methods: queries and commands, its lock its own ------------


def test_its_maps_and_its_lock_are_its_own(tier):
  """Nothing outside reads or writes what it holds, or takes its lock: only methods."""
  assert [n for n in vars(tier) if not n.startswith("_")] == ["host_id", "uncommitted_s"]
  assert not hasattr(tier, "lock")


def test_queries_find_steps_by_item_tmp_dir_and_state(tier, arena):
  uncommitted = add_step(tier, arena, 1)  # written, commit not yet in
  writing = add_step(tier, arena, 2, done=False)
  committed = add_step(tier, arena, 3, committed=True)
  pending = add_step(tier, arena, 4)
  pending.take_over(threading.Event())  # the sidecars commit it
  other = add_step(tier, arena, 5, directory="/ck/other", done=False)
  assert tier.find(item(1)) is uncommitted and tier.find(item(9)) is None
  assert tier.find_tmp(f"{item(2)}.tmp") is writing and tier.find_tmp(item(2)) is None
  assert tier.in_flight(D) == [writing, pending] and tier.in_flight() == [writing, pending,
                                                                          other]
  assert tier.writing() == [writing, other]
  assert tier.pending_commits(D) == [pending] and tier.pending_commits("/ck/other") == []
  assert [s for s in tier.steps() if s.committed] == [committed]
  add_replica(tier, arena, 3, source=2, committed=True)
  (replica,) = tier.replicas()
  assert tier.copies_of(item(3)) == [committed, replica] and tier.copies_of(item(8)) == []
  assert tier.replica_with(item(3), ShardId(("w",), ((0, 1),))) is replica
  assert tier.replica_with(item(3), ShardId(("w",), ((1, 2),))) is None


def test_a_slot_is_one_stage_at_a_time_and_lends_no_lock_of_the_tier_s(tier, arena):
  """A Stage's look at an item: one Stage at a time holds a slot, and a new step held
  there drops the one before it; the tier's own lock is not lent to the Stage's block, so
  the tier answers meanwhile, the block's own questions to it included (under the tier's
  lock, a Stage's block that asked the tier deadlocked: the lock is not reentrant)."""
  old = add_step(tier, arena, 1)  # its write ended: a save of the step again replaces it
  answers: list = []

  def stage():
    with tier.slot(item(1)) as slot:
      answers.append((slot.step, tier.find(item(1)), tier.holdings(timeout=0) is not None))
      new = make_step(D, 1, item(1), {}, written=False, staged=False)
      slot.hold(new)
      answers.append(slot.step)

  asking = threading.Thread(target=stage, daemon=True)
  asking.start()
  asking.join(10)
  assert not asking.is_alive(), "a Stage's block that asked the tier deadlocked"
  new = answers[1]
  assert answers[0] == (old, old, True) and new is not old
  assert tier.find(item(1)) is new and old.state is step_lib.State.DROPPED
  def second():
    with tier.slot(item(3)):
      pass

  with tier.slot(item(2)) as slot:
    assert slot.step is None
    other = threading.Thread(target=second, daemon=True)
    other.start()
    other.join(0.2)
    assert other.is_alive()  # the second Stage waits for this one's slot
  other.join(10)
  assert not other.is_alive()


def test_replicas_are_received_replaced_and_discarded_by_its_commands(tier, arena):
  key = ShardId(("w",), ((0, 1),))
  first = tier.open_replica(D, 1, item(1), 2)  # received: held at once, not whole
  assert tier.replicas() == [first]
  tier.discard_partial(first)  # its stream broke
  assert tier.replicas() == []
  first = tier.open_replica(D, 1, item(1), 2)
  tier.add_replica_shard(first, key, staged(arena))
  assert tier.replica_whole(first) and tier.replicas() == [first] and first.whole
  tier.mark_committed(item(1))
  again = tier.open_replica(D, 1, item(1), 2)  # sent again: replaces the whole one once whole
  assert again.replaces is first and tier.replicas() == [first]
  tier.discard_partial(again)  # not held: the whole one stays
  assert tier.replicas() == [first]
  entry = tier.replica_piece(again, key, lambda: staged(arena))
  assert tier.replica_piece_received(again, key, entry, KB)
  tier.add_replica_shard(again, key, entry[0])
  assert tier.replica_whole(again) and tier.replicas() == [again] and again.committed
  tier.discard_partial(again)  # whole: it stays
  assert tier.replicas() == [again]
  tier.drop([(D, 1)])  # its step is forgotten: a replica of it arriving late is dropped then
  late = tier.open_replica(D, 1, item(1), 3)
  tier.add_replica_shard(late, key, staged(arena))
  assert tier.replica_whole(late) and tier.replicas() == [] and late.committed
  assert tier.holdings().commits == (item(1),)


def test_a_directory_s_ram_steps_and_group_are_configured_by_command(arena):
  tier = ram_tier.RamTier(0, uncommitted_s=3600.0, group_budget={"alice": 10 * KB}.get)
  # one step, no budget, until configured
  assert [commit(tier, arena, s, directory="/ck/b") for s in (1, 2)] == [[1], [2]]
  assert tier.drop([("/ck/b", 2)])
  tier.configure(D, 2, 4 * KB)
  tier.set_group(D, "alice")
  assert [commit(tier, arena, s) for s in (1, 2, 3)] == [[1], [1, 2], [2, 3]]
  assert tier.group_use() == {"alice": (0, 2 * KB)}
  tier.configure(D, 0, None)  # reopened with ram_steps=0: its copies go at once
  assert tier.evict(D) == [] and tier.steps() == [] and used_blocks(arena) == 0


def test_it_answers_what_it_holds_drops_and_releases_a_client_s_directories(tier, arena):
  tier.configure(D, 5, None)
  for step in (1, 2):
    commit(tier, arena, step)
  add_step(tier, arena, 3)  # not committed: never released
  commit(tier, arena, 4, directory="/ck/other")
  held = tier.holdings()
  assert held is not None
  assert (sorted(s.step for s in held.steps), held.commits, held.group_of(D)) == (
      [1, 2, 3, 4], (item(1), item(2), "/ck/other/4/default"), None)
  assert tier.drop([(D, 1), (D, 3)])  # step 3 is not committed: it stays
  assert sorted(s.step for s in tier.steps()) == [2, 3, 4]
  with tier._lock:  # the tier busy (another thread's command): nothing goes
    assert not tier.drop([(D, 2)], timeout=0) and tier.holdings(timeout=0) is None
  assert tier.release({D}) == 1  # step 2; step 3 is not committed
  assert sorted(s.step for s in tier.steps()) == [3, 4]


def test_a_manifest_is_kept_with_the_step_and_its_replicas(tier, arena):
  own = add_step(tier, arena, 1, committed=True)
  add_replica(tier, arena, 1, source=2, committed=True)
  manifest = object()  # kept as it is, never read here
  tier.keep_manifest(item(1), manifest)
  assert [c.manifest for c in tier.copies_of(item(1))] == [manifest, manifest]
  assert own.manifest is manifest
