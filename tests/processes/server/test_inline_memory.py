"""Tier 3: what one large inline call (no arena) costs a real ``sidecar serve`` in peak
RSS, as a ratio of its payload (issue 37: the target was 3x; issue 42: at most 2x; issue
54: under 1.8x with a margin).

gRPC's own receipt of a unary message costs 3.0x its size (a plain ``grpc.server``
measured 2.89-3.00x for 128 MiB, grpcio 1.85: its slices, a bytearray, then bytes of
it), its send of one 2x (the message's bytes, then its copy): a call of
``calls.PIECES_FROM`` bytes or more goes in parts (CallParts), copied into one buffer its
arrays view, and its response comes back in parts cut from the result's arrays. Memory,
not time, is asserted; one cluster serves every case."""

import time

import numpy as np
import pytest

import sidecar

pytestmark = pytest.mark.processes

PAYLOAD = 128 << 20
# Issue 54's target, 1.8x (issue 42's was 2x): its buffer (1x), the parts gRPC holds in
# flight and the heap's slack, both larger when load slows the sidecar's reading.
# 1.02-1.26x in 24 calls of benchmarks.inline_memory, alone and beside two busy-loop
# processes; 1.42x once in CI beside the suite's other worker (1.3x was asserted then);
# one message of it cost 3.0x before parts.
ARGUMENT_BOUND = 1.8
# echo: the result is the argument's buffer, sent in parts cut from it, so it costs what
# the argument costs: 1.02-1.21x in 12 calls of benchmarks.inline_memory beside two test
# suites, alone and beside two more busy-loop processes. With a one-message response it
# cost 1.94-2.14x (its bytes, then gRPC's copy as it sent them), 3.0x before parts.
ECHO_BOUND = ARGUMENT_BOUND
# add: the argument's buffer and the new result both live while the function runs, 2x
# in any process that computes ``a + b``; the response in parts adds nothing above it
# (1.97-2.09x in the same 12 calls; 1.94-2.31x with a one-message response, whose bytes
# and gRPC's copy came after the argument's buffer was gone). Below 1.8x it cannot go:
# what is asserted is that no third copy is made, with the load's slack as margin.
ADD_BOUND = 2.4
@pytest.fixture(scope="module")
def cluster():
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="16MiB",
                                    imports=["tests.support.sidecar_fns"],
                                    configure_jax=False) as c:
    yield c


def peak_growth(pid: int, call) -> float:
  """How far ``call()`` raises process ``pid``'s peak RSS above its RSS before, in bytes."""
  time.sleep(0.2)  # the previous call's memory is back
  with open(f"/proc/{pid}/clear_refs", "w") as f:
    f.write("5")  # the peak RSS starts afresh from the RSS now

  def hwm() -> int:
    with open(f"/proc/{pid}/status") as f:
      return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) << 10

  before = hwm()
  call()
  return hwm() - before


def test_an_inline_argument_costs_its_size_once(cluster):
  """size_of: the argument arrives in parts into one buffer, and is a view of it; 3.0-3.6x
  of 128 MiB before issue 37 (the freed chunks stayed under it), 3.0x before issue 42
  (gRPC's receipt of one message)."""
  with cluster.controller(attach=False, connect_timeout=10) as ctl:
    assert ctl.call("size_of", args=(np.ones(1 << 20, np.uint8),)) == [1 << 20]  # warm
    big = np.ones(PAYLOAD, np.uint8)
    grown = peak_growth(cluster.pid(0), lambda: ctl.call("size_of", args=(big,), timeout=120))
  assert grown <= ARGUMENT_BOUND * PAYLOAD, f"peak RSS +{grown / 2**20:.0f} MiB for a 128 MiB call"


def test_a_new_result_costs_no_more_than_the_function_holds(cluster):
  """add: 128 MiB in, a new 128 MiB array back: the argument and the result (2x, the
  function's own), and no copy of the result beside it."""
  with cluster.controller(attach=False, connect_timeout=10) as ctl:
    ctl.call("add", args=(np.ones(1 << 20, np.uint8),))  # warm
    big = np.arange(PAYLOAD, dtype=np.uint8)
    out: list = []
    grown = peak_growth(cluster.pid(0), lambda: out.append(
        ctl.call("add", args=(big, 1), timeout=120)))
    np.testing.assert_array_equal(out[0][0], big + 1)
  assert grown <= ADD_BOUND * PAYLOAD, f"peak RSS +{grown / 2**20:.0f} MiB for a 128 MiB add"


def test_an_inline_argument_and_result_cost_their_size_once(cluster):
  """echo: 128 MiB in and back. The result's array was copied four times on its way to
  gRPC (tobytes, the Array, the Value in the CallResponse, the serialization): 6.0x of
  the argument's size before issue 37; written once into gRPC's bytes since
  (UnaryCalls.run_serialized, which gRPC's Call sends as it is): 3.0x, gRPC's receipt of
  the argument, before issue 42; 2.0x, the response's bytes and gRPC's copy, before issue
  54 (UnaryCalls.run_in_pieces: the response in parts, cut from the argument's buffer)."""
  with cluster.controller(attach=False, connect_timeout=10) as ctl:
    ctl.call("echo", args=(np.ones(1 << 20, np.uint8),))  # warm
    big = np.arange(PAYLOAD, dtype=np.uint8)
    out: list = []
    grown = peak_growth(cluster.pid(0), lambda: out.extend(
        ctl.call("echo", args=(big,), timeout=120)))
    np.testing.assert_array_equal(out[0], big)
  assert grown <= ECHO_BOUND * PAYLOAD, f"peak RSS +{grown / 2**20:.0f} MiB for a 128 MiB echo"
