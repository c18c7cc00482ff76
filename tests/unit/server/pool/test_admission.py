"""The arena's admission queue: a tenant's request that does not fit waits its turn.

Real Leases over a real allocator and a real pool file in tmp_path; requests wait in
threads of the test, each joined.
"""

import os
import threading
import time

import pytest

from sidecar._src.arena import shm
from sidecar._src.core import errors
from sidecar._src.server.arenas.leases import Leases
from sidecar._src.server.pool import admission, pool_file
from sidecar._src.server.tenancy import tenants as tenants_lib

pytestmark = pytest.mark.unit

MiB = 1 << 20
ARENA = 16 * MiB


def _leases(tmp_path, text: str) -> Leases:
  for name in ("alice", "bob"):
    (tmp_path / f"{name}.token").write_text(f"token-of-{name}\n")
    os.chmod(tmp_path / f"{name}.token", 0o600)
  path = tmp_path / "pool.yaml"
  path.write_text(text)
  os.chmod(path, 0o600)
  tenancy = tenants_lib.Tenancy(pool_file.load(str(path)))
  workers = {"w-a": "alice", "w-a2": "alice", "w-b": "bob"}
  return Leases(shm.Allocator(ARENA), tenancy=tenancy, tenant_of=workers.get)


class Request:
  """One alloc in a thread of its own; ``join()`` waits for it."""

  def __init__(self, leases: Leases, nbytes: int, holder: str, order: list, **kwargs):
    self.block: shm.Block | None = None
    self.error: BaseException | None = None

    def run() -> None:
      try:
        self.block = leases.alloc(nbytes, holder, **kwargs)
        order.append(self)
      except BaseException as e:  # the test reads it
        self.error = e

    self.thread = threading.Thread(target=run)
    self.thread.start()

  def join(self) -> None:
    self.thread.join(10)
    assert not self.thread.is_alive()


def _until(predicate, timeout: float = 5.0) -> None:
  deadline = time.monotonic() + timeout
  while not predicate():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.01)


def test_a_tenants_later_request_never_overtakes_its_earlier_one(tmp_path):
  leases = _leases(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, "
                   "arena_ceiling: 4MiB}\n  - {name: bob, token_file: bob.token}\n")
  held = leases.alloc(3 * MiB, "w-a", timeout=0)
  order: list[Request] = []
  big = Request(leases, 2 * MiB, "w-a", order, timeout=10)  # past its ceiling: waits
  _until(lambda: leases.waiting() == {"alice": 1})
  small = Request(leases, MiB, "w-a2", order, timeout=10)  # would fit, but comes later
  _until(lambda: leases.waiting() == {"alice": 2})
  time.sleep(0.2)
  assert order == []
  leases.release(held.offset, held.generation, "w-a")
  big.join()
  small.join()
  assert order == [big, small] and leases.tenant_bytes() == {"alice": 3 * MiB}
  assert leases.waiting() == {}
  leases.release_all("w-a")
  leases.release_all("w-a2")
  assert leases.allocator.used_bytes == 0


def test_a_small_request_within_its_guarantee_passes_a_big_one(tmp_path):
  leases = _leases(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, "
                   "arena: 0.25}\n  - {name: bob, token_file: bob.token}\n")
  first = leases.alloc(12 * MiB, "w-b", timeout=0)  # all bob may take: alice's 4 MiB stay
  order: list[Request] = []
  places: list[admission.Place] = []
  big = Request(leases, 2 * MiB, "w-b", order, timeout=10, on_wait=places.append)
  _until(lambda: leases.waiting() == {"bob": 1} and places)
  assert (places[0].tenant, places[0].position, places[0].waiting) == ("bob", 1, 1)
  leases.alloc(MiB, "w-a", timeout=0)  # alice's own share: at once, not behind bob
  # A second request of bob's waits behind his first, and its timeout says where it stood.
  with pytest.raises(errors.ResourceExhaustedError,
                     match=r"tenant 'bob' holds 12.0 MiB .* guaranteed arena of other tenants "
                     r".*its own quota: arena=0 B, .*pool.yaml:3\).* \(it waited "
                     r"(0\.[2-9]\d*|[1-9][\d.]*) s, at "  # its timeout at least, late or not
                     r"position 2 of 2 in the arena queue"):
    leases.alloc(MiB, "w-b", timeout=0.2)
  leases.release(first.offset, first.generation, "w-b")
  big.join()
  assert order == [big] and big.error is None
  assert leases.tenant_bytes() == {"alice": MiB, "bob": 2 * MiB}
  leases.release_all("w-a")
  leases.release_all("w-b")
  assert leases.allocator.used_bytes == 0


def test_a_waiter_whose_client_does_not_read_holds_no_other_tenant_up(tmp_path):
  """Issue 70, item 4: bob's queued request, told its place on a socket he never reads,
  kept alice from borrowing beyond her guarantee with the arena empty ("at position 2
  of 2"). Now a waiter stands aside while its client is told, and takes its turn after."""
  leases = _leases(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, "
                   "arena: 0.25}\n  - {name: bob, token_file: bob.token}\n")
  first = leases.alloc(12 * MiB, "w-b", timeout=0)  # all bob may take: alice's 4 MiB stay
  telling, read = threading.Event(), threading.Event()

  def never_read(place: admission.Place) -> None:  # his socket is full: the send blocks
    telling.set()
    read.wait(30)
  order: list[Request] = []
  stuck = Request(leases, 2 * MiB, "w-b", order, timeout=30, on_wait=never_read)
  _until(telling.is_set)
  leases.release(first.offset, first.generation, "w-b")  # the arena is empty now
  borrowed = leases.alloc(6 * MiB, "w-a", timeout=2)  # beyond her 4 MiB guarantee
  assert leases.tenant_bytes() == {"alice": 6 * MiB}
  read.set()  # bob reads again: his request takes its turn
  stuck.join()
  assert stuck.error is None and leases.tenant_bytes() == {"alice": 6 * MiB, "bob": 2 * MiB}
  leases.release(borrowed.offset, borrowed.generation, "w-a")
  leases.release_all("w-b")
  assert leases.allocator.used_bytes == 0


def test_timeout_zero_fails_at_once_naming_tenant_place_and_quota(tmp_path):
  leases = _leases(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, "
                   "arena_ceiling: 4MiB}\n  - {name: bob, token_file: bob.token}\n")
  leases.alloc(4 * MiB, "w-a", timeout=0)
  t0 = time.monotonic()
  with pytest.raises(errors.ResourceExhaustedError,
                     match=r"tenant 'alice' .* \(arena_ceiling=4.0 MiB = 4.0 MiB, .*pool.yaml:2\)"
                     r".*it waited 0 s, at position 1 of 1 in the arena queue, no estimate "
                     r"yet; pass a longer timeout="):
    leases.alloc(MiB, "w-a", timeout=0)
  assert time.monotonic() - t0 < 5 and leases.waiting() == {}  # no wait (the text: 0 s)
  leases.release_all("w-a")


def test_a_waiter_whose_caller_is_gone_leaves_the_queue(tmp_path):
  leases = _leases(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, "
                   "arena_ceiling: 4MiB}\n  - {name: bob, token_file: bob.token}\n")
  leases.alloc(4 * MiB, "w-a", timeout=0)
  gone = threading.Event()
  order: list[Request] = []
  waiter = Request(leases, MiB, "w-a", order, timeout=None, alive=lambda: not gone.is_set())
  _until(lambda: leases.waiting() == {"alice": 1})
  gone.set()
  waiter.join()
  assert isinstance(waiter.error, errors.ClosedError)
  assert "tenant 'alice'" in str(waiter.error) and leases.waiting() == {}
  assert leases.tenant_bytes() == {"alice": 4 * MiB}
  leases.release_all("w-a")


def test_the_estimate_comes_from_the_rate_blocks_are_freed():
  queue = admission.Queue()
  w = queue.join("alice", 4 * MiB)
  assert queue.place(w, 4 * MiB).eta_s is None  # nothing freed yet: no estimate
  queue.freed(8 * MiB)  # 8 MiB over the last second at least
  place = queue.place(w, 4 * MiB)
  assert place.position == 1 and place.eta_s is not None and 0 < place.eta_s <= 0.5
  later = queue.join("bob", MiB)
  assert queue.place(later, MiB).ahead_bytes == 4 * MiB
  queue.leave(w)
  queue.leave(later)
  assert len(queue) == 0


def test_a_request_the_others_guarantees_never_leave_room_for_fails_at_once(tmp_path):
  leases = _leases(tmp_path, "tenants:\n  - {name: alice, token_file: alice.token, "
                   "arena: 0.25}\n  - {name: bob, token_file: bob.token}\n")
  with pytest.raises(errors.ResourceExhaustedError,
                     match=r"tenant 'bob': a block of 13.0 MiB \(13631488 bytes\) can never fit: "
                     r"the other tenants' guaranteed arena leaves it 12.0 MiB of 16.0 MiB "
                     r"\(.*pool.yaml:3\)"):
    leases.alloc(13 * MiB, "w-b", timeout=None)  # no timeout: it would have waited for ever
  assert leases.waiting() == {} and leases.allocator.used_bytes == 0
