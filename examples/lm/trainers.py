"""What both trainers of this directory share: their flags, their data-parallel setup and
their metrics line, so ``train.py`` (the sidecars) and ``train_baseline.py`` (Grain + Orbax)
differ only in how they feed and checkpoint."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, TextIO


def parser(description: str, *, ckpt_help: str) -> argparse.ArgumentParser:
  """The flags both trainers take; a trainer adds its own, then calls :func:`parse`."""
  p = argparse.ArgumentParser(description=description)
  p.add_argument("--config", default="tiny", help="model.CONFIGS key: tiny or chip")
  p.add_argument("--data", required=True, help="a corpus written by prepare.py")
  p.add_argument("--ckpt", required=True, help=ckpt_help)
  p.add_argument("--steps", type=int, required=True, help="train until this step")
  p.add_argument("--metrics", required=True, help="JSON-lines file to append to")
  p.add_argument("--save-every", type=int, default=100, help="steps between saves")
  p.add_argument("--keep", type=int, default=3, help="checkpoints kept (max_to_keep)")
  p.add_argument("--seed", type=int, default=0, help="initialisation and shuffle seed")
  return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
  args = p.parse_args(argv)
  if args.save_every < 1 or args.steps < 1:
    p.error("--steps and --save-every must be at least 1")
  return args


def data_parallel(config: Any) -> tuple[Any, Any, Any, Any]:
  """``(optimizer, train_step, replicated, rows)``: the state replicated over a "data" mesh
  axis of every device, each batch's rows split over it."""
  import jax
  import model
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()), ("data",))
  replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  optimizer = model.make_optimizer(config)
  train_step = model.make_train_step(config, optimizer, state_sharding=replicated,
                                     batch_sharding=rows)
  return optimizer, train_step, replicated, rows


def write_metric(metrics: TextIO, step: int, loss: Any) -> None:
  """Step ``step``'s line: ``{"step", "loss", "time"}``, the loss read from this process's
  copy of the replicated value, the time when it was ready."""
  value = float(loss.addressable_data(0))
  metrics.write(json.dumps({"step": step, "loss": value, "time": time.time()}) + "\n")
  metrics.flush()
