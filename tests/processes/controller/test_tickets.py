"""Issue 54, item 3: a Controller in another network namespace than its sidecar's.

The sidecar tells each Unix-socket client process its pid ticket on an abstract socket,
which exists only in the sidecar's network namespace: a trainer in another one (a
container sharing the socket's directory, not the network) got none, and its sessions
were held with every ticketless client of its tenant, so a flood of theirs evicted them.
Its Controller now asks for a ticket in the handshake itself. The trainer here is a
subprocess under ``unshare --net``; the flood is 1,100 ticketless handshakes of its own
tenant and 1,100 of another's, over the same socket.
"""

import os
import subprocess
import sys

import grpc
import pytest

from sidecar._src.wire import protocol
from sidecar._src.wire.protocol import pb
from tests.support.paths import ROOT
from tests.support.pool_files import ALICE, BOB, ROOMY_POOL, write_pool

pytestmark = pytest.mark.processes

_TRAINER = r'''
import sys
import sidecar.jax
from sidecar._src.wire import protocol

address, token = sys.argv[1], sys.argv[2]
with sidecar.jax.Controller([address], token=token, timeout=60, attach=False) as ctl:
  conn = ctl._sidecars.conns[0]
  print("session", dict(conn.metadata)[protocol.SESSION_KEY], flush=True)
  sys.stdin.readline()  # the flood's turn
  print("add", ctl.call("add", args=(2,), kwargs={"b": 3})[0], flush=True)
  print("session", dict(conn.metadata)[protocol.SESSION_KEY], flush=True)
'''


def _other_network_namespace() -> list[str]:
  """The command prefix that runs a process in a network namespace of its own (a user
  namespace too where this is not root); skips where neither is allowed."""
  for prefix in (["unshare", "--net"], ["unshare", "--user", "--map-root-user", "--net"]):
    try:
      if subprocess.run([*prefix, "true"], capture_output=True, timeout=30).returncode == 0:
        return prefix
    except (OSError, subprocess.TimeoutExpired):
      continue
  pytest.skip("no network namespace can be made here (unshare --net, as root or in a user "
              "namespace); tests/server/server/test_limits.py covers the same with the "
              "abstract socket closed")


def test_a_controller_in_another_network_namespace_holds_its_session_by_a_fetched_ticket(
    make_server, tmp_path):
  prefix = _other_network_namespace()
  path = tmp_path / "g.sock"
  server = make_server(pool=write_pool(tmp_path, ROOMY_POOL), listen=f"unix:{path}",
                       max_sessions=160, max_sessions_per_client=16)
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  trainer = subprocess.Popen([*prefix, sys.executable, "-c", _TRAINER, f"unix:{path}", ALICE],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
  channel = grpc.insecure_channel(f"unix:{path}")
  try:
    first = trainer.stdout.readline().split()
    assert first[:1] == ["session"], trainer.stderr.read()
    session = first[1]
    # It reached no abstract socket: it holds a ticket told in its handshake.
    assert server.fetched.count_of() == {"alice": 1}
    handshake = channel.unary_unary(
        f"/{protocol.SERVICE}/Handshake", request_serializer=pb.HandshakeRequest.SerializeToString,
        response_deserializer=pb.HandshakeResponse.FromString)
    for token in (ALICE, BOB):
      for _ in range(1100):
        handshake(pb.HandshakeRequest(versions=protocol.local_versions(), client="flood"),
                  metadata=((protocol.AUTH_KEY, f"Bearer {token}"),), timeout=10)
    assert server.sessions.touch(session)
    out, err = trainer.communicate("go\n", timeout=120)
    assert trainer.returncode == 0, err
    assert out.split("\n")[:2] == ["add 5", f"session {session}"], (out, err)  # no renew
    assert "told this process no ticket" not in err
  finally:
    channel.close()
    if trainer.poll() is None:
      trainer.kill()
      trainer.wait(10)
