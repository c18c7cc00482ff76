"""``sidecar status``'s table, from replies and errors."""

import pytest

from sidecar._src.controller import status as status_lib

pytestmark = pytest.mark.unit


def test_status_shows_the_whole_first_line_of_an_error():
  error = ConnectionError("failed to connect to all addresses; last error: UNKNOWN: "
                          "ipv4:127.0.0.1:1: Failed to connect to remote host: Connection refused\n"
                          "second line")
  row = status_lib.format_table([("127.0.0.1:1", error)]).splitlines()[1]
  assert row.endswith("UNREACHABLE: failed to connect to all addresses; last error: UNKNOWN: "
                      "ipv4:127.0.0.1:1: Failed to connect to remote host: Connection refused")
