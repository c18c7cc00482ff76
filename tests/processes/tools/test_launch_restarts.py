"""``sidecar launch --max-restarts N`` without --elastic: a failed trainer restarts every
trainer beside the same sidecars, whose arenas, RAM tiers and feeds outlive it.

The trainers are tests/support/train_restarts.py (saves, then process 1 fails) and
tests/support/feed_restarts.py (a feed with worker processes, then SIGKILL).
"""

import os
import re
import subprocess
import sys
import time

import pytest

from sidecar._src.core import errors
from sidecar._src.tools import launch
from tests.conftest import alive, eventually
from tests.support import train_restarts
from tests.support.paths import ROOT
from tests.support.trainers import results

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]
WORKERS = 2


def _launch(*args: str) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-m", "sidecar", "launch", *args], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _of(got: list[dict], kind: str, **where) -> list[dict]:
  return [r for r in got if r["kind"] == kind and all(r[k] == v for k, v in where.items())]


def _sidecar_pids(err: str) -> list[int]:
  return [int(p) for p in re.findall(r"host \d+'s sidecar \(pid (\d+)\)", err)]


def _watch_kills(p: subprocess.Popen, *, deadline: float | None) -> tuple[str, str, list[float]]:
  """Reads feed_restarts's output as it comes; at each "kill" line, waits (``deadline``
  seconds at most; None: not) until the killed trainer's feed workers are gone. Returns the
  output, the launcher's messages and, per kill, the seconds from the SIGKILL until they
  were."""
  lines, took = [], []
  for line in p.stdout:
    lines.append(line)
    if (kill := results(line)) and kill[0]["kind"] == "kill":
      workers = kill[0]["feed_workers"]
      assert len(workers) == WORKERS, workers
      if deadline is None:
        continue
      assert eventually(lambda w=workers: not any(map(alive, w)), timeout=deadline), workers
      took.append(time.time() - kill[0]["t"])
  err = p.stderr.read()
  p.wait(timeout=60)
  return "".join(lines), err, took


def _train(directory, max_restarts: int) -> tuple[int, list[dict], str, str]:
  """train_restarts under --hosts 2: process 1 fails on the first 2 starts (SIGKILL, exit 3)."""
  p = _launch("--hosts", "2", "--shm-size", "16MiB", "--max-restarts", str(max_restarts), "--",
              sys.executable, "-m", "tests.support.train_restarts", str(directory), "2")
  out, err = p.communicate(timeout=240)
  return p.returncode, results(out), out, err


def test_a_failed_trainer_restarts_the_job_beside_the_same_sidecars(tmp_path):
  code, got, out, err = _train(tmp_path, max_restarts=2)
  assert code == 0, out + err
  restarts = re.findall(r"restart (\d+): host 1's trainer (.*?); 2 processes on hosts \[0, 1\] "
                        r"in place, started [\d.]+ s after the loss .*; (\d) of --max-restarts "
                        r"2 left", err)
  assert restarts == [("1", "was killed by SIGKILL", "1"), ("2", "exited with code 3", "0")], err
  # SIDECAR_RESTART 0, 1, 2: each start's 2 processes, beside the same 2 sidecars.
  starts = _of(got, "start")
  assert sorted((r["restart"], r["process"]) for r in starts) == [
      (r, p) for r in range(3) for p in range(2)]
  sidecars = _sidecar_pids(err)
  assert len(sidecars) == 2 and all(
      r["sidecar_pids"] == {"0": sidecars[0], "1": sidecars[1]} for r in starts), starts
  assert len({r["pid"] for r in starts}) == 6  # new trainers every time
  # The step saved before each failure comes back from each host's own RAM tier.
  for restart in (1, 2):
    restored = _of(got, "restored", restart=restart)
    assert sorted(r["host"] for r in restored) == [0, 1]
    for r in restored:
      assert r["step"] == restart - 1 and r["sources"] == {f"ram:host{r['host']}": 1}, r
  assert [r["w"][0][0] for r in _of(got, "committed", process=0)] == [1.0, 2.0, 3.0]
  assert eventually(lambda: not any(alive(p) for p in sidecars), timeout=10)
  # Every save ended before the job did: nothing for the launcher to wait for at the end.
  assert "waiting up to" not in err and "abandoned" not in err, err


def test_the_failure_after_max_restarts_ends_the_job_with_its_code(tmp_path):
  code, got, out, err = _train(tmp_path, max_restarts=1)
  assert code == train_restarts.EXIT_CODE, out + err
  assert len(re.findall(r"restart \d+:", err)) == 1, err
  assert ("host 1's trainer exited with code 3 after 1 restarts (--max-restarts 1); stopping "
          "the others") in err
  assert not _of(got, "start", restart=2)
  assert eventually(lambda: not any(alive(p) for p in _sidecar_pids(err)), timeout=10)


def test_max_restarts_defaults_to_none_without_elastic():
  done = subprocess.run([sys.executable, "-m", "sidecar", "launch", "--hosts", "1", "--",
                         sys.executable, "-c", "import sys; sys.exit(5)"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 5, done.stderr
  assert "host 0's trainer exited with code 5; stopping the others" in done.stderr
  assert "restart" not in done.stderr


def test_a_killed_trainers_feed_workers_serve_the_next_trainers_feed():
  """The trainer SIGKILLs itself with a feed of 2 worker processes open, 3 times: each time
  its feed ends in the sidecar (no feed left, no arena block but the batches it keeps for
  re-done steps), its workers stay idle (``sidecar serve --feed-idle-s``), and the next
  trainer's feed adopts them: the same 2 processes serve every start, the same stream, and
  they go with the sidecar. Before (main): each start's feed started 2 new ones."""
  fails = 3
  p = _launch("--hosts", "1", "--shm-size", "32MiB", "--max-restarts", str(fails),
              "--import", "tests.support.feed_fns", "--", sys.executable, "-m",
              "tests.support.feed_restarts", "20", str(WORKERS), str(fails))
  out, err, _ = _watch_kills(p, deadline=None)
  assert p.returncode == 0, out + err
  got = results(out)
  starts, runs = _of(got, "start"), _of(got, "run")
  assert [r["restart"] for r in starts] == [r["restart"] for r in runs] == list(range(fails + 1))
  # Nothing of the killed trainers' feeds is left in the sidecar but their idle workers:
  # every block back (feed_restarts waits LEFT_S for the sidecar's teardown, which the
  # launcher's restart does not wait for).
  workers = runs[0]["feed_workers"]
  assert len(workers) == WORKERS
  for r in starts:
    assert (r["feeds"], r["arena_used"]) == (0, 0), r
  assert [r["feed_workers"] for r in starts] == [[]] + [workers] * fails
  for r in runs:  # the same stream from its start each time, from the same 2 workers
    assert r["feed_workers"] == workers and r["steps"] == 20, r
    assert (r["first_id"], r["ids"]) == (runs[0]["first_id"], runs[0]["ids"]), r
  sidecar = _sidecar_pids(err)
  assert len(sidecar) == 1 and {r["sidecar_pid"] for r in starts} == set(sidecar)
  assert eventually(lambda: not alive(sidecar[0]), timeout=10)
  assert not any(map(alive, workers))


def test_feed_workers_stuck_in_a_batch_go_with_their_trainer(tmp_path):
  """The workers are busy in a minute-long example when their trainer is SIGKILLed: the
  feed ends though it waits for no credit, and the workers are killed (no batch of theirs
  ends within ``idle.DRAIN_S``: they are not kept idle, then STOP_GRACE); the next trainer's
  feed starts 2 of its own."""
  p = _launch("--hosts", "1", "--shm-size", "32MiB", "--max-restarts", "1",
              "--import", "tests.support.feed_fns", "--", sys.executable, "-m",
              "tests.support.feed_restarts", "5", str(WORKERS), "1", str(tmp_path / "slow"))
  out, err, took = _watch_kills(p, deadline=10.0)
  assert p.returncode == 0, out + err
  print(f"busy feed workers gone {took[0]:.3f} s after their trainer's SIGKILL")
  got = results(out)
  assert len(took) == 1 and len(_of(got, "final")) == 1
  killed = _of(got, "kill")[0]["feed_workers"]
  assert set(_of(got, "start", restart=1)[0]["feed_workers"]) <= set(killed)  # dying ones
  started = _of(got, "run", restart=1)[0]["feed_workers"]
  assert len(started) == WORKERS and not set(started) & set(killed)


def test_torch_ranks_see_the_restart_count_and_the_limit():
  script = ("import os, sys; e = os.environ; print('ENV', e['SIDECAR_RESTART'], "
            "e['TORCHELASTIC_RESTART_COUNT'], e['TORCHELASTIC_MAX_RESTARTS'], e['MASTER_PORT']); "
            "sys.exit(3 if e['SIDECAR_RESTART'] == '0' else 0)")
  done = subprocess.run([sys.executable, "-m", "sidecar", "launch", "--hosts", "1", "--torch",
                         "--max-restarts", "2", "--", sys.executable, "-c", script], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stdout + done.stderr
  seen = re.findall(r"ENV (\d) (\d) (\d) (\d+)", done.stdout)
  assert [s[:3] for s in seen] == [("0", "0", "2"), ("1", "1", "2")], done.stdout
  assert "restart 1: host 0's trainer exited with code 3;" in done.stderr


def test_max_restarts_is_refused_with_elastic_alone():
  with pytest.raises(errors.InvalidArgumentError, match="max_restarts applies without elastic"):
    launch.run(["true"], hosts=2, elastic=True, max_restarts=1)
  with pytest.raises(errors.InvalidArgumentError, match="max_restarts must be an int >= 0"):
    launch.run(["true"], hosts=2, max_restarts=-1)


# A trainer that compiles one program, says where JAX's persistent cache is, and fails on
# its first start.
_COMPILES = """
import os, sys
import jax, jax.numpy as jnp
print("cache dir", jax.config.jax_compilation_cache_dir, flush=True)
jax.jit(lambda x: jnp.sin(x) * 2)(jnp.arange(8.0)).block_until_ready()
print("compiled", flush=True)
sys.exit(3 if os.environ["SIDECAR_RESTART"] == "0" else 0)
"""


def _compiling(env: dict, max_restarts: int) -> list[str]:
  """_COMPILES under --max-restarts, JAX logging each compile; its output per start."""
  env = {**env, "JAX_LOG_COMPILES": "1", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  p = subprocess.run([sys.executable, "-m", "sidecar", "launch", "--hosts", "1",
                      "--max-restarts", str(max_restarts), "--", sys.executable, "-c", _COMPILES],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
  starts = p.stdout.split("cache dir ")[1:]
  assert len(starts) == max_restarts + 1 and all("compiled" in s for s in starts), (
      p.stdout + p.stderr)
  return starts


def test_a_restarted_trainer_loads_its_programs_from_the_launchs_compilation_cache():
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  first, second = _compiling(env, max_restarts=1)
  hit = "Persistent compilation cache hit for 'jit__lambda'"
  assert hit not in first and hit in second, (first, second)
  directory = first.split()[0]
  assert second.split()[0] == directory and os.path.isabs(directory)
  assert not os.path.exists(directory)  # the launch's own: gone at its end
  # Without restarts there is nothing to load again: JAX is left as it is.
  (only,) = _compiling(env, max_restarts=0)
  assert only.split()[0] == "None", only


def test_a_compilation_cache_the_user_names_is_kept(tmp_path):
  mine = tmp_path / "mine"
  first, second = _compiling({**os.environ, "JAX_COMPILATION_CACHE_DIR": str(mine)}, 1)
  assert first.split()[0] == second.split()[0] == str(mine)
  assert "Persistent compilation cache hit for 'jit__lambda'" in second
  assert any(mine.iterdir())  # the user's: kept
