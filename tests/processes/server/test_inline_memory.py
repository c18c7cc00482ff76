"""Tier 3: what one large inline call (no arena) costs a real ``sidecar serve`` in peak
RSS, as a ratio of its payload (issue 37: the target was 3x; issue 42: at most 2x).

gRPC's own receipt of a unary message costs 3.0x its size (a plain ``grpc.server``
measured 2.89-3.00x for 128 MiB, grpcio 1.85: its slices, a bytearray, then bytes of
it): a call of ``calls.PARTS_FROM`` bytes or more goes in parts (CallParts), copied into
one buffer its arrays view. Memory, not time, is asserted; one cluster serves every case."""

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
# The argument's buffer and the response's bytes (the result viewing the argument is
# copied once, into them), then those bytes and gRPC's copy of them as it sends them: a
# unary response costs twice its size however it is made. 2.00-2.02x measured alone,
# 2.11x once beside the suite's other worker (the allocator's spare pages); before parts,
# 3.0x. A result that is a new array (add) measured the same, 1.98-2.14x (its buffer, the
# result and the response's bytes would be 3x at once: why they are not is not found yet).
ECHO_BOUND = 2.25


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


def test_a_new_result_is_encoded_after_the_arguments_buffer_is_gone(cluster):
  """add: 128 MiB in, a new 128 MiB array back, within what an echo costs."""
  with cluster.controller(attach=False, connect_timeout=10) as ctl:
    ctl.call("add", args=(np.ones(1 << 20, np.uint8),))  # warm
    big = np.arange(PAYLOAD, dtype=np.uint8)
    out: list = []
    grown = peak_growth(cluster.pid(0), lambda: out.append(
        ctl.call("add", args=(big, 1), timeout=120)))
    np.testing.assert_array_equal(out[0][0], big + 1)
  assert grown <= ECHO_BOUND * PAYLOAD, f"peak RSS +{grown / 2**20:.0f} MiB for a 128 MiB add"


def test_an_inline_argument_and_result_cost_at_most_twice_their_size(cluster):
  """echo: 128 MiB in and back. The result's array was copied four times on its way to
  gRPC (tobytes, the Array, the Value in the CallResponse, the serialization): 6.0x of
  the argument's size before issue 37; written once into gRPC's bytes since
  (UnaryCalls.run_serialized, which gRPC's Call sends as it is): 3.0x, gRPC's receipt of
  the argument, before issue 42."""
  with cluster.controller(attach=False, connect_timeout=10) as ctl:
    ctl.call("echo", args=(np.ones(1 << 20, np.uint8),))  # warm
    big = np.arange(PAYLOAD, dtype=np.uint8)
    out: list = []
    grown = peak_growth(cluster.pid(0), lambda: out.extend(
        ctl.call("echo", args=(big,), timeout=120)))
    np.testing.assert_array_equal(out[0], big)
  assert grown <= ECHO_BOUND * PAYLOAD, f"peak RSS +{grown / 2**20:.0f} MiB for a 128 MiB echo"
