"""What ``sidecar slurm _trainer`` gives each trainer task: JAX's and torchrun's variables,
from the step's plan and the sidecars' entries in the rendezvous directory (no Slurm)."""

import os

import pytest

from sidecar._src.core import platform, rendezvous
from sidecar._src.tools.slurm import tasks

pytestmark = pytest.mark.unit


def directory_of(tmp_path, nodes: dict[int, str], processes: list[int]) -> str:
  """A rendezvous directory: sidecar host h on node ``nodes[h]``, and start 0's plan."""
  d = str(tmp_path)
  os.makedirs(os.path.join(d, rendezvous.HOSTS_DIR))
  os.makedirs(os.path.join(d, rendezvous.STEPS_DIR))
  rendezvous.make_token_file(os.path.join(d, rendezvous.TOKEN_FILE))
  for h, node in nodes.items():
    entry = rendezvous.HostEntry(h, sorted(set(nodes.values())).index(node), node,
                                 f"{node}.cluster", 9000 + h, 9100 + h, f"/tmp/s{h}.sock", 1)
    rendezvous.write_json(os.path.join(d, rendezvous.HOSTS_DIR, f"{h}.json"), entry.to_dict())
  rendezvous.write_json(os.path.join(d, rendezvous.STEPS_DIR, "0.json"), {
      "restart": 0, "coordinator": f"{nodes[processes[0]]}.cluster:61500",
      "torch_master_port": 57400, "processes": processes, "local_devices": 1})
  return d


def test_each_trainer_gets_torchruns_ranks_with_a_nodes_ranks_in_a_row(tmp_path):
  # 2 nodes, 2 sidecars each (hosts 0,1 on a; 2,3 on b), 2 trainers per sidecar.
  d = directory_of(tmp_path, {0: "a", 1: "a", 2: "b", 3: "b"}, [0, 0, 1, 1, 2, 2, 3, 3])
  envs = [tasks.trainer_env(d, 0, p) for p in range(8)]
  assert [e["RANK"] for e in envs] == [str(p) for p in range(8)]
  assert {e["WORLD_SIZE"] for e in envs} == {"8"}
  assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"] * 2
  assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"4"}
  assert [e["GROUP_RANK"] for e in envs] == ["0"] * 4 + ["1"] * 4
  assert {e["GROUP_WORLD_SIZE"] for e in envs} == {"2"}
  assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {("a.cluster", "57400")}
  # and JAX's, as before: process ids, this trainer's own sidecar
  assert [e["SIDECAR_PROCESS_ID"] for e in envs] == [str(p) for p in range(8)]
  assert envs[5]["SIDECAR_ADDRESS"] == "unix:///tmp/s2.sock"


def test_a_restart_counts_in_torchelastics_variable(tmp_path):
  d = directory_of(tmp_path, {0: "a"}, [0])
  plan = os.path.join(d, rendezvous.STEPS_DIR)
  rendezvous.write_json(os.path.join(plan, "3.json"), {
      **rendezvous.read_json(os.path.join(plan, "0.json")), "restart": 3})
  env = tasks.trainer_env(d, 3, 0)
  assert env["TORCHELASTIC_RESTART_COUNT"] == "3" and env["SIDECAR_RESTART"] == "3"


@pytest.mark.parametrize("files, users, added", [
    ((), {}, {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}),
    (("dev/accel0",), {}, {}),
    (("dev/accel0",), {"JAX_PLATFORMS": "cpu"},
     {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}),
], ids=["no-accelerator", "tpu", "users-cpu-on-a-tpu"])
def test_a_trainer_gets_the_platform_jax_would_pick_on_its_node(tmp_path, monkeypatch, files,
                                                                users, added):
  root = tmp_path / "root"
  for f in files:
    (root / f).parent.mkdir(parents=True, exist_ok=True)
    (root / f).touch()
  monkeypatch.setattr(platform, "ROOT", str(root))
  for name in ("JAX_PLATFORMS", "XLA_FLAGS"):
    monkeypatch.delenv(name, raising=False)
  for name, value in users.items():
    monkeypatch.setenv(name, value)
  env = tasks.trainer_env(directory_of(tmp_path, {0: "a"}, [0]), 0, 0)
  assert {k: env[k] for k in ("JAX_PLATFORMS", "XLA_FLAGS") if k in env} == added
