"""DCP through the sidecars against stock DCP, 2 ranks, one run.

Run from the repository root: ``python -m benchmarks.torch_checkpoint [--mib 128 --leaves 8]``
(it starts ``sidecar launch --torch --hosts 2`` itself). Not run by CI.

Each rank holds ``leaves`` float32 tensors of ``mib`` MiB (the default: 8 x 128 MiB = 1 GiB
a rank). Rows, each the median of ``rounds``:

- ``memcpy``: one copy of the rank's tensors into memory written before, one thread (the
  limit of a save's stall), made right before each save; "vs memcpy" is the median of each
  save's blocked time over its own memcpy's.
- ``dcp.save`` (FileSystemWriter): the whole save, blocking.
- ``dcp.async_save`` (FileSystemWriter, thread and process modes) and with
  ``sidecar.torch.StorageWriter``: blocked = until ``async_save`` returns; durable = until
  its future resolves; steps/s = a training step (a 512x512 matmul) run while the save
  goes on, until durable, against the same loop for 1 s with no save just before; steps
  lost = (no save - during) x durable: the training the save cost.
- restore: ``dcp.load`` with ``FileSystemReader`` (disk, page cache dropped where allowed)
  against ``sidecar.torch.StorageReader`` (the RAM tier), each into a state dict whose
  tensors were written before (as a restarted trainer's initialised state is).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROUNDS = 3
IDLE_S = 1.0  # the training loop with no save, just before each save


def _idle_rate(seconds: float = IDLE_S) -> float:
  """The same training step with no save in flight, for ``seconds``: the baseline of the
  rate during a save (both ranks run it at once, as they run the save)."""
  t0 = time.perf_counter()
  return _step_rate(lambda: time.perf_counter() - t0 >= seconds)


def _step_rate(until) -> float:
  import torch
  a = torch.randn(512, 512)
  n, t0 = 0, time.perf_counter()
  while not until():
    a = (a @ a).tanh_()
    n += 1
  return n / max(time.perf_counter() - t0, 1e-9)


def rank_main(args) -> None:
  import torch
  import torch.distributed as dist
  import torch.distributed.checkpoint as dcp
  from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

  import sidecar.torch
  ctl = sidecar.torch.connect()
  rank = dist.get_rank()
  group = dist.new_group(backend="gloo")
  n = args.mib << 18  # float32 elements
  # Keys of its own: each rank saves its own leaves (replicated keys would be split
  # among the ranks by DCP's dedup).
  sd = {f"rank{rank}.w{i}": torch.full((n,), float(rank * 100 + i)) for i in range(args.leaves)}
  out: dict[str, list[float]] = {}
  add = lambda k, v: out.setdefault(k, []).append(v)
  root = args.dir
  # The reference: one copy of the rank's tensors into memory written before (no page
  # faults), on one thread, as benchmarks/checkpoint.py's memcpy (clone() into fresh pages
  # took 1.1 s here, 5x this).
  copies = {k: torch.full_like(v, -1.0) for k, v in sd.items()}
  savers = (
      ("dcp.async_save thread", lambda p: dcp.FileSystemWriter(p), AsyncCheckpointerType.THREAD),
      ("dcp.async_save process", lambda p: dcp.FileSystemWriter(p),
       AsyncCheckpointerType.PROCESS),
      ("sidecar StorageWriter", lambda p: sidecar.torch.StorageWriter(p, controller=ctl),
       AsyncCheckpointerType.THREAD))
  # One save each first, unmeasured, as benchmarks/checkpoint.py's warm-up: the first
  # save of a process also pays for starting its machinery (DCP's background process, a
  # worker's first touch of arena pages: 0.24 s for a rank's first stage, 0.145 s after).
  for name, make, kind in savers:
    dcp.async_save(sd, storage_writer=make(f"{root}/warm-up {name}"), process_group=group,
                   async_checkpointer_type=kind).result()
  def memcpy() -> float:
    t0 = time.perf_counter()
    for k, v in sd.items():
      np.copyto(copies[k].numpy(), v.numpy())
    add("memcpy", time.perf_counter() - t0)
    return time.perf_counter() - t0

  for r in range(args.rounds):
    dist.barrier()
    path = f"{root}/save{r}"
    t0 = time.perf_counter()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path), process_group=group)
    add("dcp.save", time.perf_counter() - t0)
    for name, make, kind in savers:
      # The kernel writes dirty pages of earlier saves back at its own pace, on the CPU
      # the loop measures: flushed first, so that each rate sees its own save only.
      os.sync()
      dist.barrier()
      add(f"{name} idle steps/s", _idle_rate())
      dist.barrier()
      reference = memcpy()  # right before the save, in the same state of caches and load
      dist.barrier()
      p = f"{root}/{name.replace(' ', '_')}{r}"
      t0 = time.perf_counter()
      f = dcp.async_save(sd, storage_writer=make(p), process_group=group,
                         async_checkpointer_type=kind)
      add(f"{name} blocked", time.perf_counter() - t0)
      add(f"{name} vs memcpy", (time.perf_counter() - t0) / reference)
      add(f"{name} steps/s", _step_rate(f.done))
      f.result()
      add(f"{name} durable", time.perf_counter() - t0)
    dist.barrier()
    # The state a restarted trainer restores into: made and written (its pages faulted in),
    # as a model's initialisation leaves it. Into fresh pages, whichever restore came first
    # would pay their faults, no part of either reader (here: a StorageReader restore took
    # 3.4 s into fresh pages, 0.18 s into the same pages again, both ranks at once).
    target = {k: torch.full_like(v, -1.0) for k, v in sd.items()}
    if rank == 0:
      subprocess.run(["sh", "-c", "sync; echo 1 > /proc/sys/vm/drop_caches"],
                     stderr=subprocess.DEVNULL, check=False)
    dist.barrier()
    t0 = time.perf_counter()
    dcp.load(target, storage_reader=dcp.FileSystemReader(f"{root}/save{r}"), process_group=group)
    add("restore dcp.load (disk)", time.perf_counter() - t0)
    assert all(torch.equal(target[k], sd[k]) for k in sd)
    for t in target.values():
      t.fill_(-1.0)
    dist.barrier()
    t0 = time.perf_counter()
    dcp.load(target, storage_reader=sidecar.torch.StorageReader(
        f"{root}/sidecar_StorageWriter{r}", controller=ctl), process_group=group)
    add("restore StorageReader (RAM tier)", time.perf_counter() - t0)
    assert all(torch.equal(target[k], sd[k]) for k in sd)
    dist.barrier()
    if rank == 0:
      for name in os.listdir(root):
        shutil.rmtree(f"{root}/{name}", ignore_errors=True)
    dist.barrier()
  print("RESULT " + json.dumps({"rank": rank, **out}), flush=True)
  ctl.close()


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--mib", type=int, default=128)
  ap.add_argument("--leaves", type=int, default=8)
  ap.add_argument("--rounds", type=int, default=ROUNDS)
  ap.add_argument("--dir", default=None)
  ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.rank:
    return rank_main(args)
  work = args.dir or tempfile.mkdtemp(prefix="sidecar-torch-ckpt-", dir=os.getcwd())
  arena = f"{args.mib * args.leaves * 2 + 256}MiB"  # a save staged and one in the RAM tier
  try:
    p = subprocess.run(
        [sys.executable, "-m", "sidecar", "launch", "--torch", "--hosts", "2", "--shm-size",
         arena, "--", sys.executable, "-m", "benchmarks.torch_checkpoint", "--rank", "--mib",
         str(args.mib), "--leaves", str(args.leaves), "--rounds", str(args.rounds), "--dir",
         work], capture_output=True, text=True)
  finally:
    shutil.rmtree(work, ignore_errors=True)
  results = [json.loads(line.split("RESULT ", 1)[1]) for line in p.stdout.splitlines()
             if "RESULT " in line]
  if p.returncode or len(results) != 2:
    sys.exit(p.stdout[-4000:] + p.stderr[-4000:])
  med = {k: max(statistics.median(r[k]) for r in results) for k in results[0] if k != "rank"}
  from benchmarks.common import table
  memcpy = med["memcpy"]
  rows = [("memcpy of a rank's tensors", f"{memcpy:.3f}", "1.00x", "", "", "", "", "")]
  rows.append(("dcp.save (FileSystemWriter)", "", "", f"{med['dcp.save']:.3f}", "", "", "",
               ""))
  for name in ("dcp.async_save thread", "dcp.async_save process", "sidecar StorageWriter"):
    during, idle = med[name + " steps/s"], med[name + " idle steps/s"]
    durable = med[name + " durable"]
    rows.append((name, f"{med[name + ' blocked']:.3f}",
                 f"{med[name + ' vs memcpy']:.2f}x", f"{durable:.3f}",
                 f"{during:.1f}", f"{idle:.1f}", f"{during / idle:.0%}",
                 f"{(idle - during) * durable:.0f}"))
  print(f"{args.leaves} x {args.mib} MiB float32 per rank, 2 ranks, median of {args.rounds}")
  print(table(("path", "blocked s", "vs memcpy", "durable s", "steps/s during save",
               "steps/s, no save", "during / no save", "steps lost to the save"), rows))
  disk, ram = med["restore dcp.load (disk)"], med["restore StorageReader (RAM tier)"]
  print(table(("restore", "s", "vs dcp.load"), [
      ("dcp.load, FileSystemReader (disk)", f"{disk:.3f}", "1.00x"),
      ("dcp.load, sidecar StorageReader (RAM tier)", f"{ram:.3f}", f"{disk / ram:.1f}x")]))
  print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
  main()
