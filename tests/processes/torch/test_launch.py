"""`sidecar launch --torch --procs-per-host P`: torchrun's environment for N x P ranks beside
N sidecars; the ranks form a gloo group with no arguments, and every rank attaches its own
Worker session to its host's sidecar."""

import os
import re
import subprocess
import sys
import textwrap

import pytest

from sidecar._src.tools import launch
from tests.conftest import alive, eventually

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]

TORCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RESTART_COUNT", "OMP_NUM_THREADS")

SCRIPT = """
    VARS = TORCH_VARS
    import os
    import torch, torch.distributed as dist
    import sidecar
    e = os.environ
    for name in VARS + ("SIDECAR_PROCESS_ID", "SIDECAR_HOST_ID", "SIDECAR_NUM_PROCESSES",
                      "SIDECAR_ADDRESS"):
      print(f"{name}={e.get(name)}")
    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x)
    print(f"sum={x.item():g}")
    with sidecar.jax.Worker() as w:  # this rank's own session on its host's sidecar
      print(f"session={w.session} host={w.host_id}")
      dist.barrier()  # every session is open at once
    dist.destroy_process_group()
""".replace("TORCH_VARS", repr(TORCH_VARS))


def _by_rank(out: str) -> dict[int, dict[str, str]]:
  ranks: dict[int, dict[str, str]] = {}
  for line in out.splitlines():
    m = re.match(r"\[host (\d+) rank (\d+)\] (\w+)=(.*)$", line)
    if m:
      ranks.setdefault(int(m[2]), {"_host": m[1]})[m[3]] = m[4]
  return ranks


def test_four_ranks_on_two_sidecars_get_torchruns_environment_and_a_gloo_group():
  p = subprocess.run(
      [sys.executable, "-m", "sidecar", "launch", "--torch", "--hosts", "2",
       "--procs-per-host", "2", "--shm-size", "8MiB", "--", sys.executable, "-c",
       textwrap.dedent(SCRIPT)], capture_output=True, text=True, timeout=200)
  assert p.returncode == 0, p.stdout + p.stderr
  ranks = _by_rank(p.stdout)
  assert sorted(ranks) == [0, 1, 2, 3], p.stdout
  ports = {r["MASTER_PORT"] for r in ranks.values()}
  assert len(ports) == 1 and ports != {"0"}
  sessions = set()
  for rank, got in ranks.items():
    host = rank // 2
    assert got["_host"] == str(host)
    assert got["RANK"] == got["ROLE_RANK"] == got["SIDECAR_PROCESS_ID"] == str(rank)
    assert got["LOCAL_RANK"] == str(rank % 2) and got["LOCAL_WORLD_SIZE"] == "2"
    assert got["WORLD_SIZE"] == got["ROLE_WORLD_SIZE"] == got["SIDECAR_NUM_PROCESSES"] == "4"
    assert got["GROUP_RANK"] == got["SIDECAR_HOST_ID"] == str(host)
    assert got["GROUP_WORLD_SIZE"] == "2" and got["MASTER_ADDR"] == "127.0.0.1"
    assert got["TORCHELASTIC_RESTART_COUNT"] == "0" and got["OMP_NUM_THREADS"] == "1"
    assert got["SIDECAR_ADDRESS"].endswith(f"host{host}.sock")
    assert got["sum"] == "6"  # 0 + 1 + 2 + 3: one group of four ranks
    session = re.fullmatch(rf"(\S+) host={host}", got["session"])
    assert session, got["session"]
    sessions.add(session[1])
  assert len(sessions) == 4  # two ranks per sidecar, each its own session
  found = re.findall(r"sidecar \(pid (\d+)\)", p.stderr)
  assert eventually(lambda: not any(alive(int(pid)) for pid in found))


def test_without_torch_procs_per_host_sets_only_the_sidecar_variables(tmp_path):
  from sidecar._src.tools.local import LocalCluster
  with LocalCluster(2, 1, shm_size="8MiB", configure_jax=False,
                    assign_device_ids=False) as cluster:
    envs = [launch.trainer_env(cluster, h, "127.0.0.1:1", {}, procs_per_host=3, local_rank=l)
            for h in (0, 1) for l in range(3)]
    torch_env = launch.trainer_env(cluster, 1, "127.0.0.1:1", {}, procs_per_host=3,
                                   local_rank=2, torch_master="10.0.0.1:29500", restart=2)
    # One rank per sidecar, two sidecars: both ranks share this machine's cores, so each
    # gets one OpenMP thread (two each made a training loop on 2 cores 5x slower), as
    # torchrun gives a node's ranks; unless the caller set its own.
    one_each = launch.trainer_env(cluster, 0, "127.0.0.1:1", {}, torch_master="10.0.0.1:1")
    own = launch.trainer_env(cluster, 0, "127.0.0.1:1", {"OMP_NUM_THREADS": "2"},
                             torch_master="10.0.0.1:1")
  assert one_each["OMP_NUM_THREADS"] == "1" and own["OMP_NUM_THREADS"] == "2"
  assert [e["SIDECAR_PROCESS_ID"] for e in envs] == [str(r) for r in range(6)]
  assert {e["SIDECAR_NUM_PROCESSES"] for e in envs} == {"6"}
  assert [e["SIDECAR_HOST_ID"] for e in envs] == ["0"] * 3 + ["1"] * 3
  assert not any("RANK" in e or "MASTER_PORT" in e for e in envs)
  assert {k: torch_env[k] for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR",
                                    "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")} == {
      "RANK": "5", "LOCAL_RANK": "2", "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1",
      "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "2"}
  assert torch_env["SIDECAR_RESTART"] == "2"


def test_a_bad_procs_per_host_is_named(capsys):
  with pytest.raises(SystemExit) as e:
    from sidecar._src.tools import cli
    cli.main(["launch", "--procs-per-host", "0", "--", "true"])
  assert e.value.code == 2
  assert "--procs-per-host must be at least 1, got 0" in capsys.readouterr().err
  with pytest.raises(Exception, match="procs_per_host must be an int >= 1, got 0"):
    launch.run(["true"], procs_per_host=0)
  assert os.environ.get("RANK") is None
