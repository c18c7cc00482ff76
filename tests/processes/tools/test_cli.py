import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import sidecar
from sidecar._src.controller import status as status_lib
from sidecar._src.core import env as env_lib
from sidecar._src.tools import cli
from tests.conftest import eventually
from tests.support import procfs

pytestmark = pytest.mark.processes

FNS = ["tests.support.sidecar_fns"]


def test_status_table(capsys):
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=2, shm_size="8MiB",
                                    imports=FNS) as c:
    assert cli.main(["status", *c.addresses]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines[0].split()[:3] == ["ADDRESS", "HOST", "SLICE"]
    assert c.addresses[1] in lines[2] and " 2,3 " in lines[2]
    assert "0 B/8.0 MiB" in lines[1] and "echo (function)" in lines[1]
    assert cli.main(["status", c.addresses[0], "127.0.0.1:1", "--timeout", "1"]) == 1
    assert "UNREACHABLE" in capsys.readouterr().out


def test_status_without_addresses_asks_the_sidecars_that_sidecar_hosts_lists(capsys, monkeypatch):
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="8MiB",
                                    imports=FNS) as c:
    monkeypatch.setenv("SIDECAR_HOSTS", ",".join(c.addresses))
    assert cli.main(["status", "--json"]) == 0
    hosts = json.loads(capsys.readouterr().out)["hosts"]
    assert [h["address"] for h in hosts] == c.addresses and all(h["ok"] for h in hosts)
    # --watch too (before: "the following arguments are required: ADDR"), until Ctrl-C.
    watch = subprocess.Popen([sys.executable, "-m", "sidecar", "status", "--watch",
                              "--interval", "0.2"], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, SIDECAR_HOSTS=",".join(c.addresses)))
    try:
      out = ""
      while out.count(c.addresses[1]) < 1:
        line = watch.stdout.readline()
        assert line, out
        out += line
      assert c.addresses[0] in out
    finally:
      watch.send_signal(signal.SIGINT)
      assert watch.wait(60) == 0
      watch.stdout.close()
  monkeypatch.delenv("SIDECAR_HOSTS")
  with pytest.raises(SystemExit) as exit_:
    cli.main(["status"])
  assert exit_.value.code == 2
  assert "no ADDR given, and cannot find the sidecars" in capsys.readouterr().err


def test_serve_rejects_bad_flags_and_too_big_arenas(tmp_path):
  run = lambda *a: subprocess.run([sys.executable, "-m", "sidecar", "serve", *a],
                                  capture_output=True, text=True, timeout=60)
  p = run("--shm-size", "12 parsecs")
  assert p.returncode == 2 and "cannot parse size '12 parsecs'" in p.stderr
  p = run("--shm-size", "64TiB", "--socket", str(tmp_path / "s.sock"), "--port", "0",
          "--health-port", "0", "--listen", "127.0.0.1")
  assert p.returncode == 2 and "lower --shm-size" in p.stderr
  p = run("--host-id", "-4", "--socket", str(tmp_path / "s.sock"))
  assert p.returncode == 2 and "host_id must be a non-negative int, got -4" in p.stderr


@pytest.mark.parametrize("flags", [[], ["--processes", "2"], ["--elastic"]],
                         ids=["one-process", "two-processes", "elastic"])
@pytest.mark.timeout(420)  # 2.5 min for --processes 2 at a load of 15 on 2 cores
def test_demo_runs(tmp_path, flags):
  env = dict(os.environ, TMPDIR=str(tmp_path))  # its log file goes there
  env.pop("SIDECAR_LOG_LEVEL", None)
  p = subprocess.run([sys.executable, "-m", "sidecar", "demo", "--steps", "100", *flags],
                     capture_output=True, text=True, timeout=400, env=env)
  assert p.returncode == 0, p.stderr[-3000:]
  # The story only: log records, the launcher's lines and Gloo's go to the log file, this
  # run's own, removed once the run succeeded (before: kept by every run).
  assert "The log:" not in p.stdout + p.stderr
  record = re.compile(r"\d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING) ")
  assert not record.search(p.stdout + p.stderr), p.stdout + p.stderr
  assert "[Gloo]" not in p.stdout and "sidecar launch:" not in p.stderr, p.stdout + p.stderr
  # The checkpoint directory it names, it says it removes, and does (before: named, removed
  # unsaid); nothing else of it is left.
  if "--elastic" not in flags:
    ckpt_dir = re.search(r"in Orbax's layout to (\S+) \(steps", p.stdout)[1]
    assert "the demo removes that directory when it ends" in p.stdout
    assert f"  removed {ckpt_dir}\n" in p.stdout and not os.path.exists(ckpt_dir)
    # Issue 79 item 5: ~20 ms blocked per save against the save benchmark's ~5 ms, unsaid.
    assert re.search(r"\(A state of \d+ KiB: the time blocked is the save's calls to the 2 "
                     r"sidecars, not a copy\. save\(\) returns once every sidecar took the "
                     r"step over", p.stdout), p.stdout
  assert list(tmp_path.iterdir()) == []
  assert "test accuracy" in p.stdout
  assert "--elastic" in flags or "trainer waited for data" in p.stdout
  accuracy = float(p.stdout.split("test accuracy ")[1].split("%")[0])
  assert accuracy > 50  # a model that learned from the fed digits, not chance (10%)
  assert "no shared memory left behind" in p.stdout
  if "--elastic" in flags:
    assert "restarted on hosts [0, 1]: restored step" in p.stdout
    assert float(p.stdout.split("Recovery: ")[1].split(" s")[0]) > 0


@pytest.mark.timeout(300)
def test_demo_interrupted_says_so_in_one_line_and_leaves_nothing(tmp_path):
  # Its log file and checkpoints go to TMPDIR; faulthandler prints its threads at SIGABRT.
  env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONFAULTHANDLER="1")
  env.pop("SIDECAR_LOG_LEVEL", None)
  p = subprocess.Popen([sys.executable, "-m", "sidecar", "demo", "--steps", "1000000"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  try:
    out = ""
    while "Training an MLP" not in out:  # its sidecars run
      line = p.stdout.readline()
      assert line, out + p.stderr.read()
      out += line
    # In its training loop: a step saved in its checkpoint directory.
    if not eventually(lambda: list(tmp_path.glob("sidecar-demo-ckpt-*/*")), timeout=200):
      # Seen once beside a second suite, cause unknown: where the demo is, for the report.
      p.send_signal(signal.SIGABRT)
      rest, err = p.communicate(timeout=60)
      pytest.fail(f"no step saved 200 s into training; the demo's output and threads:\n"
                  f"{out}{rest}{err}")
    p.send_signal(signal.SIGINT)
    rest, err = p.communicate(timeout=240)
  finally:
    p.kill()
  # Before: a traceback of ~60 lines, the log file kept, and once in two an empty
  # sidecar-demo-ckpt-* directory left behind.
  assert p.returncode == 130, out + rest + err
  assert err == ("sidecar demo: interrupted; its sidecars are stopped and what it made is "
                 "removed\n"), err
  assert list(tmp_path.iterdir()) == []


def test_status_shows_running_feeds(capsys):
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="8MiB",
                                    imports=["tests.support.feed_fns"]) as c, c.controller() as ctl:
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("data",)), P("data"))
    with ctl.feed("ids", global_batch_size=4, sharding=sharding) as feed:
      for _ in range(5):
        next(feed)
      assert cli.main(["status", *c.addresses]) == 0
    out = capsys.readouterr().out
  feeds = out.split("PIPELINE", 1)[1].split("\n\n")[0].strip().splitlines()[1:]
  assert len(feeds) == 2 and all(" ids " in f for f in feeds)
  assert all(int(f.split()[3]) >= 5 for f in feeds)  # batches made so far, prefetch included


def _listening(pid: int) -> list[tuple[str, int]]:
  """(address, port) of every TCP socket process ``pid`` listens on, from /proc."""
  import ipaddress
  inodes = procfs.socket_inodes(pid)
  out = []
  for table in ("tcp", "tcp6"):
    with open(f"/proc/net/{table}") as f:
      for row in list(f)[1:]:
        cols = row.split()
        local, state, inode = cols[1], cols[3], cols[9]
        if state != "0A" or inode not in inodes:  # 0A: LISTEN
          continue
        hex_addr, hex_port = local.split(":")
        raw = bytes.fromhex(hex_addr)
        # /proc writes addresses as host-order 32-bit words.
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
        ip = ipaddress.ip_address(raw)
        ip = getattr(ip, "ipv4_mapped", None) or ip  # gRPC's IPv6 socket for 127.0.0.1
        out.append((str(ip), int(hex_port, 16)))
  return out


def test_serve_without_a_token_listens_on_loopback_only(tmp_path):
  import json
  import signal

  from tests.conftest import eventually
  ready = tmp_path / "ready.json"
  env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
  p = subprocess.Popen([sys.executable, "-m", "sidecar", "serve", "--port", "0", "--health-port",
                        "0", "--socket", str(tmp_path / "s.sock"), "--shm-size", "8MiB",
                        "--ready-file", str(ready)], env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    assert eventually(lambda: ready.exists() or p.poll() is not None, timeout=60), "no ready file"
    assert p.poll() is None, p.stderr.read()[-2000:]
    ports = json.loads(ready.read_text())
    listening = _listening(p.pid)
    assert {port for _, port in listening} == {ports["port"], ports["health_port"]}
    assert {address for address, _ in listening} == {"127.0.0.1"}, listening
  finally:
    p.send_signal(signal.SIGTERM)
    p.wait(30)
    p.stderr.close()


@pytest.mark.parametrize("flags,env", [
    (["--listen", "0.0.0.0"], {}),
    (["--listen", "[::]"], {}),
    ([], {"SIDECAR_LISTEN": "10.0.0.7"}),
], ids=["v4-any", "v6-any", "env"])
def test_serve_on_a_public_address_without_a_token_refuses(tmp_path, flags, env):
  env = dict({k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}, **env)
  # 64TiB: had the check been missed, the arena would fail before anything listened.
  p = subprocess.run([sys.executable, "-m", "sidecar", "serve", *flags, "--port", "0",
                      "--health-port", "0", "--socket", str(tmp_path / "s.sock"),
                      "--shm-size", "64TiB"], env=env, capture_output=True, text=True, timeout=60)
  assert p.returncode == 2
  assert "is not a loopback address and no token is set" in p.stderr
  assert "--token-file" in p.stderr and "--insecure" in p.stderr


@pytest.mark.parametrize("flags,env", [(["--insecure"], {}), ([], {"SIDECAR_INSECURE": "1"})],
                         ids=["flag", "env"])
def test_serve_insecure_starts_with_a_warning(tmp_path, flags, env):
  env = dict({k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}, **env)
  # 192.0.2.1 (TEST-NET-1) is no address of this machine: the warning is logged, then
  # binding fails, so the test never listens beyond loopback.
  p = subprocess.run([sys.executable, "-m", "sidecar", "serve", "--listen", "192.0.2.1", *flags,
                      "--port", "0", "--health-port", "0", "--socket", str(tmp_path / "s.sock"),
                      "--shm-size", "8MiB"], env=env, capture_output=True, text=True, timeout=60)
  assert "WARNING" in p.stderr and "INSECURE: serving 192.0.2.1 with no token" in p.stderr
  assert p.returncode == 2 and "cannot listen on 192.0.2.1:0" in p.stderr


@pytest.mark.parametrize("flag", ["--hosts", "--devices-per-host"])
def test_local_rejects_zero_hosts_and_devices(capsys, flag):
  with pytest.raises(SystemExit) as e:
    cli.main(["local", flag, "0"])
  assert e.value.code == 2
  assert f"{flag} must be at least 1, got 0" in capsys.readouterr().err


def test_local_stops_on_sigterm_and_removes_its_temp_dir():
  import urllib.request
  p = subprocess.Popen([sys.executable, "-m", "sidecar", "local", "--hosts", "1",
                        "--shm-size", "8MiB", "--metrics"], stdout=subprocess.PIPE,
                       stderr=subprocess.DEVNULL, text=True)
  try:
    lines = []
    for line in p.stdout:
      lines.append(line)
      if line.startswith("Ctrl-C to stop."):
        break
    socket_path = lines[0].split("worker socket unix://")[1].split()[0]
    assert os.path.exists(socket_path), lines
    url = lines[0].split("  metrics ")[1].strip()
    with urllib.request.urlopen(url, timeout=10) as response:  # --metrics serves it
      assert "sidecar_arena_size_bytes 8.388608e+06" in response.read().decode()
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 0
  finally:
    p.kill()
    p.wait(30)
    p.stdout.close()
  assert not os.path.exists(os.path.dirname(socket_path))


def test_local_prints_the_sidecar_hosts_line_that_from_env_reads():
  # Issue 35 item 12: the README said to set SIDECAR_HOSTS to what `sidecar local` printed,
  # which had no such line; a guessed entry without its health port waited 300 s.
  with _sidecar_local("--hosts", "2", "--shm-size", "8MiB") as lines:
    (hosts,) = [line for line in lines if line.startswith("SIDECAR_HOSTS=")]
    addresses = [line.split()[2] for line in lines if line.startswith("host ")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    env["SIDECAR_HOSTS"] = hosts.split("=", 1)[1]  # pasted into another shell as printed
    t0 = time.monotonic()
    found = subprocess.run(
        [sys.executable, "-c", "import sidecar\nwith sidecar.jax.Controller.from_env(timeout=60)"
         " as ctl:\n  print(*[h.address for h in ctl.hosts])"],
        env=env, capture_output=True, text=True, timeout=120)
    assert found.stdout.split() == addresses, found.stderr
    assert time.monotonic() - t0 < 30  # not the wait of a timeout


def test_local_serves_with_the_token_of_sidecar_token_file(tmp_path):
  # Issue 45's audit: SIDECAR_TOKEN reached the sidecars of `sidecar local`, while
  # SIDECAR_TOKEN_FILE, which Controller.from_env() and every other command read, did not:
  # they served with no token at all.
  token_file = tmp_path / "token"
  token_file.write_text("s3cret-local\n")
  token_file.chmod(0o600)
  env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
  with _sidecar_local("--hosts", "1", "--shm-size", "8MiB",
                      env={**env, "SIDECAR_TOKEN_FILE": str(token_file)}) as lines:
    (hosts,) = [line for line in lines if line.startswith("SIDECAR_HOSTS=")]
    env["SIDECAR_HOSTS"] = hosts.split("=", 1)[1]
    probe = ("import sidecar\nwith sidecar.jax.Controller.from_env(timeout=30) as ctl:\n"
             "  print(len(ctl.hosts))")
    without = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                             text=True, timeout=120)
    assert without.returncode != 0 and "AuthenticationError" in without.stderr, without
    with_file = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                               env={**env, "SIDECAR_TOKEN_FILE": str(token_file)}, timeout=120)
    assert with_file.stdout.split() == ["1"], with_file.stderr


@contextlib.contextmanager
def _sidecar_local(*args: str, env: dict[str, str] | None = None):
  """``sidecar local ARGS`` running: yields the lines it printed up to 'Ctrl-C to stop.',
  then stops it with Ctrl-C, which must end it with status 0."""
  p = subprocess.Popen([sys.executable, "-m", "sidecar", "local", *args],
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
  try:
    yield _read_until(p.stdout, "Ctrl-C to stop.")
    p.send_signal(signal.SIGINT)
    assert p.wait(60) == 0
  finally:
    p.kill()
    p.wait(30)
    p.stdout.close()


def _read_until(stream, marker: str) -> list[str]:
  lines = []
  for line in stream:
    lines.append(line.rstrip("\n"))
    if line.startswith(marker):
      return lines
  raise AssertionError(f"no {marker!r} line in {lines}")


@pytest.mark.timeout(300)
def test_local_pool_shows_the_operators_view_and_relays_a_bad_reload(tmp_path):
  from tests.support.pool_files import write_pool
  pool = write_pool(tmp_path)
  p = subprocess.Popen([sys.executable, "-m", "sidecar", "local", "--hosts", "2",
                        "--shm-size", "16MiB", "--pool", pool, "--checkpoint-root",
                        str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                       text=True)
  try:
    lines = _read_until(p.stdout, "Ctrl-C to stop.")
    # Before: the peer token was random and never shown: no way to every tenant's rows;
    # then it was written out, and the peer token sees no tenant's row (issue 42): the
    # operator has a token of its own, which `sidecar local` makes.
    (view,) = [line for line in lines if line.startswith("every tenant's use")]
    command = view.split(": ", 1)[1].split()
    assert command[:4] == ["sidecar", "pool", "status", "--token-file"]
    assert os.path.basename(command[4]) == "operator.token"
    assert oct(os.stat(command[4]).st_mode & 0o777) == "0o600"
    assert not os.path.exists(os.path.join(os.path.dirname(command[4]), "peer.token"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    shown = subprocess.run([sys.executable, "-m", *command, "--json"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    tenants = json.loads(shown.stdout)["tenants"]
    assert sorted(t["tenant"] for t in tenants) == ["alice", "bob"]
    per_host = subprocess.run([sys.executable, "-m", "sidecar", "status", *command[3:6]],
                              env=env, capture_output=True, text=True, timeout=120)
    assert per_host.returncode == 0, per_host.stderr
    assert {"alice", "bob"} <= set(per_host.stdout.split()), per_host.stdout
    # Before: the per-host logs, where a reload's error went, were never named.
    (logs,) = [line for line in lines if line.startswith("sidecar logs: ")]
    assert all(os.path.exists(path) for path in logs.split(": ", 1)[1].split(", "))
    # A typo in the pool file, then SIGHUP to `sidecar local`: each sidecar's refusal is
    # printed where the operator looks, and the tenants stay.
    with open(pool, "a") as f:
      f.write("    sesions: 4\n")
    p.send_signal(signal.SIGHUP)
    said = [p.stdout.readline().rstrip("\n") for _ in range(2)]
    assert [line.split("]")[0] for line in said] == ["[host 0", "[host 1"], said
    assert all("the pool file was not reloaded, the tenants stay as they were" in line
               and "sesions" in line for line in said), said
    again = subprocess.run([sys.executable, "-m", *command, "--json"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert sorted(t["tenant"] for t in json.loads(again.stdout)["tenants"]) == ["alice", "bob"]
    p.send_signal(signal.SIGINT)
    assert p.wait(60) == 0
    assert not os.path.exists(command[4])  # gone with the cluster's directory
    # The logs are not: they are in a directory of the run, in $SIDECAR_LOG_DIR here.
    kept = logs.split(": ", 1)[1].split(", ")
    assert all(os.path.exists(path) for path in kept), kept
    assert all(path.startswith(os.environ[env_lib.LOG_DIR]) for path in kept), kept
  finally:
    p.kill()
    p.wait(30)
    p.stdout.close()
  assert not os.path.exists(command[4])  # the token file went with the cluster


def test_serve_says_which_flag_when_the_metrics_port_is_taken(tmp_path, capsys):
  import socket
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    assert cli.main(["serve", "--port", "0", "--health-port", "0", "--shm-size", "8MiB",
                     "--socket", str(tmp_path / "s.sock"), "--metrics-port", str(port)]) == 2
  err = capsys.readouterr().err
  assert f"sidecar serve: cannot serve metrics on 127.0.0.1:{port}" in err
  assert "pick another --metrics-port" in err


_SCRIPT = "import sys\nfrom sidecar._src.tools.cli import main\nsys.exit(main())\n"


def test_serve_imports_from_the_cwd_says_serving_once_and_removes_the_dirs_it_made(tmp_path):
  """As the ``sidecar`` script runs: its own directory first on sys.path, not the cwd."""
  (tmp_path / "bin").mkdir()
  (tmp_path / "bin" / "sidecar_script.py").write_text(_SCRIPT)
  pkg = tmp_path / "work" / "my_pkg"
  pkg.mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "fns.py").write_text(
      "import sidecar\n@sidecar.function(name='from_cwd')\ndef f():\n  return 1\n")
  ready = tmp_path / "ready.json"
  socket_dir = tmp_path / "run" / "sidecar"  # Neither exists: serve makes both.
  env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
  p = subprocess.Popen([sys.executable, str(tmp_path / "bin" / "sidecar_script.py"), "serve",
                        "--import", "my_pkg.fns", "--port", "0", "--health-port", "0",
                        "--socket", str(socket_dir / "s.sock"), "--shm-size", "8MiB",
                        "--ready-file", str(ready)], cwd=tmp_path / "work", env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    assert eventually(lambda: ready.exists() or p.poll() is not None, timeout=60), "no ready file"
    assert p.poll() is None, p.stdout.read()[-2000:]
    port = json.loads(ready.read_text())["port"]
    names = [e.name for e in status_lib.fetch(f"127.0.0.1:{port}", timeout=10).registry]
    assert "from_cwd" in names
    assert socket_dir.is_dir()
  finally:
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=30)[0]
  assert p.returncode == 0, out
  assert out.count("serving on") == 1, out
  assert not (tmp_path / "run").exists()


def test_serve_names_the_socket_flag_when_it_cannot_make_the_socket(tmp_path):
  (tmp_path / "file").write_text("")
  p = subprocess.run([sys.executable, "-m", "sidecar", "serve", "--port", "0", "--health-port",
                      "0", "--socket", str(tmp_path / "file" / "s.sock"), "--shm-size", "8MiB"],
                     capture_output=True, text=True, timeout=60)
  assert p.returncode == 2, p.stderr
  assert f"cannot make the worker socket {tmp_path / 'file' / 's.sock'}" in p.stderr
  assert f"{tmp_path / 'file'} is not a directory" in p.stderr
  assert "give --socket or $SIDECAR_SOCKET a path in a writable directory" in p.stderr


def test_demo_without_scikit_learn_names_the_extra():
  # A None entry in sys.modules: scikit-learn as if it were not installed.
  code = ("import sys; sys.modules['sklearn'] = None\n"
          "from sidecar._src.tools import cli; sys.exit(cli.main(['demo']))\n")
  p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert p.returncode == 2, p.stderr
  assert ("sidecar demo needs scikit-learn for its dataset (pipelines.digits): "
          "pip install 'colocated-sidecar[demo]'") in p.stderr


def test_serve_with_an_empty_token_file_refuses_to_start(tmp_path, capsys):
  empty = tmp_path / "token"
  empty.write_text("\n")
  assert cli.main(["serve", "--token-file", str(empty), "--port", "0"]) == 2
  assert f"token file {str(empty)!r} is empty" in capsys.readouterr().err


def test_a_user_error_is_one_line_not_a_traceback():
  # Before: a 20-line traceback ending in InvalidArgumentError, exit status 1.
  p = subprocess.run([sys.executable, "-m", "sidecar", "demo", "--hosts", "0"],
                     capture_output=True, text=True, timeout=120)
  assert (p.returncode, p.stderr) == (2, "sidecar demo: num_hosts must be a positive int, got 0\n")
  assert p.stdout == ""  # refused before it starts anything (it printed "Starting ..." first)
