"""Tier 3: a feed whose one batch can never fit its sidecar's arena (issue 55 item 5).

Its leaves may each fit where the batch does not: it used to wait 60 s (``ARENA_WAIT_S``)
for room that never comes, then fail without the size one batch needs. It fails before
any block of it is allocated, naming the batch's bytes, the arena's and the --shm-size
(LocalCluster's ``shm_size=``) that fits; a cluster of that size then feeds the batch.
"""

import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]

MiB = 1 << 20
NEVER = (r"feed 'wide_rows': one batch of this host's rows takes {total} of the arena "
         r"\({blocks}: one per leaf and row range\), and can never fit: {limit}\. One batch "
         r"needs --shm-size (\d+)MiB \(LocalCluster's shm_size=\"\1MiB\"\); a training loop "
         r"that holds a batch while the next 2 come \(prefetch=2\) needs about --shm-size "
         r"\d+MiB: 4 x {total}")


def jax_feed(c, ctl, *, rows, row_bytes, leaves):
  mesh = Mesh(np.array(jax.devices()[:c.num_hosts]), ("data",))
  return ctl.feed("wide_rows", kwargs={"row_bytes": row_bytes, "leaves": leaves},
                  global_batch_size=rows * c.num_hosts, sharding=NamedSharding(mesh, P("data")),
                  options=sidecar.FeedOptions(prefetch=2))


def torch_loader(c, ctl, *, rows, row_bytes, leaves):
  import sidecar.torch
  return iter(sidecar.torch.DataLoader("wide_rows", rows * c.num_hosts, controller=ctl,
                                       kwargs={"row_bytes": row_bytes, "leaves": leaves},
                                       prefetch=2))


CASES = {  # name: (hosts, shm_size, rows per host, bytes a row's leaf, leaves, what it passes)
    # 2 x 20 MiB: each leaf fits the 32 MiB arena, the batch does not (it waited 60 s).
    "two-leaves": (1, "32MiB", 8, 5 * MiB // 2, 2, "the arena is 32.0 MiB"),
    "one-leaf": (1, "32MiB", 8, 5 * MiB, 1, "the arena is 32.0 MiB"),
    # 30 MiB: under the arena, over a worker session's quota (90% of it, 28.8 MiB).
    "over-the-quota": (1, "32MiB", 6, 5 * MiB, 1,
                       r"a worker session may hold 28.8 MiB of the 32.0 MiB arena \(sidecar "
                       r"serve --session-quota\)"),
    # Each host's rows: 4 of 8 rows on each of 2 hosts, 2 x 20 MiB per host.
    "two-hosts": (2, "32MiB", 4, 5 * MiB, 2, "the arena is 32.0 MiB"),
}


def _connect(c, make):
  if make is jax_feed:
    return c.controller()
  import sidecar.torch
  return sidecar.torch.Controller(c.addresses, token=c.token)


@pytest.mark.parametrize("case", list(CASES))
def test_a_batch_that_can_never_fit_fails_at_once_naming_the_shm_size_that_fits(case):
  """Both a JAX feed and a torch DataLoader: refused on one cluster too small, then fed on
  one of the size the error names."""
  hosts, shm_size, rows, row_bytes, leaves, limit = CASES[case]
  total = rows * row_bytes * leaves
  pattern = NEVER.format(total=re.escape(f"{total / MiB:.1f} MiB"),
                         blocks=f"{leaves} blocks?", limit=limit)
  fits = set()
  with sidecar.testing.LocalCluster(num_hosts=hosts, devices_per_host=1, shm_size=shm_size,
                                    imports=["tests.support.feed_fns"]) as c:
    for make in (jax_feed, torch_loader):
      with _connect(c, make) as ctl:
        with pytest.raises(sidecar.ResourceExhaustedError, match=pattern) as e:
          next(make(c, ctl, rows=rows, row_bytes=row_bytes, leaves=leaves))
        # Refused before any block of it was allocated: no wait for room ("waited N s").
        assert "waited" not in str(e.value), make.__name__
        assert all(s.arena_used == 0 for s in ctl.status()), make.__name__
      fits.add(re.search(pattern, str(e.value)).group(1) + "MiB")
  (fit,) = fits  # both name the same size
  for make in (jax_feed, torch_loader):  # a cluster each: one batch is all that fits
    with sidecar.testing.LocalCluster(num_hosts=hosts, devices_per_host=1, shm_size=fit,
                                      imports=["tests.support.feed_fns"]) as c:
      with _connect(c, make) as ctl:
        batch = next(make(c, ctl, rows=rows, row_bytes=row_bytes, leaves=leaves))
        assert sorted(batch) == [f"x{k}" for k in range(leaves)], make.__name__
        assert tuple(batch["x0"].shape) == (rows * hosts, row_bytes), make.__name__
        del batch


POOL = """\
tenants:
  - {name: carol, token_file: carol.token, arena_ceiling: 16MiB}
"""


def test_a_pool_tenants_batch_over_its_part_fails_at_once_naming_its_part(tmp_path, monkeypatch):
  from sidecar._src.core import env as env_lib
  (tmp_path / "carol.token").write_text("token-of-carol")
  (tmp_path / "pool.yaml").write_text(POOL)
  for name in ("carol.token", "pool.yaml"):
    (tmp_path / name).chmod(0o600)
  monkeypatch.setenv(env_lib.TOKEN, "token-of-carol")  # the Worker attaches as carol
  with sidecar.testing.LocalCluster(1, 1, shm_size="64MiB", pool=str(tmp_path / "pool.yaml"),
                                    imports=["tests.support.feed_fns"]) as c:
    with c.controller(token="token-of-carol") as ctl:
      # 2 x 10 MiB in carol's 16 MiB: the 64 MiB arena is not what it passes.
      with pytest.raises(sidecar.ResourceExhaustedError,
                         match=r"feed 'wide_rows': one batch of this host's rows takes 20.0 MiB "
                               r"of the arena \(2 blocks: .*\), and can never fit: tenant "
                               r"'carol': .* cannot fit its quota \(arena_ceiling=16.0 MiB .*raise "
                               r"its arena_ceiling in the pool file.*\(one batch needs 20MiB of "
                               r"its part\)") as e:
        next(jax_feed(c, ctl, rows=4, row_bytes=5 * MiB // 2, leaves=2))
      assert "waited" not in str(e.value)


def test_a_loop_that_holds_one_batch_gets_the_next_where_two_fit():
  # 12 MiB batches, 28.8 MiB a session may hold: the trainer's batch and the next fit. JAX
  # let go of a dropped batch's arena views only at its next call into XLA (or a garbage
  # collection): a loop that made none held two batches while it waited for a third, and
  # failed after 60 s. The feed lets them go before it waits.
  import gc
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="32MiB",
                                    imports=["tests.support.feed_fns"]) as c:
    with c.controller() as ctl:
      mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
      gc.disable()  # no collection frees them either
      try:
        with ctl.feed("wide_rows", kwargs={"row_bytes": MiB}, global_batch_size=12,
                      sharding=NamedSharding(mesh, P("data")),
                      options=sidecar.FeedOptions(prefetch=1)) as feed:
          seen = [int(np.asarray(batch["x0"])[0, 0]) for _, batch in zip(range(6), feed)]
      finally:
        gc.enable()
  assert seen == [0, 12, 24, 36, 48, 60]
