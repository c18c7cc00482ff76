"""`sidecar launch`: ranks that share a sidecar, each with its share of the arena, and the
job's c10d store kept off the network (issue 35 items 8 and 9)."""

import subprocess
import sys
import textwrap

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.processes

def test_ranks_beside_one_sidecar_each_get_their_share_of_its_arena(tmp_path):
  done = subprocess.run(
      [sys.executable, "-m", "sidecar", "launch", "--hosts", "1", "--procs-per-host", "2",
       "--shm-size", "64MiB", "--", sys.executable, "-m", "tests.support.arena_fill",
       str(tmp_path / "filled")], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stdout + done.stderr
  held = sorted(int(line.split()[-2]) for line in done.stdout.splitlines() if "held" in line)
  # Before: rank 0 held 57 MiB (the 0.9 default), rank 1 the 7 left.
  assert len(held) == 2 and all(24 <= h <= 31 for h in held), done.stdout


# Each rank joins the gloo group, then lists who listens on MASTER_PORT (/proc/net/tcp*).
_STORE = """
    import os
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    port = int(os.environ["MASTER_PORT"])
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
      with open(table) as f:
        for row in f.readlines()[1:]:
          local, state = row.split()[1], row.split()[3]
          if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
            listening.append(local.rsplit(":", 1)[0])
    t = torch.tensor([dist.get_rank()])
    dist.all_reduce(t)
    print(f"sum={int(t)} listening={','.join(sorted(set(listening)))}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
"""
_LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def test_the_jobs_c10d_store_listens_on_loopback_only():
  done = subprocess.run(
      [sys.executable, "-m", "sidecar", "launch", "--torch", "--hosts", "1",
       "--procs-per-host", "2", "--shm-size", "8MiB", "--", sys.executable, "-c",
       textwrap.dedent(_STORE)], cwd=ROOT, capture_output=True, text=True, timeout=200)
  assert done.returncode == 0, done.stdout + done.stderr
  found = [line.split("] ", 1)[1] for line in done.stdout.splitlines() if "listening=" in line]
  assert len(found) == 2 and all(f.startswith("sum=1 ") for f in found), done.stdout
  addresses = {a for f in found for a in f.split("listening=")[1].split(",") if a}
  # Before: rank 0's TCPStore listened on every interface (00000000, or :: in tcp6).
  assert addresses and addresses <= _LOOPBACK, found
