"""Feed workers and the storage's writes shared among tenants with work, by weight
(server/pool/shares.py)."""

import contextlib
import threading
import time

import numpy as np
import pytest

from sidecar._src.server.pool import shares as shares_lib

pytestmark = pytest.mark.unit


def test_a_tenant_alone_has_every_worker_and_shares_shrink_by_weight_while_others_feed():
  shares = shares_lib.Shares(8)
  with shares.turns("hog"):
    assert shares.share("hog") == 8
    with shares.turns("alice", 3.0), shares.turns("bob"):
      assert [shares.share(t) for t in ("hog", "alice", "bob")] == [1, 4, 1]
      with shares.turns("alice", 3.0):  # a second feed of alice: no more weight
        assert shares.share("alice") == 4
    assert shares.share("hog") == 8  # the others' feeds ended: all of them again
  assert shares.share("nobody") == 8


def test_a_tenant_at_its_share_waits_for_its_own_batches_and_never_blocks_another():
  shares = shares_lib.Shares(2)
  with shares.turns("hog") as hog, shares.turns("alice") as alice:
    hog.take()  # its share: 1 of 2
    assert not hog.free() and alice.free()
    took = threading.Event()

    def second():
      hog.take()
      took.set()

    waiter = threading.Thread(target=second)
    waiter.start()
    alice.take()  # alice's turn comes at once, whatever the hog waits for
    time.sleep(0.2)
    assert not took.is_set() and shares.busy("hog") == 1
    hog.give()  # one of the hog's own batches came back: its turn
    assert took.wait(5)
    waiter.join(5)
    assert shares.busy("hog") == 1 and shares.busy("alice") == 1
    hog.give()
    alice.give()
  assert shares.busy("hog") == 0


def test_a_share_that_grows_wakes_a_waiting_tenant():
  shares = shares_lib.Shares(2)
  with shares.turns("hog") as hog:
    took = threading.Event()
    with shares.turns("alice"):
      hog.take()
      waiter = threading.Thread(target=lambda: (hog.take(), took.set()))
      waiter.start()
      time.sleep(0.2)
      assert not took.is_set()
    assert took.wait(5)  # alice's feed ended: the hog may use both
    waiter.join(5)
    hog.give(2)


def test_total_below_one_is_refused():
  with pytest.raises(ValueError, match="total must be at least 1, got 0"):
    shares_lib.Shares(0)


class _Workers:
  """A feed_processes.FeedProcesses without processes: fills a batch in ``wait`` with its position,
  and keeps the most batches of its tenant ever in flight at once."""

  def __init__(self, size: int, turns: shares_lib.Turns):
    self.size, self._turns = size, turns
    self.most = 0
    self._out: dict[int, tuple[int, list]] = {}

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self._turns.give(len(self._out))

  def free(self) -> bool:
    return self._turns.free()

  def submit(self, step, out):
    self._turns.take()
    self._out[step[1]] = (step[1], out)  # one epoch: its position names the batch
    self.most = max(self.most, len(self._out))
    return step[1]

  def wait(self, ticket) -> float:
    position, out = self._out.pop(ticket)
    out[0][0][:] = position
    self._turns.give()
    return 0.0


@pytest.mark.parametrize("others", [0, 1, 3], ids=["alone", "one-other", "three-others"])
def test_a_feed_past_its_share_collects_its_own_batches_in_order(others):
  from sidecar._src.server.feeds import producer
  shares = shares_lib.Shares(4)
  spec = producer.Spec(global_batch_size=2, ranges=((0, 2),), seed=0, num_epochs=1,
                       shard_index=0, shard_count=1, start={}, workers=4)
  rows = [{"x": np.float32(i)} for i in range(40)]
  with shares.turns("hog") as turns, contextlib.ExitStack() as stack:
    for i in range(others):
      stack.enter_context(shares.turns(f"other{i}"))
    workers = _Workers(4, turns)
    batches = list(producer._from_map_workers(rows, "rows", spec, lambda s, d: np.zeros(s, d),
                                           lambda: workers))
  assert [b.leaves[0][0][0] for b, _, _ in batches] == [2 * i for i in range(20)]
  assert workers.most == {0: 4, 1: 2, 3: 1}[others]  # 4 CPUs: all, a half, a quarter
  assert shares.busy("hog") == 0


def queued(bandwidth, n: int) -> None:
  """Waits until ``n`` tenants wait for a turn (a thread started is not one queued yet)."""
  deadline = time.monotonic() + 30
  while len(bandwidth._waiting) < n:
    assert time.monotonic() < deadline, bandwidth._waiting
    time.sleep(0.001)


class Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def test_the_storage_goes_to_the_tenant_that_wrote_least_lately_for_its_weight():
  clock = Clock()
  bandwidth = shares_lib.Bandwidth(1, half_life_s=1.0, anticipate_s=0.0, clock=clock)
  with bandwidth.turn("hog", 8 << 20):
    pass
  with bandwidth.turn("light", 1 << 20, weight=2.0):
    pass
  assert bandwidth.lately("hog") == 8 << 20 and bandwidth.lately("light") == 1 << 19
  clock.now = 2.0  # two half-lives on: a quarter counts
  assert bandwidth.lately("hog") == 2 << 20
  order = []
  holder = bandwidth.turn("hog", 1)
  holder.__enter__()  # the one turn is taken: the others wait

  def ask(tenant, n):
    with bandwidth.turn(tenant, n):
      order.append(tenant)

  waiters = []
  for tenant, n in (("hog", 1 << 20), ("hog", 1 << 20), ("light", 1 << 20), ("new", 64 << 20)):
    waiters.append(threading.Thread(target=ask, args=(tenant, n)))
    waiters[-1].start()
    queued(bandwidth, len(waiters))  # in this order (0.1 s of sleep raced the last one)
  assert order == []
  holder.__exit__(None, None, None)
  for w in waiters:
    w.join(5)
  # Least lately first: new (nothing), light (1/8 MiB faded), then the hog's two in turn.
  assert order == ["new", "light", "hog", "hog"]


def test_a_light_tenants_next_piece_finds_its_turn_kept():
  """A light tenant writing a file piece after piece keeps its turn between pieces: a heavy
  tenant waiting meanwhile goes once the light one's file is done (or the kept turn
  lapses), not between its pieces."""
  clock = Clock()  # the kept turn lapses when the test says, not when the machine is slow
  bandwidth = shares_lib.Bandwidth(1, anticipate_s=0.5, clock=clock)
  with bandwidth.turn("hog", 64 << 20):
    pass
  order = []
  first = bandwidth.turn("light", 1 << 20)
  first.__enter__()
  hog = threading.Thread(target=lambda: bandwidth.turn("hog", 1).__enter__() or
                         order.append("hog"))
  hog.start()
  queued(bandwidth, 1)  # the hog waits for the light tenant's turn
  first.__exit__(None, None, None)
  clock.now += 0.25  # the light tenant asks again, within anticipate_s
  with bandwidth.turn("light", 1 << 20):
    order.append("light")
  clock.now += 1.0  # its file done: the turn kept for it lapses, the hog goes
  hog.join(5)
  assert order == ["light", "hog"]


def test_at_most_total_turns_at_once():
  bandwidth = shares_lib.Bandwidth(2)
  lock, now, most = threading.Lock(), [0], [0]

  def write(tenant):
    for _ in range(20):
      with bandwidth.turn(tenant, 1 << 20):
        with lock:
          now[0] += 1
          most[0] = max(most[0], now[0])
        time.sleep(0.001)
        with lock:
          now[0] -= 1

  threads = [threading.Thread(target=write, args=(t,)) for t in ("a", "a", "b", "c", "c")]
  for t in threads:
    t.start()
  for t in threads:
    t.join(10)
  assert most[0] == 2
  with pytest.raises(ValueError, match="total must be at least 1, got 0"):
    shares_lib.Bandwidth(0)
