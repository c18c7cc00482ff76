"""Silent worker-socket connections by Unix user (server/workers/silent.py): where every
place is taken, the user holding the most silent ones gives its oldest."""

import socket

import pytest

from sidecar._src.server.workers import silent as silent_lib
from sidecar._src.wire import ipc

pytestmark = pytest.mark.unit
BOB, ALICE = ipc.Ucred(pid=1, uid=10002, gid=10002), ipc.Ucred(pid=2, uid=10001, gid=10001)


@pytest.fixture
def conns():
  made = []

  def make() -> socket.socket:
    a, b = socket.socketpair()
    made.extend((a, b))
    return a
  yield make
  for s in made:
    s.close()


def test_a_full_socket_takes_room_from_the_user_with_the_most_silent_ones(conns):
  silent = silent_lib.Silent(4)
  bobs = [conns() for _ in range(4)]
  for c in bobs:
    assert silent.arrive(c, BOB, full=False) == ([], False)
  alices = conns()
  assert silent.arrive(alices, ALICE, full=True) == ([bobs[0]], False)
  silent.spoke(alices, ALICE)  # attached: no longer silent, and holds its place
  # Every silent one now bob's: his own next one takes the place of his oldest.
  mine = conns()
  assert silent.arrive(mine, BOB, full=True) == ([bobs[1]], False)


def test_a_full_socket_of_attached_workers_refuses(conns):
  silent = silent_lib.Silent(2)
  assert silent.arrive(conns(), ALICE, full=True) == ([], True)  # nobody silent to give way
