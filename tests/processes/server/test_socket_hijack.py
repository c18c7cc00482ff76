"""Issue 42, attack 6: another Unix user takes the name of a sidecar's ``unix:`` socket.

The attacker pre-makes a world-writable directory in /tmp where the socket will be, and
listens at the socket's name (after renaming the sidecar's away, or before it starts).
On main the sidecar started there without a word and a Controller sent the impostor its
token in plain text. Now the sidecar refuses the directory, and a client refuses to send
anything to a socket a user it does not trust serves, naming that user.
"""

import os
import pwd
import secrets
import select
import shutil
import subprocess
import sys
import time

import pytest

import sidecar
from sidecar._src.controller import status as status_lib
from sidecar._src.core import errors
from sidecar._src.wire import ipc
from tests.conftest import eventually

pytestmark = pytest.mark.processes

try:
  NOBODY = pwd.getpwnam("nobody").pw_uid
except KeyError:
  NOBODY = 65534
TOKEN = "hijack-test-token-" + "7" * 24

# The impostor: it becomes the other user (all its imports done first: the interpreter's
# files may be root's alone), makes its world-writable directory as the attack does, then
# (a line on its stdin) listens at the name and prints what each connection sent it.
_IMPOSTOR = r"""
import os, socket, sys
directory, uid = sys.argv[1], int(sys.argv[2])
os.setgroups([]); os.setgid(uid); os.setuid(uid)
os.mkdir(directory); os.chmod(directory, 0o777)
print("made", flush=True)
sys.stdin.readline()  # the sidecar's turn to start there first
s = socket.socket(socket.AF_UNIX)
s.bind(os.path.join(directory, "g.sock")); s.listen(8)
print("listening", flush=True)
while True:
  c, _ = s.accept()
  c.settimeout(3)
  got = b""
  try:
    while chunk := c.recv(65536):
      got += chunk
  except OSError:
    pass
  c.close()
  print("received", len(got), got.hex(), flush=True)
"""


@pytest.fixture
def impostor():
  """A process of another user (nobody) listening at ``DIR/g.sock`` in its own world-
  writable directory in /tmp; yields ``(process, DIR)``; its output is read after."""
  if os.geteuid() != 0:
    pytest.skip(f"a second Unix user needs root here (setuid, to run the impostor as uid "
                f"{NOBODY}); this runs as uid {os.geteuid()}; the checks themselves are in "
                "tests/unit/wire/test_ipc.py and tests/unit/server/test_sockets.py")
  directory = f"/tmp/sidecar-hijack-{secrets.token_hex(6)}"  # where the job's socket will be
  p = subprocess.Popen([sys.executable, "-c", _IMPOSTOR, directory, str(NOBODY)],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
  try:
    assert p.stdout.readline().strip() == "made", p.stderr.read()
    yield p, directory
  finally:
    p.kill()
    p.wait(10)
    shutil.rmtree(directory, ignore_errors=True)


def _received(p: subprocess.Popen, count: int) -> list[tuple[int, bytes]]:
  """What the impostor got on each of its first ``count`` connections (it reports one
  when the client closes it, or 3 s after its last byte): read as it reports, then ended."""
  out, deadline = b"", time.monotonic() + 30
  try:  # raw reads: a buffered readline would hide lines from select
    while out.count(b"\n") < count and select.select(
        [p.stdout], [], [], max(0, deadline - time.monotonic()))[0]:
      if not (chunk := os.read(p.stdout.fileno(), 65536)):
        break
      out += chunk
  finally:
    p.kill()
    p.communicate(timeout=10)
  lines = out.decode().splitlines()
  return [(int(n), bytes.fromhex(h[0]) if h else b"")
          for _, n, *h in (line.split() for line in lines)]


def test_the_sidecar_refuses_the_directory_and_a_client_tells_the_impostor_nothing(impostor,
                                                                                 tmp_path):
  p, directory = impostor
  address = f"unix:{directory}/g.sock"
  # The sidecar the job starts there: refused, naming the directory, its owner and mode.
  serve = subprocess.Popen(
      [sys.executable, "-m", "sidecar", "serve", "--listen", address, "--socket",
       str(tmp_path / "s.sock"), "--shm-size", "8MiB"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:  # main served there without a word, for the attacker to rename its socket away
    eventually(lambda: serve.poll() is not None or os.path.exists(f"{directory}/g.sock"), 120)
    assert serve.poll() == 2, f"the sidecar serves in {directory}, which anyone may write"
  finally:
    serve.kill()
    _, err = serve.communicate(timeout=30)
  assert (f"refusing to make the gRPC socket {directory}/g.sock: the directory {directory} "
          f"(owner uid {NOBODY}") in err, err
  assert "mode 0777) belongs to" in err and "Give --listen unix:PATH a path" in err
  # The attacker listens at the name; the job's Controller and `sidecar status`, with the
  # token, dial it.
  p.stdin.write("listen\n")
  p.stdin.flush()
  assert p.stdout.readline().strip() == "listening", p.stderr.read()
  who = rf"served by uid {NOBODY}( \(\w+\))?, pid {p.pid}, not by this process's user"
  with pytest.raises(errors.PermissionDeniedError, match=rf"refusing to talk to the Unix "
                     rf"socket {directory}/g.sock: it is {who}.*SIDECAR_SOCKET_UID={NOBODY}"):
    sidecar.jax.Controller([address], token=TOKEN, connect_timeout=5)
  with pytest.raises(errors.PermissionDeniedError, match=who):
    status_lib.fetch(address, timeout=5, token=TOKEN)
  with pytest.raises(errors.PermissionDeniedError, match=who):  # a worker socket's calls, streams
    ipc.connect(f"{directory}/g.sock", timeout=5)
  assert eventually(lambda: p.poll() is None)  # still listening: it was refused, not gone
  received = _received(p, 3)
  assert len(received) == 3 and all(n == 0 for n, _ in received), received  # asked who, no more
