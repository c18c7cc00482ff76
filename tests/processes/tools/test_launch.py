"""`sidecar launch`: real sidecars and real trainer processes, started, watched and stopped."""

import io
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from sidecar._src.tools import cli, launch
from tests.conftest import alive, eventually

pytestmark = pytest.mark.processes


def _start(script: str, *flags: str) -> subprocess.Popen:
  return subprocess.Popen(
      [sys.executable, "-m", "sidecar", "launch", "--hosts", "2", "--shm-size", "8MiB", *flags,
       "--", sys.executable, "-c", textwrap.dedent(script)],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _sidecars(stderr: str) -> tuple[dict[int, int], str]:
  """{host: sidecar pid} and the run's temp dir, from what the launcher printed."""
  found = re.findall(r"host (\d+)'s sidecar \(pid (\d+)\) serves \S+ and unix://(\S+)", stderr)
  return {int(h): int(p) for h, p, _ in found}, os.path.dirname(found[0][2])


def _pids(stdout: str) -> list[int]:
  return [int(p) for p in re.findall(r"pid=(\d+)", stdout)]


def _assert_nothing_left(pids, temp_dir: str) -> None:
  assert pids
  assert eventually(lambda: not any(alive(p) for p in pids)), [p for p in pids if alive(p)]
  assert not os.path.exists(temp_dir)


def _read_until(stream, pattern: str, count: int) -> str:
  """Reads lines from ``stream`` until ``count`` of them match ``pattern``."""
  text = ""
  while len(re.findall(pattern, text)) < count:
    line = stream.readline()
    assert line, f"stream ended before {count} lines matched {pattern!r}:\n{text}"
    text += line
  return text


def _finish(p: subprocess.Popen, out: str, err: str) -> tuple[str, str]:
  """Waits for the launcher, then returns all it printed (``out``/``err``: read so far)."""
  p.wait(timeout=30)  # Its output is small: it never blocks on a full pipe.
  return out + p.stdout.read(), err + p.stderr.read()


ENV_SCRIPT = """
    import os, sys
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    import grpc
    e = os.environ
    print("pid=%d" % os.getpid())
    for name in sorted(e):
      if name.startswith("SIDECAR_") or name == "JAX_PLATFORMS":
        print("%s=%s" % (name, e[name]))
    print("socket_exists=%s" % os.path.exists(e["SIDECAR_ADDRESS"].removeprefix("unix://")))
    for entry in e["SIDECAR_HOSTS"].split(","):
      with grpc.insecure_channel(entry) as ch:  # unix:PATH: health on the sidecar's socket
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
      print("health %s %s"
            % (entry, health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)))
    if e["SIDECAR_PROCESS_ID"] == "0":
      import sidecar
      with sidecar.jax.Controller.from_env(timeout=10, attach=False) as ctl:
        for h in ctl.hosts:
          print("handshake host=%d devices=%s sidecar_pid=%d"
                % (h.host_id, list(h.device_ids), h.pid))
    sys.stdout.write("last line without newline")
"""


def test_one_host_gets_no_coordinator_and_runs_without_jax_distributed():
  # One process needs no jax.distributed: nothing binds a TCP port, as on a TPU host.
  p = _start("""
      import os, sidecar
      print("coordinator=%s" % os.environ.get("SIDECAR_COORDINATOR_ADDRESS"))
      print("distributed=%s" % sidecar.jax.initialize())
      """, "--hosts", "1")
  out, err = p.communicate(timeout=60)
  assert p.returncode == 0, out + err
  assert out.splitlines() == ["[host 0] coordinator=None", "[host 0] distributed=False"]


def test_two_hosts_get_their_environment_and_reach_every_sidecar(tmp_path):
  token = tmp_path / "token"
  token.write_text("s3cret\n")
  p = _start(ENV_SCRIPT, "--devices-per-host", "3", "--token-file", str(token))
  out, err = p.communicate(timeout=60)
  assert p.returncode == 0, out + err
  lines = out.splitlines()
  by_host = {h: [l.removeprefix(f"[host {h}] ") for l in lines if l.startswith(f"[host {h}] ")]
             for h in (0, 1)}
  assert sum(map(len, by_host.values())) == len(lines)  # every line carries its host
  sidecar_pids, temp_dir = _sidecars(err)
  hosts = None
  for h, got in by_host.items():
    env = dict(l.split("=", 1) for l in got if "=" in l and not l.startswith("handshake"))
    assert env["SIDECAR_PROCESS_ID"] == env["SIDECAR_HOST_ID"] == str(h)
    assert env["SIDECAR_NUM_PROCESSES"] == "2" and env["SIDECAR_LOCAL_DEVICES"] == "3"
    assert env["SIDECAR_SLICE_ID"] == "0" and env["JAX_PLATFORMS"] == "cpu"
    assert env["SIDECAR_TOKEN"] == "s3cret"
    assert env["SIDECAR_ADDRESS"] == f"unix://{temp_dir}/host{h}.sock"
    assert env["socket_exists"] == "True"
    assert re.fullmatch(r"127\.0\.0\.1:\d+", env["SIDECAR_COORDINATOR_ADDRESS"])
    hosts = hosts or env["SIDECAR_HOSTS"]
    assert env["SIDECAR_HOSTS"] == hosts  # every process sees the same list, in host order
    entries = hosts.split(",")
    assert entries == [f"unix:{temp_dir}/host{h}.grpc" for h in (0, 1)]  # no ports
    assert sorted(l for l in got if l.startswith("health")) == sorted(
        f"health {x} SERVING" for x in entries)
    assert got[-1] == "last line without newline"
  assert by_host[0][-3:-1] == [
      f"handshake host={h} devices=[] sidecar_pid={sidecar_pids[h]}" for h in (0, 1)]
  _assert_nothing_left(list(sidecar_pids.values()), temp_dir)


FAIL_SCRIPT = """
    import os, signal, subprocess, sys, time
    ready = {ready!r}
    if os.environ["SIDECAR_PROCESS_ID"] == "0":
      signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only the SIGKILL after the grace stops it
      child = subprocess.Popen(["sleep", "60"])
      print("pid=%d" % os.getpid())
      print("pid=%d" % child.pid)
      open(ready, "w").close()
      time.sleep(60)
    else:
      print("pid=%d" % os.getpid())
      while not os.path.exists(ready):
        time.sleep(0.05)
      print("failing")
      sys.exit(3)
"""


def test_a_failing_trainer_stops_the_others_and_gives_its_code(tmp_path):
  p = _start(FAIL_SCRIPT.format(ready=str(tmp_path / "ready")))
  out, err = p.communicate(timeout=30)  # the other trainer would sleep 60 s
  assert p.returncode == 3, out + err
  assert "[host 1] failing" in out
  assert "host 1's trainer exited with code 3; stopping the others" in err
  trainers = _pids(out)
  assert len(trainers) == 3  # both trainers and the child of trainer 0
  sidecar_pids, temp_dir = _sidecars(err)
  _assert_nothing_left(trainers + list(sidecar_pids.values()), temp_dir)


SLEEP_SCRIPT = """
    import os, time
    print("pid=%d" % os.getpid())
    time.sleep(60)
"""


def test_a_killed_sidecar_stops_everything_and_shows_its_log():
  p = _start(SLEEP_SCRIPT)
  err = _read_until(p.stderr, r"'s sidecar \(pid", 2)
  out = _read_until(p.stdout, r"pid=\d+", 2)
  sidecar_pids, temp_dir = _sidecars(err)
  os.kill(sidecar_pids[1], signal.SIGKILL)
  out, err = _finish(p, out, err)
  assert p.returncode == 128 + signal.SIGKILL, out + err
  assert "host 1's sidecar was killed by SIGKILL; stopping every process" in err
  assert re.search(r"^\[sidecar 1\] sidecar host 1 serving on ", err, re.MULTILINE)
  _assert_nothing_left(_pids(out) + list(sidecar_pids.values()), temp_dir)


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["sigint", "sigterm"])
def test_a_signal_to_the_launcher_stops_everything(signum, code):
  p = _start(SLEEP_SCRIPT)
  err = _read_until(p.stderr, r"'s sidecar \(pid", 2)
  out = _read_until(p.stdout, r"pid=\d+", 2)
  p.send_signal(signum)
  out, err = _finish(p, out, err)
  assert p.returncode == code, out + err
  assert f"got {signal.Signals(signum).name}; stopping every process" in err
  sidecar_pids, temp_dir = _sidecars(err)
  _assert_nothing_left(_pids(out) + list(sidecar_pids.values()), temp_dir)


DISTRIBUTED_SLEEP_SCRIPT = """
    import os, time
    import sidecar
    sidecar.jax.initialize()  # jax.distributed: its preemption notifier wants SIGTERM
    print("pid=%d" % os.getpid(), flush=True)
    time.sleep(60)
"""


def test_a_trainer_under_jax_distributed_stops_at_sigterm_not_at_the_sigkill_after_the_grace():
  p = _start(DISTRIBUTED_SLEEP_SCRIPT)
  err = _read_until(p.stderr, r"'s sidecar \(pid", 2)
  out = _read_until(p.stdout, r"pid=\d+", 2)
  p.send_signal(signal.SIGTERM)
  out, err = _finish(p, out, err)
  assert p.returncode == 143, out + err
  # Before: JAX's preemption notifier caught SIGTERM ("SIGTERM caught" in the log), and
  # each trainer ran on until the SIGKILL after the 5 s grace.
  assert "after SIGTERM; killing it" not in err, out + err
  sidecar_pids, temp_dir = _sidecars(err)
  _assert_nothing_left(_pids(out) + list(sidecar_pids.values()), temp_dir)


@pytest.mark.parametrize("args,message", [
    (["--hosts", "2"], "CMD is missing: give the trainer command after --"),
    (["--hosts", "2", "--"], "CMD is missing: give the trainer command after --"),
    (["--hosts", "0", "--", "true"], "--hosts must be at least 1, got 0"),
    (["--devices-per-host", "-1", "--", "true"], "--devices-per-host must be at least 1, got -1"),
], ids=["no-cmd", "empty-cmd", "zero-hosts", "negative-devices"])
def test_bad_command_lines_exit_2_with_a_clear_message(args, message, capsys):
  with pytest.raises(SystemExit) as exit_:  # in this process: the parser is all that runs
    cli.main(["launch", *args])
  err = capsys.readouterr().err
  assert exit_.value.code == 2 and message in err and "Traceback" not in err, err


def test_the_entry_point_gives_a_bad_command_line_exit_2():
  p = subprocess.run([sys.executable, "-m", "sidecar", "launch", "--hosts", "0", "--", "true"],
                     check=False, capture_output=True, text=True, timeout=60)
  assert p.returncode == 2 and "--hosts must be at least 1, got 0" in p.stderr, p.stderr
  assert "Traceback" not in p.stderr


def test_help_explains_environment_exit_codes_and_defaults(capsys):
  with pytest.raises(SystemExit) as exit_:
    cli.main(["launch", "--help"])
  out = capsys.readouterr().out
  assert exit_.value.code == 0
  for text in ["SIDECAR_COORDINATOR_ADDRESS", "SIDECAR_HOSTS", "SIDECAR_LOCAL_DEVICES",
               "(default: 2)", "(default: 1)", "(default: 256MiB)", "128+N", "130", "143",
               "SIGKILL after 5 s"]:
    assert text in out, text


def test_run_from_python_flushes_a_partial_line_and_reports_a_signal():
  out, err = io.BytesIO(), io.StringIO()
  script = ("import os, signal, sys; sys.stdout.write('partial'); "
            "os.kill(os.getpid(), signal.SIGKILL)")
  code = launch.run([sys.executable, "-c", script], hosts=1, shm_size="8MiB", stdout=out,
                    stderr=err)
  assert code == 128 + signal.SIGKILL, err.getvalue()
  assert out.getvalue() == b"[host 0] partial\n"
  assert "host 0's trainer was killed by SIGKILL" in err.getvalue()


def test_run_rejects_an_empty_command():
  with pytest.raises(ValueError, match=r"command must be a non-empty list"):
    launch.run([], hosts=1)
