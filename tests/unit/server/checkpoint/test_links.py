"""Where a sidecar's replica targets are: its own --replica-hosts, never a client's word
(issue 42 item 4). Real files and a real rendezvous directory; no sockets."""

import pytest

from sidecar._src.ckptfmt.records import ReplicaTarget
from sidecar._src.core import errors, rendezvous
from sidecar._src.server.checkpoint import links as links_lib

pytestmark = pytest.mark.unit


def test_a_host_id_resolves_to_its_configured_address():
  hosts = links_lib.ReplicaHosts(("10.0.0.1:8490", "unix:/run/s1.sock", "[::1]:8490"))
  assert hosts.target(1, own=0) == ReplicaTarget(1, "unix:/run/s1.sock")
  assert hosts.target(2, own=0).address == "[::1]:8490"
  for bad, why in ((3, "is not one of them"), (-1, "is not one of them"),
                   (True, "is not one of them"), ("1", "is not one of them"),
                   (0, "is this sidecar itself")):
    with pytest.raises(errors.InvalidArgumentError, match=why) as info:
      hosts.target(bad, own=0)
    assert (f"replica target host {bad!r} " in str(info.value)
            and "host 0 10.0.0.1:8490, host 1 unix:/run/s1.sock, host 2 [::1]:8490"
            in str(info.value))
  with pytest.raises(errors.InvalidArgumentError, match=r"none \(--replica-hosts is empty\)"):
    links_lib.ReplicaHosts().target(1, own=0)
  with pytest.raises(errors.InvalidArgumentError, match="--replica-hosts entry 'nohost'"):
    links_lib.ReplicaHosts(("nohost",))


def test_the_file_is_read_when_a_link_is_made(tmp_path):
  path = tmp_path / "replica-hosts"
  hosts = links_lib.ReplicaHosts(file=str(path))  # written once the sidecars serve
  with pytest.raises(errors.InvalidArgumentError, match="cannot read --replica-hosts-file"):
    hosts.target(1, own=0)
  path.write_text("127.0.0.1:5001\n127.0.0.1:5002\n")
  assert hosts.target(1, own=0) == ReplicaTarget(1, "127.0.0.1:5002")
  path.write_text("127.0.0.1:5001,127.0.0.1:6002")  # a host back on a new port
  assert hosts.target(1, own=0).address == "127.0.0.1:6002"


def test_a_slurm_jobs_directory_lists_the_entries_its_sidecars_wrote(tmp_path):
  (tmp_path / rendezvous.HOSTS_DIR).mkdir()
  for h, node in ((0, "node-a"), (2, "node-b")):
    rendezvous.write_json(str(tmp_path / rendezvous.HOSTS_DIR / f"{h}.json"), rendezvous.HostEntry(
        host_id=h, slice_id=0, node=node, address=f"10.0.0.{h + 1}", port=8490 + h,
        health_port=8491, socket="/tmp/x.sock", pid=1).to_dict())
  hosts = links_lib.ReplicaHosts(file=str(tmp_path))
  assert hosts.target(2, own=0) == ReplicaTarget(2, "10.0.0.3:8492")
  with pytest.raises(errors.InvalidArgumentError, match="replica target host 1 is not one"):
    hosts.target(1, own=0)  # not serving yet: no entry
