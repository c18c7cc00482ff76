"""A torch rank that saves and restores a state dict through the sidecars with DCP.

Run under ``sidecar launch --torch``::

  python -m tests.support.torch_ckpt DIRECTORY save|die|restore|elastic|shrink

The state dict: plain tensors, a non-contiguous view, bf16, a scalar, a non-tensor value,
optimizer-like nesting, a row-sharded DTensor over all ranks (as FSDP2's) and one entry
per rank. ``save`` (2 ranks): step 1 through ``dcp.save`` and step 2 through
``dcp.async_save`` with ``sidecar.torch.StorageWriter``; then the ``.distcp`` files of
step 2 are overwritten with garbage (rank 0) and every rank restores it from the
sidecars' RAM tier with ``StorageReader``, bit-exact. ``die`` (2 ranks): rank 1 is killed
in the middle of saving step 4, once its part is in its sidecar, before the commit.
``restore`` (a new job, new
sidecars, another world size): a state dict with a key the checkpoint lacks is refused
(DCP's error); the steps a Checkpointer lists (not 4); step 1 restores from storage, the
DTensor resharded; step 3 is saved by ranks sharing a sidecar, copied aside (``3.copy``,
for stock DCP) and restored from the RAM tier with its files corrupt. ``elastic`` (under
``--elastic --in-place``): the first
attempt saves step 1, deletes its directory and rank 1 dies; the restarted job restores
step 1 from the sidecars' RAM tiers alone. ``shrink`` (under ``--elastic``): step 1 is saved
with ``replicas=1``, its directory deleted, and rank 1 SIGKILLs its own sidecar; the job
restarted on host 0 alone restores all of step 1, rank 1's part from its replica on host 0.
Prints JSON lines.
"""

import json
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import sidecar.torch


def state(rank: int, world: int, step: int, mesh=None) -> dict:
  """Rank ``rank``'s state dict of ``world`` ranks; with no ``mesh``, the sharded entry whole."""
  g = torch.Generator().manual_seed(step)
  sharded = torch.randn(16, 3, generator=g)  # rows split over the ranks, as FSDP2's
  if mesh is not None:
    sharded = DTensor.from_local(sharded.chunk(world)[rank].clone(), mesh, [Shard(0)],
                                 run_check=False)
  return {"model": {"w": torch.randn(8, 4, generator=g), "b": torch.randn(4, generator=g),
                    "h": torch.randn(6, generator=g).to(torch.bfloat16),
                    "wt": torch.randn(4, 8, generator=g).t(),  # not contiguous
                    "sharded": sharded},
          "optim": {"state": {0: {"exp_avg": torch.randn(8, 4, generator=g)}},
                    "param_groups": [{"lr": 0.1 * step, "params": [0]}]},
          "step": torch.tensor(step), "extra": {"epoch": step, "name": "run"},
          f"rank{rank}": torch.full((3,), float(rank + 10 * step))}


def zeros_like(sd):
  if isinstance(sd, torch.Tensor):
    return torch.zeros_like(sd)
  if isinstance(sd, dict):
    return {k: zeros_like(v) for k, v in sd.items()}
  if isinstance(sd, list):
    return [zeros_like(v) for v in sd]
  return sd


def same(a, b) -> bool:
  if isinstance(a, DTensor):
    return (isinstance(b, DTensor) and a.placements == b.placements
            and same(a.to_local(), b.to_local()))
  if isinstance(a, torch.Tensor):
    return a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b)
  if isinstance(a, dict):
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
  if isinstance(a, list):
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
  return a == b


def corrupt(directory: str) -> None:
  """Overwrites every ``.distcp`` file of ``directory`` with 0xff: only RAM tiers have it."""
  for name in os.listdir(directory):
    if name.endswith(".distcp"):
      with open(f"{directory}/{name}", "r+b") as f:
        f.write(b"\xff" * os.path.getsize(f"{directory}/{name}"))


def main() -> None:
  directory, mode = sys.argv[1], sys.argv[2]
  ctl = sidecar.torch.connect()
  if not dist.is_initialized():  # one rank (connect() starts a group for several only)
    dist.init_process_group("gloo")
  rank, world = dist.get_rank(), dist.get_world_size()
  mesh = init_device_mesh("cpu", (world,))
  say = lambda **kw: print(json.dumps({"rank": rank, **kw}), flush=True)
  writer = lambda step: sidecar.torch.StorageWriter(f"{directory}/{step}", controller=ctl)
  reader = lambda step: sidecar.torch.StorageReader(f"{directory}/{step}", controller=ctl)
  if mode == "save":
    dcp.save(state(rank, world, 1, mesh), storage_writer=writer(1))
    say(saved=1)
    sd2 = state(rank, world, 2, mesh)
    future = dcp.async_save(sd2, storage_writer=writer(2))
    future.result()
    say(saved=2)
    dist.barrier()
    if rank == 0:
      corrupt(f"{directory}/2")
    dist.barrier()
    target, r = zeros_like(state(rank, world, 2, mesh)), reader(2)
    dcp.load(target, storage_reader=r)
    say(restored=2, same=same(target, sd2), tier="ram", stats=r.last_stats)
  elif mode == "die":
    class Dies(sidecar.torch.StorageWriter):
      def write_data(self, plan, planner):
        out = super().write_data(plan, planner)
        if rank == 1:
          os._exit(9)  # as a SIGKILL: staged, and gone before the commit
        return out
    dcp.save(state(rank, world, 4, mesh), storage_writer=Dies(f"{directory}/4", controller=ctl))
    say(saved=4)  # not reached: rank 1's death ends the job
  elif mode == "elastic":
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if restart == 0:
      dcp.save(state(rank, world, 1, mesh), storage_writer=writer(1))
      dist.barrier()
      if rank == 0:
        shutil.rmtree(f"{directory}/1")  # only the RAM tiers have it now
      dist.barrier()
      if rank == 1:
        os._exit(3)  # the launcher restarts every rank beside the same sidecars
      dist.barrier()  # rank 0 waits here for the launcher's SIGTERM
    target, r = zeros_like(state(rank, world, 1, mesh)), reader(1)
    dcp.load(target, storage_reader=r)
    say(restored=1, restart=restart, same=same(target, state(rank, world, 1, mesh)),
        stats=r.last_stats)
  elif mode == "shrink":
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if restart == 0:
      w = sidecar.torch.StorageWriter(f"{directory}/1", replicas=1, controller=ctl)
      dcp.save(state(rank, world, 1, mesh), storage_writer=w)
      if rank == 0:  # the coordinator replicated every part: apart from the commit
        w.replicated.result(timeout=60)
        say(replicated=w.last_stats.get("replicated_bytes", 0))
      dist.barrier()
      if rank == 0:
        shutil.rmtree(f"{directory}/1")  # only the RAM tiers and the replicas have it now
      dist.barrier()
      if rank == 1:  # its own sidecar, with its part of step 1: the job goes on without it
        os.kill(next(h.pid for h in ctl.hosts if h.host_id == ctl.local_hosts[0]), 9)
        time.sleep(600)  # both wait for the launcher's SIGTERM
      dist.barrier()
    # One rank now, beside host 0: rank 1's entry of the 2-rank save, too, is its part.
    target = {**zeros_like(state(rank, world, 1, mesh)), "rank1": torch.zeros(3)}
    r = reader(1)
    dcp.load(target, storage_reader=r)
    want = {**state(rank, world, 1, mesh), "rank1": torch.full((3,), 11.0)}
    say(restored=1, restart=restart, world=world, same=same(target, want), stats=r.last_stats)
  else:
    say(steps=sidecar.torch.Checkpointer(directory, controller=ctl).all_steps())
    # The saving job had 2 ranks: the entries of ranks 2.. are not in step 1.
    own = lambda sd: {k: v for k, v in sd.items()
                      if not (k.startswith("rank") and int(k[4:]) >= 2)}
    bad = zeros_like(own(state(rank, world, 1, mesh)))
    bad["model"]["missing"] = torch.zeros(2)
    try:
      dcp.load(bad, storage_reader=reader(1))
      say(mismatch=None)
    except CheckpointException as e:  # a BaseException: DCP's errors from every rank
      say(mismatch=f"{type(e).__name__}: {e}"[:2000])
    target = zeros_like(own(state(rank, world, 1, mesh)))
    dcp.load(target, storage_reader=reader(1))
    say(restored=1, same=same(target, own(state(rank, world, 1, mesh))), tier="storage")
    sd3 = state(rank, world, 3, mesh)
    dcp.save(sd3, storage_writer=writer(3))
    dist.barrier()
    if rank == 0:
      shutil.copytree(f"{directory}/3", f"{directory}/3.copy")
      corrupt(f"{directory}/3")
    dist.barrier()
    target, r = zeros_like(state(rank, world, 3, mesh)), reader(3)
    dcp.load(target, storage_reader=r)
    say(restored=3, same=same(target, sd3), tier="ram", stats=r.last_stats)
  dist.barrier()
  ctl.close()


if __name__ == "__main__":
  main()
