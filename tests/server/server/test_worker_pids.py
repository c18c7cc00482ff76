"""Tier 2: a worker's pid is the kernel's (issue 69, item 2). A raw client attaches to the
worker socket claiming pids no process has, or another process's; Status lists only what
the kernel said, marks it verified, and one record that cannot be encoded never fails
Status for every client."""

import logging
import os
import socket

import pytest

from sidecar._src.controller import status as status_lib
from sidecar._src.wire import ipc, protocol

pytestmark = pytest.mark.server


def attach(server, **claims):
  """A raw attach (none of the Worker's checks) with ``claims`` in its message: its reply
  and the socket (open: the session lives while it does)."""
  sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  sock.settimeout(10)
  sock.connect(server.options.socket_path)
  ipc.send(sock, {"op": "attach", "versions": protocol.versions_dict(protocol.local_versions()),
                  **claims})
  reply, fds = ipc.recv(sock, max_fds=1)
  for fd in fds:
    os.close(fd)
  return reply, sock


def trainers(server):
  return list(status_lib.fetch(server.address, timeout=10).trainers)


@pytest.mark.parametrize("pid", [
    -os.getpgid(0), -1, 0, 1 << 22, 2**63, 2**64, "1", True, 1.5, [1],
], ids=["-pgid", "-1", "0", "past-pid-max", "2**63", "2**64", "str", "bool", "float", "list"])
def test_an_impossible_pid_is_refused_at_attach_naming_it(make_server, pid):
  server = make_server()
  reply, sock = attach(server, pid=pid)
  with sock:
    assert reply["error"]["type"] == "InvalidArgumentError", reply
    message = reply["error"]["message"]
    assert f"attach: pid {pid!r} is no process's" in message
    assert "the sidecar reads a worker's pid from the kernel" in message
    assert server.workers.num_sessions() == 0
  # Nothing of it is listed, and Status answers every client.
  assert trainers(server) == []


def test_a_claimed_pid_of_another_process_is_ignored_for_the_kernels(make_server):
  server = make_server()
  reply, sock = attach(server, pid=1, rank=0, restart=0)  # init's: another user's process
  with sock:
    assert "session" in reply, reply
    [t] = trainers(server)
    assert (t.pid, t.pid_verified, t.rank) == (os.getpid(), True, 0)
    assert list(server.workers.pids().values()) == [os.getpid()]


def test_a_worker_that_claims_no_pid_is_listed_with_the_kernels(make_server):
  server = make_server()
  reply, sock = attach(server)
  with sock:
    assert "session" in reply, reply
    [t] = trainers(server)
    assert (t.pid, t.pid_verified) == (os.getpid(), True)


def test_a_record_that_cannot_be_encoded_never_fails_status(make_server, caplog):
  server = make_server()
  reply, sock = attach(server, pid=os.getpid(), rank=3)
  with sock:
    assert "session" in reply, reply
    # A record no attach makes any more (refused above), as an older sidecar kept it.
    server.workers.steps.attach("w-broken", pid=0, rank=2**40)
    with caplog.at_level(logging.ERROR, logger="sidecar._src.server.service"):
      listed = trainers(server)
    assert [(t.pid, t.rank) for t in listed] == [(os.getpid(), 3)]
    assert "Status: trainer record" in caplog.text and f"rank={2**40}" in caplog.text
    assert "cannot be encoded" in caplog.text
