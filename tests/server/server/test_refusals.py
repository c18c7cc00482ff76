"""Tier 2: refusals that say who was refused, in the mode the sidecar runs in (issue 42
item 8): the sidecars' own replica link is told it is the link, not a trainer."""

import pytest

from sidecar._src.arena.worker import Worker
from sidecar._src.ckptfmt.records import ReplicaTarget
from sidecar._src.core import errors
from sidecar._src.server.checkpoint.links import ReplicaLink
from tests.conftest import PEER_TOKEN
from tests.support.pool_files import write_pool

pytestmark = pytest.mark.server


@pytest.mark.parametrize("mode", ["token", "pool"])
def test_a_replica_link_with_another_peer_token_is_told_it_is_the_sidecars_link(
    make_server, tmp_path, mode):
  kw = {"token": "s3cret"} if mode == "token" else {"pool": write_pool(tmp_path)}
  server = make_server(**kw)
  peer = ReplicaTarget(host_id=0, address=f"127.0.0.1:{server.port}")
  with pytest.raises(errors.AuthenticationError, match=(
      r"another sidecar's replica link \(the sidecars' own, its handshake carries "
      r"'sidecar-peer'\) presented no token this sidecar takes: .*give every sidecar the "
      r"same --peer-token-file")):
    ReplicaLink(peer, token="not-" + PEER_TOKEN, replica_token="not-" + PEER_TOKEN, timeout=10)
  with ReplicaLink(peer, token=kw.get("token", PEER_TOKEN), replica_token=PEER_TOKEN,
                   timeout=10, shared_memory=False) as link:  # the job's own peer token
    assert not link.same_machine


def test_a_pool_sidecars_worker_socket_names_its_pool_file_and_the_sidecars_link(make_server,
                                                                                 tmp_path):
  server = make_server(pool=write_pool(tmp_path))
  with pytest.raises(errors.AuthenticationError, match=(
      rf"serves a pool of tenants \(the pool file {tmp_path}/pool.yaml\): a worker must present "
      r"its tenant's token at attach.*If this is the sidecars' own replica link .*it is that "
      r"link this pool sidecar refused, not a trainer")):
    Worker(server.options.socket_path, token=None, timeout=10)
