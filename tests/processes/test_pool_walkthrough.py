"""docs/pool.md's walk-through, run as written on one machine (issue 79 item 4): the
operator's block (tokens, the pool file, `sidecar local --pool`), alice's training job,
bob's notebook snippet, and what the text says bob's calls meet on this machine.

Scaled as LM_SCALE does for the README: sidecars of 128 MiB for 512 MiB and bob's
`inline_bytes` of 16 MiB for 64 MiB, so his arrays are 32 MiB for 128 MiB (the same
shares of the arena)."""

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.support.paths import ROOT

pytestmark = [pytest.mark.processes, pytest.mark.timeout(600)]

SCALE = {"--shm-size 512MiB": "--shm-size 128MiB", "inline_bytes: 64MiB": "inline_bytes: 16MiB"}
MIB = 32  # bob's array: a quarter of a sidecar's arena, as 128 MiB of 512 MiB

# What the text says bob meets on this machine, at the scale above: calls in a row go
# through his arena; one past what is free to him (a result kept) waits its turn, says so,
# and fails at its timeout; one sent inline (attach=False) past inline_bytes is refused.
BOB_CALLS = f"""
import logging, sys
logging.basicConfig(level=logging.WARNING, format="WARNING %(message)s")
big = np.ones({MIB} << 18, np.float32)
for _ in range(3):
  ctl.call("normalize", args=(big,), hosts=[0])
print("three calls went through", flush=True)
kept = ctl.call("normalize", args=(big,), hosts=[0])
try:
  ctl.call("normalize", args=(big,), hosts=[0], timeout=5)
except sidecar.ResourceExhaustedError as e:
  print(f"kept: {{type(e).__name__}}: {{e}}", flush=True)
del kept
remote = sidecar.jax.Controller(["ADDR0", "ADDR1"], attach=False,
                                token=open(os.path.expanduser("~/pool/bob.token")).read().strip())
try:
  remote.call("normalize", args=(big,), hosts=[0])
except sidecar.ResourceExhaustedError as e:
  print(f"inline: {{type(e).__name__}}: {{e}}", flush=True)
"""


def _blocks() -> list[tuple[str, str]]:
  """(language, text) of each code block of the walk-through's section."""
  text = (ROOT / "docs" / "pool.md").read_text()
  section = text.split("## Two teams on one pool: a walk-through", 1)[1].split("\n## ", 1)[0]
  return re.findall(r"```(bash|python)\n(.*?)```", section, re.S)


def _here(block: str, home, addresses: list[str] | None = None) -> str:
  """A block as this machine runs it: ``~`` is ``home``, /tmp/ckpt lies in it, the
  checkout's examples and this interpreter, scaled by SCALE."""
  block = block.replace("path/to/colocated-sidecar", str(ROOT)).replace(
      "/tmp/ckpt", f"{home}/ckpt").replace("~/", f"{home}/")
  block = re.sub(r"(?<![/\w.-])python ", f"{sys.executable} ", block)
  block = re.sub(r"^sidecar ", f"{sys.executable} -m sidecar ", block, flags=re.M)
  for written, scaled in SCALE.items():
    block = block.replace(written, scaled)
  for i, address in enumerate(addresses or ()):
    block = block.replace(f"ADDR{i}", address)
  return block


def test_the_pool_walk_through_runs_as_written_and_does_what_it_says(tmp_path):
  blocks = _blocks()
  assert [lang for lang, _ in blocks[:3]] == ["bash", "bash", "python"], blocks
  operator, alice, bob = (b for _, b in blocks[:3])
  assert all(written in operator for written in SCALE), operator
  home = tmp_path / "home"
  home.mkdir()
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES") and not k.startswith("SIDECAR_")}
  env.update(PYTHONPATH=str(ROOT), HOME=str(home), SIDECAR_LOG_DIR=str(tmp_path / "logs"))
  pool = subprocess.Popen(["bash", "-e", "-c", _here(operator, home)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
  try:
    out = ""
    while (found := re.search(r"^SIDECAR_HOSTS=(\S+)$", out, re.M)) is None:
      line = pool.stdout.readline()
      assert line, out
      out += line
    addresses = found.group(1).split(",")
    assert len(addresses) == 2, out
    done = subprocess.run(["bash", "-e", "-c", _here(alice, home, addresses)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 process(es): trained steps 0-99; saved steps [49, 74, 99]" in done.stdout
    assert "WARNING" not in done.stderr, done.stderr
    done = subprocess.run([sys.executable, "-c", _here(bob + BOB_CALLS, home, addresses)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    said = done.stdout + done.stderr
    assert "JAX_NUM_CPU_DEVICES" not in done.stderr, done.stderr  # his snippet as written
    assert said.startswith("[array([-1.34164079, -0.4472136 ,  0.4472136 ,  1.34164079]), "
                           "array([-1.34164079,"), said
    assert "three calls went through" in said, said
    assert re.search(r"WARNING .*tenant 'bob' waits in the sidecar's arena queue.*it gives up "
                     r"in \d+ s \(its timeout, 5 s\)", said), said
    assert (f"kept: ResourceExhaustedError: tenant 'bob' holds {2 * MIB}.0 MiB of the arena; "
            f"{MIB}.0 MiB more would take from the guaranteed arena of other tenants") in said
    assert re.search(r"inline: ResourceExhaustedError: tenant 'bob' sent an inline request of "
                     r"\d+ bytes, more than its quota \(inline_bytes=16777216, ", said), said
    status = subprocess.run([sys.executable, "-m", "sidecar", "pool", "status", "--token-file",
                             str(home / "pool" / "bob.token"), *addresses], env=env,
                            capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stdout + status.stderr
    rows = [line.split()[0] for line in status.stdout.splitlines()[1:] if line.strip()]
    assert rows[:1] == ["bob"] and "alice" not in rows, status.stdout  # bob's row only
  finally:
    os.killpg(pool.pid, signal.SIGINT)  # Ctrl-C to `sidecar local`
    try:
      pool.communicate(timeout=60)
    except subprocess.TimeoutExpired:
      os.killpg(pool.pid, signal.SIGKILL)
      pool.communicate()
