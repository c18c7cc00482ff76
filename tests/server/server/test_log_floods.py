"""Tier 2: what a client's frames cost the sidecar's log (issue 76, attack round eight,
item 11), sent by hand on the worker socket, as a hostile worker would."""

import json
import logging
import socket
import struct

import pytest

from sidecar._src.server import client_log
from sidecar._src.wire import ipc, protocol
from tests.conftest import eventually

pytestmark = pytest.mark.server


def attach(server) -> socket.socket:
  sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  sock.settimeout(30)
  sock.connect(server.options.socket_path)
  ipc.send(sock, {"op": "attach", "versions": protocol.versions_dict(protocol.local_versions())})
  reply, fds = ipc.recv(sock, max_fds=1)
  for fd in fds:
    socket.close(fd)
  assert "session" in reply, reply
  return sock


def still_answers(sock: socket.socket) -> bool:
  ipc.send(sock, {"op": "ping"})
  reply, _ = ipc.recv(sock)
  return reply == {"ok": True}


def logged(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records if r.name.startswith("sidecar")]


def test_one_free_frame_of_stale_blocks_is_one_line(make_server, caplog):
  """Before: a line per pair, 35 MB of log for a 1 MB frame, 8 s of the sidecar's CPU."""
  server = make_server()
  sock = attach(server)
  pairs = ",".join(["[0,1]"] * 170_000)
  body = ('{"op": "free", "blocks": [' + pairs + "]}").encode()
  assert len(body) < ipc.MAX_MESSAGE
  with caplog.at_level(logging.INFO, logger="sidecar"):
    sock.sendall(struct.pack("<I", len(body)) + body)
    assert still_answers(sock)
  [line] = [m for m in logged(caplog) if "freed" in m]
  assert "170000 of the 170000 arena blocks it freed are not held by it" in line
  assert sum(len(m) for m in logged(caplog)) < 4096
  sock.close()


def test_bad_phase_frames_are_a_few_lines_and_one_summary(make_server, caplog):
  """Before: a line per frame, unthrottled."""
  server = make_server()
  sock = attach(server)
  frame = json.dumps({"op": "phase", "name": "eval", "budget_s": 1e12}).encode()
  with caplog.at_level(logging.INFO, logger="sidecar"):
    sock.sendall((struct.pack("<I", len(frame)) + frame) * 2000)
    assert still_answers(sock)
    sock.close()  # its session's end writes what it owes
    assert eventually(lambda: any("log lines dropped" in m for m in logged(caplog)))
  lines = logged(caplog)
  refused = [m for m in lines if "a phase frame refused" in m]
  assert len(refused) <= client_log.BURST + 2, len(refused)
  [summary] = [m for m in lines if "log lines dropped" in m]
  assert summary.startswith("worker session w-")
  assert int(summary.split(": ", 1)[1].split()[0]) >= 2000 - client_log.BURST
