"""A torch rank that saves and restores a state dict through the sidecars with DCP.

Run under ``sidecar launch --torch``::

  python -m tests.support.torch_ckpt DIRECTORY save|restore

``save``: each rank's part of a state dict (a row-sharded DTensor-free split by hand:
plain tensors, bf16, a scalar, a non-tensor value, optimizer-like nesting) goes through
``dcp.save`` and ``dcp.async_save`` with ``sidecar.torch.StorageWriter``; then the
``.distcp`` files are overwritten with garbage (rank 0) and every rank restores from the
sidecars' RAM tier with ``StorageReader``, bit-exact. ``restore`` (a new job, new
sidecars): restores from storage. Prints JSON lines.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import sidecar.torch


def state(rank: int, world: int, step: int) -> dict:
  g = torch.Generator().manual_seed(step)
  return {"model": {"w": torch.randn(8, 4, generator=g), "b": torch.randn(4, generator=g),
                    "h": torch.randn(6, generator=g).to(torch.bfloat16)},
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
  if isinstance(a, torch.Tensor):
    return a.dtype == b.dtype and torch.equal(a, b)
  if isinstance(a, dict):
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
  if isinstance(a, list):
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
  return a == b


def main() -> None:
  directory, mode = sys.argv[1], sys.argv[2]
  ctl = sidecar.torch.connect()
  rank, world = dist.get_rank(), dist.get_world_size()
  say = lambda **kw: print(json.dumps({"rank": rank, **kw}), flush=True)
  if mode == "save":
    sd = state(rank, world, 1)
    dcp.save(sd, storage_writer=sidecar.torch.StorageWriter(f"{directory}/1", controller=ctl))
    say(saved=1)
    sd2 = state(rank, world, 2)
    future = dcp.async_save(sd2, storage_writer=sidecar.torch.StorageWriter(
        f"{directory}/2", controller=ctl))
    sd2_copy = {k: v for k, v in sd2.items()}
    future.result()
    say(saved=2)
    dist.barrier()
    if rank == 0:  # the files are corrupt now: only the RAM tier has the step
      for name in os.listdir(f"{directory}/2"):
        if name.endswith(".distcp"):
          with open(f"{directory}/2/{name}", "r+b") as f:
            f.write(b"\xff" * os.path.getsize(f"{directory}/2/{name}"))
    dist.barrier()
    target = zeros_like(state(rank, world, 2))
    reader = sidecar.torch.StorageReader(f"{directory}/2", controller=ctl)
    dcp.load(target, storage_reader=reader)
    say(restored=2, same=same(target, sd2_copy), tier="ram", stats=reader.last_stats)
  else:
    target = zeros_like(state(rank, world, 1))
    dcp.load(target, storage_reader=sidecar.torch.StorageReader(f"{directory}/1",
                                                                  controller=ctl))
    say(restored=1, same=same(target, state(rank, world, 1)), tier="storage")
  dist.barrier()
  ctl.close()


if __name__ == "__main__":
  main()
