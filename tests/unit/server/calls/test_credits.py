"""Credits: the count both ways in share, and the worker socket's reader. Tier 1: no server.

``Credits`` (gRPC) is tested in test_limits.py; here the core and ``SocketCredits``
over a real Unix socket pair.
"""

import socket

import pytest

from sidecar._src.server.calls.credits import Bank, Credits, SocketCredits
from sidecar._src.wire import ipc
from sidecar._src.wire.protocol import pb

pytestmark = pytest.mark.unit


def test_the_bank_caps_grants_at_the_prefetch_and_sums_the_waits():
  bank = Bank(2)
  assert bank.spend() and bank.spend() and not bank.spend()
  bank.grant(1 << 40, wait_s=0.25)
  bank.grant(1, wait_s=0.5)
  assert bank.available == 2 and bank.consumer_wait_s == 0.75


@pytest.fixture
def pair():
  ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
  yield ours, theirs
  ours.close()
  theirs.close()


def _send(sock, **fields):
  ipc.send_bytes(sock, pb.StreamRequest(**fields).SerializeToString())


def test_socket_credits_are_counted_as_gprcs_are_and_carry_the_frees(pair):
  ours, theirs = pair
  freed = []
  credits = SocketCredits(ours, 2, freed.extend)
  assert credits.take() and credits.take()  # the prefetch, with nothing read
  _send(theirs, credit=5, wait_s=0.5, freed=[4096, 7])  # past the prefetch: capped at 2
  assert credits.take() and credits.take()
  assert credits.taken == 5 and credits.consumer_wait_s == 0.5 and freed == [4096, 7]
  _send(theirs, credit=1, close=True)
  assert not credits.take() and credits.closed and credits.taken == 6


def test_a_frame_with_only_frees_grants_nothing(pair):
  ours, theirs = pair
  freed = []
  credits = SocketCredits(ours, 1, freed.extend)
  assert credits.take()
  _send(theirs, freed=[0, 1])  # no credit: take must wait for the next frame
  _send(theirs, credit=1)
  assert credits.take() and freed == [0, 1] and credits.taken == 1


def test_socket_credits_end_when_the_consumer_hangs_up(pair):
  ours, theirs = pair
  credits = SocketCredits(ours, 1, lambda freed: None)
  assert credits.take()
  theirs.close()
  assert not credits.take()
  credits.drain()  # nothing to read, no error


def test_both_sources_report_the_consumers_wait():
  grpc_side = Credits(1)
  grpc_side.grant(1, wait_s=0.125)
  assert grpc_side.consumer_wait_s == 0.125
