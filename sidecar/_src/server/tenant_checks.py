"""Where a pool's tenants meet the parts that run their work: the allowlists of calls and
each tenant's own checkpoint roots (``tenants.py`` holds the pool; these only enforce it).
"""

from __future__ import annotations

import os

from sidecar._src.core import errors
from sidecar._src.server import tenants as tenants_lib
from sidecar._src.server.calls import Runner
from sidecar._src.server.checkpoint.host import CheckpointHost
from sidecar._src.user import registry as registry_lib
from sidecar._src.wire.protocol import pb


class TenantRunner(Runner):
  """A :class:`Runner` that runs a function only if the tenant it runs for
  (``tenants.CURRENT``, set by the way in) may: its ``functions`` allowlist."""

  def __init__(self, *, tenancy: tenants_lib.Tenancy, **kwargs):
    super().__init__(**kwargs)
    self._tenancy = tenancy

  def prepare(self, request: pb.CallRequest, kind: str = registry_lib.FUNCTION, *,
              views: list[memoryview] | None = None):
    tenant = tenants_lib.CURRENT.get()
    self._tenancy.check_allowed(tenant, kind, request.name)
    self._tenancy.check_worker(tenant, request.worker_session)
    return super().prepare(request, kind, views=views)


class TenantCheckpoints(CheckpointHost):
  """A :class:`CheckpointHost` where a tenant with ``checkpoint_roots`` opens checkpoint
  directories under those only (the sidecar's roots still hold for everyone)."""

  def __init__(self, host_id: int, *, tenancy: tenants_lib.Tenancy, **kwargs):
    super().__init__(host_id, **kwargs)
    self._tenancy = tenancy

  def open_for(self, client: str, directory: str) -> None:
    t = self._tenancy.tenant(client)
    if t is not None and t.checkpoint_roots and isinstance(directory, str):
      resolved = os.path.realpath(directory)
      if not any(resolved == r or resolved.startswith(r.rstrip(os.sep) + os.sep)
                 for r in t.checkpoint_roots):
        raise errors.PermissionDeniedError(
            f"tenant {t.name!r} may checkpoint only under its checkpoint_roots "
            f"({', '.join(t.checkpoint_roots)}, {self._tenancy.where(t.name)}), not in "
            f"{directory!r:.200}; checkpoint there, or add the directory to its roots")
    super().open_for(client, directory)

  def release_ram(self, tenant: str) -> int:
    """Drops the committed RAM-tier steps (own shards and replicas) of the checkpoint
    directories tenant ``tenant`` opened here: its job left (``ram_keep``). Their blocks go
    back as their views die; the durable steps stay. Returns how many steps went.

    Uses the RAM tier's own ``drop`` under its lock (no change to ram_tier.py)."""
    mine = {os.path.realpath(d) for d in self.opened_by(tenant)}
    tier = self.tier
    with tier.lock:
      steps = {(s.directory, s.step) for s in tier.steps.values()
               if s.committed and os.path.realpath(s.directory) in mine}
      steps |= {(r.directory, r.step) for r in tier.replicas.values()
                if r.committed and os.path.realpath(r.directory) in mine}
      for directory, step in steps:
        tier.drop(directory, step)
    return len(steps)
