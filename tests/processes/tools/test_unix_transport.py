"""Unix-socket gRPC as the local modes use it: nothing on TCP, and hosts without TCP at all.

``sidecar serve --listen unix:PATH``, ``LocalCluster`` (unix by default) and their clients;
``unshare -rn`` gives a network namespace whose only interface, loopback, is down: there
no TCP connection can be made, as on the lent TPU host.
"""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import sidecar
from sidecar._src.tools import cli
from tests.conftest import eventually
from tests.support import procfs
from tests.support.paths import ROOT

pytestmark = pytest.mark.processes

FNS = ["tests.support.sidecar_fns"]


def _tcp_sockets(pid: int) -> list[str]:
  """The TCP sockets (any state) process ``pid`` holds, as /proc/net rows."""
  inodes = procfs.socket_inodes(pid)
  rows = []
  for table in ("tcp", "tcp6", "udp", "udp6"):
    with open(f"/proc/{pid}/net/{table}") as f:
      rows += [row for row in list(f)[1:] if row.split()[9] in inodes]
  return rows


def _serve(tmp_path, *flags: str) -> tuple[subprocess.Popen, str]:
  env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
  address = f"unix:{tmp_path}/g.sock"
  p = subprocess.Popen([sys.executable, "-m", "sidecar", "serve", "--listen", address,
                        "--socket", str(tmp_path / "w.sock"), "--shm-size", "8MiB",
                        "--ready-file", str(tmp_path / "ready.json"), *flags], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  assert eventually(lambda: (tmp_path / "ready.json").exists() or p.poll() is not None,
                    timeout=60), "no ready file"
  assert p.poll() is None, p.stdout.read()[-2000:]
  return p, address


def _stop(p: subprocess.Popen) -> str:
  p.send_signal(signal.SIGTERM)
  out = p.communicate(timeout=30)[0]
  assert p.returncode == 0, out
  return out


def test_serve_on_a_unix_socket_opens_nothing_on_tcp(tmp_path, capsys):
  p, address = _serve(tmp_path)
  try:
    assert _tcp_sockets(p.pid) == []
    assert cli.main(["status", address]) == 0
    assert cli.main(["health", address]) == 0
    assert f"{address}: SERVING" in capsys.readouterr().out
  finally:
    out = _stop(p)
  assert f"serving on {address} (health on the same socket)" in out
  assert not (tmp_path / "g.sock").exists()


def _without_root_powers() -> list[str]:
  """A command prefix under which file modes hold for this process too: root's
  CAP_DAC_OVERRIDE (open any file) dropped; nothing for another user."""
  if os.geteuid() != 0:
    return []
  setpriv = shutil.which("setpriv")
  if setpriv is None:
    pytest.skip("root opens every file, and setpriv is not here to drop that power")
  return [setpriv, "--bounding-set", "-dac_override,-dac_read_search"]


def test_a_client_without_permission_on_the_socket_is_told_the_path_and_mode(tmp_path):
  p, address = _serve(tmp_path)
  try:
    os.chmod(tmp_path / "g.sock", 0)  # not even its owner may connect now
    t0 = time.monotonic()
    client = subprocess.run(
        [*_without_root_powers(), sys.executable, "-c", textwrap.dedent(f"""
            import sidecar
            try:
              sidecar.jax.Controller([{address!r}], connect_timeout=60)
            except PermissionError as e:  # errors.PermissionDeniedError
              print(type(e).__name__ + ":", e)
            """)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t0 < 30  # at once, not the connect timeout
    assert (f"PermissionDeniedError: cannot connect to the sidecar at {address}: permission "
            f"denied: {tmp_path}/g.sock is a socket of mode 0000, owner uid {os.getuid()}"
            ) in client.stdout, client.stdout + client.stderr
    assert "--socket-group GROUP" in client.stdout
  finally:
    os.chmod(tmp_path / "g.sock", 0o600)
    _stop(p)


def test_a_local_cluster_over_tcp_still_serves_on_loopback_ports():
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="8MiB",
                                    imports=FNS, transport="tcp") as c:
    assert all(a.startswith("127.0.0.1:") for a in c.addresses + c.health_addresses)
    assert [c.host_entry(h).count(":") for h in range(2)] == [2, 2]  # HOST:PORT:HEALTH
    with c.controller() as ctl:
      assert ctl.call("add", args=(2,), kwargs={"b": 3}) == [5, 5]


def test_a_local_cluster_by_default_opens_nothing_on_tcp():
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="8MiB",
                                    imports=FNS) as c:
    assert all(a.startswith("unix:/") for a in c.addresses)
    with c.controller() as ctl:
      assert ctl.call("add", args=(2,), kwargs={"b": 3}) == [5, 5]
      assert [_tcp_sockets(c.pid(h)) for h in range(2)] == [[], []]
      assert _tcp_sockets(os.getpid()) == []


def _no_network() -> list[str] | None:
  """A command prefix that runs in a network namespace without TCP, or None."""
  unshare = shutil.which("unshare")
  if unshare is None:
    return None
  for prefix in ([unshare, "-n"], [unshare, "-rn"]):
    if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
      return prefix
  return None


NO_TCP_SCRIPT = """
    import socket
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import sidecar
    try:
      socket.create_connection(("127.0.0.1", 9), timeout=2)
    except OSError as e:
      print("no tcp:", e)
    with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="16MiB",
                                      imports=["tests.support.sidecar_fns",
                                               "tests.support.feed_fns"]) as c:
      with c.controller() as ctl:
        print("call", ctl.call("add", args=(2,), kwargs={"b": 3}))
        sharding = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("data",)), P("data"))
        with ctl.feed("ids", global_batch_size=4, sharding=sharding) as feed:
          print("batches", sum(1 for _, _ in zip(range(3), feed)))
"""


def test_the_local_modes_run_where_no_tcp_connection_can_be_made():
  prefix = _no_network()
  if prefix is None:
    pytest.skip("unshare cannot make a network namespace here")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=2")
  done = subprocess.run([*prefix, sys.executable, "-c", textwrap.dedent(NO_TCP_SCRIPT)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "no tcp: [Errno 101] Network is unreachable" in done.stdout, done.stdout
  assert "call [5, 5]" in done.stdout and "batches 3" in done.stdout, done.stdout
