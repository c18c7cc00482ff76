"""A complete PyTorch job through the sidecars: DDP on gloo, fed, checkpointed, resumed.

Run it as 2 ranks beside 2 sidecars that serve scikit-learn's handwritten digits::

  sidecar launch --torch --hosts 2 --import pipelines.digits_iterable \\
      -- python examples/torch_train.py

(``pip install 'colocated-sidecar[torch,digits]'``: no JAX in any process; ``pipelines.digits``
serves the same data through Grain, which needs JAX). Each rank reads its half of every global
batch of 64 digits from its own sidecar (``sidecar.torch.DataLoader``: tensors over the
sidecar's arena, no copy), trains a small MLP under DDP, and every 20 steps saves the
model, the optimizer and the loader's position with ``sidecar.torch.Checkpointer``: DCP
checkpoints, each stalling the step for one copy into the arena, that stock
``torch.distributed.checkpoint`` reads as they are. Run it again with a larger
``--steps`` and it resumes from the last step saved, with the data where it stopped. With
torchrun, start the sidecars with ``sidecar local`` and set ``SIDECAR_HOSTS`` and each
rank's ``SIDECAR_ADDRESS`` (README, "PyTorch").

Options: ``--steps N`` (default 60): train until global step N (steps 0 to N-1), counted
across runs, so a trainer restarted mid-run (``sidecar launch --max-restarts``) ends at
the same step as one never stopped, and a run with nothing left to do says so;
``--dir DIR``: where the checkpoints go (default:
``$TMPDIR/sidecar-torch-train-UID``, outside the checkout, the same for every rank of this
machine and every run, so a second run resumes; give a directory of your own to keep them).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import sidecar.torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=60,
                      help="train until this global step (steps 0 to STEPS-1, counted across "
                           "runs: a resumed run trains the steps left)")
  parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(),
                                                     f"sidecar-torch-train-{os.getuid()}"),
                      help="where the checkpoints go (default: %(default)s)")
  return parser.parse_args(argv)


def steps_left(first: int, steps: int) -> range:
  """The steps a run that resumes at ``first`` trains: up to global step ``steps`` (not
  ``steps`` more: a restarted run ends where one never stopped does)."""
  return range(first, steps)


def main() -> None:
  args = parse_args()

  ctl = sidecar.torch.connect()  # starts the gloo group from torchrun's environment
  if not dist.is_initialized():  # one rank: a group of its own, for DDP, with no network
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
  rank, world = dist.get_rank(), dist.get_world_size()
  torch.manual_seed(0)
  model = DDP(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                  torch.nn.Linear(64, 10)))
  optim = torch.optim.SGD(model.parameters(), lr=0.1)
  loader = sidecar.torch.DataLoader("digits", batch_size=64 // world,
                                    kwargs={"split": "train"}, seed=0)
  ckpt = sidecar.torch.Checkpointer(args.dir, max_to_keep=2)

  first = 0
  start = ckpt.latest_step()
  if start is not None:  # from the sidecars' RAM tier if they kept it, else from storage
    state = {"model": model.state_dict(), "optim": optim.state_dict(),
             "data": loader.state_dict()}
    ckpt.restore(start, state)
    model.load_state_dict(state["model"])
    optim.load_state_dict(state["optim"])
    loader.load_state_dict(state["data"])
    first = start + 1

  step, loss = first - 1, torch.tensor(0.0)
  if first >= args.steps and rank == 0:
    print(f"nothing to train: step {first - 1} is saved, and --steps {args.steps} ends "
          "before it; pass a larger --steps to train on", flush=True)
  for step, batch in zip(steps_left(first, args.steps), loader):
    loss = F.cross_entropy(model(batch["image"]), batch["label"].long())
    optim.zero_grad()
    loss.backward()
    optim.step()
    if step % 20 == 19:
      ckpt.save(step, {"model": model.state_dict(), "optim": optim.state_dict(),
                       "data": loader.state_dict()})
  ckpt.close()  # waits for the last save to be durable
  loader.close()
  if rank == 0:
    if step >= first:
      print(f"trained steps {first}-{step} on {world} ranks, loss {loss.item():.3f}; "
            f"saved steps {ckpt.all_steps()}", flush=True)
    print(f"checkpoints in {os.path.abspath(args.dir)}: run again with a larger --steps to "
          "train on from them", flush=True)
  ctl.close()
  dist.destroy_process_group()


if __name__ == "__main__":
  main()
