"""The rendezvous directory and cluster file of Slurm jobs (core/rendezvous.py), and how
discovery reads them (controller/discovery.py), with no Slurm and no sidecar."""

import os

import pytest

import sidecar
from sidecar._src.controller import discovery
from sidecar._src.core import rendezvous

pytestmark = pytest.mark.unit


def test_a_token_file_readable_by_others_or_unreadable_is_refused_naming_it(tmp_path):
  path = tmp_path / "token"
  token = rendezvous.make_token_file(str(path))
  assert oct(path.stat().st_mode & 0o777) == "0o600"
  assert rendezvous.read_token_file(str(path)) == token
  with pytest.raises(FileExistsError):  # never overwrites one
    rendezvous.make_token_file(str(path))
  for mode in (0o644, 0o640, 0o602):
    os.chmod(path, mode)
    with pytest.raises(sidecar.InvalidArgumentError,
                       match=f"token file '{path}' is readable or writable by others "
                             f"\\(mode {mode:04o}\\).*chmod 600 {path}"):
      rendezvous.read_token_file(str(path))
  with pytest.raises(sidecar.InvalidArgumentError,
                     match=f"token file '{tmp_path / 'gone'}' cannot be read"):
    rendezvous.read_token_file(str(tmp_path / "gone"))


def test_the_cluster_file_round_trips_and_a_broken_one_is_named(tmp_path):
  path = tmp_path / "cluster.env"
  cluster = rendezvous.ClusterFile("svc", "12", ("vm:1:2", "[::1]:3:4"), "/h/svc/token")
  cluster.write(str(path))
  assert path.read_text() == ("SIDECAR_SERVICE=svc\nSIDECAR_SLURM_JOB=12\n"
                              "SIDECAR_HOSTS=vm:1:2,[::1]:3:4\nSIDECAR_TOKEN_FILE=/h/svc/token\n")
  assert rendezvous.ClusterFile.read(str(path)) == cluster
  path.write_text("SIDECAR_SERVICE=svc\n")
  with pytest.raises(sidecar.InvalidArgumentError,
                     match="lacks SIDECAR_SLURM_JOB, SIDECAR_HOSTS, SIDECAR_TOKEN_FILE"):
    rendezvous.ClusterFile.read(str(path))
  with pytest.raises(sidecar.InvalidArgumentError, match="sidecar slurm service --name NAME"):
    rendezvous.ClusterFile.read(str(tmp_path / "none.env"))


def test_a_slurm_task_finds_its_own_sidecar_by_node_and_local_id(tmp_path):
  d = str(tmp_path / "job")
  os.makedirs(os.path.join(d, rendezvous.HOSTS_DIR))
  rendezvous.write_json(os.path.join(d, rendezvous.JOB_FILE), {
      "job_id": "7", "num_hosts": 4, "hosts_per_node": 2, "tasks_per_node": 4})
  for h in range(4):  # 2 nodes x 2 sidecars, each serving 2 of its node's 4 tasks
    rendezvous.write_json(os.path.join(d, rendezvous.HOSTS_DIR, f"{h}.json"),
                          rendezvous.HostEntry(h, h // 2, f"n{h // 2}", f"n{h // 2}", 100 + h,
                                               200 + h, f"/tmp/{h}.sock", 1).to_dict())
  env = {"SIDECAR_SLURM_DIR": d, "SLURMD_NODENAME": "n1"}
  assert [discovery.own_address({**env, "SLURM_LOCALID": str(i)}) for i in range(4)] == [
      "unix:///tmp/2.sock", "unix:///tmp/2.sock", "unix:///tmp/3.sock", "unix:///tmp/3.sock"]
  assert discovery.own_address({"SLURMD_NODENAME": "n1", "SLURM_LOCALID": "0"}) is None
  found = discovery._from_job_dir(d, timeout=0)
  assert [(e.slice_id, e.host_id, e.host, e.port) for e in found] == [
      (0, 0, "n0", 100), (0, 1, "n0", 101), (1, 2, "n1", 102), (1, 3, "n1", 103)]
  os.remove(os.path.join(d, rendezvous.HOSTS_DIR, "3.json"))
  with pytest.raises(sidecar.DiscoveryError, match="Slurm job 7: 3 of 4 sidecars wrote"):
    discovery._from_job_dir(d, timeout=0)


def test_the_rendezvous_directory_defaults_under_sidecar_home(tmp_path):
  assert rendezvous.job_dir({"SIDECAR_HOME": str(tmp_path), "SLURM_JOB_ID": "5"}) == str(
      tmp_path / "slurm" / "5")
  assert rendezvous.job_dir({"SIDECAR_SLURM_DIR": "/x/y", "SLURM_JOB_ID": "5"}) == "/x/y"
  assert rendezvous.job_dir({}) is None
