"""``sidecar stalls --stacks`` (tools/stalls.py's probe) acts only on a pid it may: one the
sidecar had from the kernel, of the caller's own tenant, and named in this process's boot
and PID namespace (issue 69, item 2). Tier 1: Status responses built here."""

import pytest

from sidecar._src.arena import shm
from sidecar._src.tools import stalls
from sidecar._src.wire import ipc
from sidecar._src.wire.protocol import pb

pytestmark = pytest.mark.unit

HERE = (shm.boot_id(), ipc.pid_namespace())


def status(*, tenant="", trainer_tenant="", pid=4321, verified=True, boot=HERE[0],
           namespace=HERE[1]):
  t = pb.TrainerStatus(pid=pid, pid_verified=verified, tenant=trainer_tenant, stalled=True)
  got = pb.StatusResponse(tenant=tenant, trainers=[t],
                          identity=pb.HostIdentity(boot_id=boot, pid_namespace=namespace))
  return t, got


def test_a_verified_pid_of_the_callers_tenant_here_may_be_signalled():
  assert HERE[0] and HERE[1], "this test needs /proc (Linux)"
  assert stalls._unsignalled(*status(), HERE) is None
  assert stalls._unsignalled(*status(tenant="alice", trainer_tenant="alice"), HERE) is None


@pytest.mark.parametrize("kw,why", [
    ({"verified": False}, "its pid is unverified"),  # an older sidecar's: the claim
    ({"verified": False, "pid": 0}, "its pid is unverified"),  # another PID namespace's
    ({"pid": -77}, "its pid is unverified"),
    ({"pid": 2**62}, "its pid is unverified"),
    ({"tenant": "alice", "trainer_tenant": "bob"},
     "it is tenant 'bob''s trainer, and this token is tenant 'alice''s"),
    ({"trainer_tenant": "bob"}, "it is tenant 'bob''s trainer, and this token is no tenant's"),
    ({"boot": "another-kernel"}, "its pid 4321 is the sidecar's view, from another kernel"),
    ({"namespace": "pid:[1]"}, "from another PID namespace than this process's"),
    ({"namespace": ""}, "from another PID namespace than this process's"),
], ids=["unverified", "unverified-0", "negative", "huge", "another-tenant", "operator",
        "another-boot", "another-pid-namespace", "namespace-unknown"])
def test_no_signal_where_the_pid_is_not_verified_ours_and_here(kw, why):
  said = stalls._unsignalled(*status(**kw), HERE)
  assert said is not None and why in said
