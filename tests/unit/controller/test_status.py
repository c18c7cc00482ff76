"""``sidecar status``'s table, from replies and errors."""

import pytest

from sidecar._src.controller import status as status_lib
from sidecar._src.wire.protocol import pb

pytestmark = pytest.mark.unit


def test_status_shows_the_whole_first_line_of_an_error():
  error = ConnectionError("failed to connect to all addresses; last error: UNKNOWN: "
                          "ipv4:127.0.0.1:1: Failed to connect to remote host: Connection refused\n"
                          "second line")
  row = status_lib.format_table([("127.0.0.1:1", error)]).splitlines()[1]
  assert row.endswith("UNREACHABLE: failed to connect to all addresses; last error: UNKNOWN: "
                      "ipv4:127.0.0.1:1: Failed to connect to remote host: Connection refused")


def test_status_names_the_steps_the_sidecars_are_committing():
  reply = pb.StatusResponse(identity=pb.HostIdentity(host_id=1), checkpoints=[
      pb.CheckpointStatus(directory="/ck", ram_steps=[4], writing=[6], committing=[5, 6],
                          uncommitted=[3], total_bytes=1 << 20)])
  line = status_lib.format_checkpoints([("unix:/h1", reply)])
  assert line.endswith("committing (the sidecars'): [5, 6]  staged, not committed: [3]"), line
