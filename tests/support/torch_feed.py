"""A torch rank that reads a sidecar.torch.DataLoader and prints what it got, as JSON lines.

Run under ``sidecar launch --torch --import tests.support.feed_fns``::

  python -m tests.support.torch_feed BATCH_SIZE STEPS STATE_FILE [resume]

Each rank prints ``{"rank", "step", "ids"}`` per batch, then ``{"rank", "state"}``; rank 0
writes the loader's state_dict to STATE_FILE. With ``resume`` it loads it first. It
also prints which modules it loaded (``"jax"``: whether jax or jaxlib was).
"""

import json
import sys

import torch

import sidecar.torch


def main() -> None:
  batch_size, steps, state_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
  resume = sys.argv[4:] == ["resume"]
  loader = sidecar.torch.DataLoader("ids", batch_size, kwargs={"n": 64}, seed=3)
  rank = loader.rank
  if resume:
    with open(state_file) as f:
      loader.load_state_dict(json.load(f))
  for step, batch in zip(range(steps), loader):
    assert isinstance(batch["x"], torch.Tensor) and batch["x"].shape == (batch_size, 4)
    print(json.dumps({"rank": rank, "step": step, "ids": batch["id"].tolist()}), flush=True)
  state = loader.state_dict()
  print(json.dumps({"rank": rank, "state": state}), flush=True)
  if rank == 0:
    with open(state_file, "w") as f:
      json.dump(state, f)
  print(json.dumps({"rank": rank, "jax": any(m in sys.modules for m in ("jax", "jaxlib"))}),
        flush=True)
  loader.close()
  if torch.distributed.is_initialized():
    torch.distributed.barrier()


if __name__ == "__main__":
  main()
