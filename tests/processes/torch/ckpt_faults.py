"""Torch ranks that save through the sidecars while something goes wrong (issue 35, items
1, 2, 4 and 5). Run under ``sidecar launch --torch``::

  python -m tests.processes.torch.ckpt_faults DIRECTORY MODE

MODE: mix, enospc, swap, restore, listing, skip or relaunch.

``mix`` (2 hosts, ``--elastic``): ``<dir>/1`` saved with ``replicas=1, ram_steps=2``; a
restore reads rank 1's part from host 0's replica (host 1's own copy refused, as if
lost); ``<dir>/1`` saved again with new values, no replica sent (as a rank 0 that stops
right after the commit); rank 1 SIGKILLs its sidecar; the job restarted on host 0 alone
restores ``<dir>/1``: it must be the second save's values. ``enospc`` (the sidecar under
``SIDECAR_CKPT_FAULT=enospc@2``): a ``Checkpointer`` saves 1, 2 (its write fails) and 3
(which goes on, and commits: step 2's failure cost only itself).
``swap`` (under ``SIDECAR_CKPT_FAULT=swap@1``): ``<dir>/1`` saved twice; the sidecar is
killed in the middle of the second's overwrite. ``listing``: an empty ``999/`` and an
empty ``0/`` beside the steps of a ``Checkpointer(max_to_keep=1)``. ``skip`` (2 hosts,
``slow@2``): ``Checkpointer(if_busy="skip")`` saves 1, 2, then 3 while 2 is in flight,
then 4; then step 5 of ``<dir>/r`` with ``CheckpointOptions(replicas=1)``. ``relaunch``
(issue 55 item 2): a ``Checkpointer`` saves 3 and 5; a second one (a relaunch that forgot
to resume) saves 5 and 3 again (refused), then 4. Prints JSON lines.
"""

import concurrent.futures
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import sidecar.torch
from sidecar._src.core import errors
from tests.support.paths import entries
from tests.support.torch_ckpt import same, state, zeros_like


def main() -> None:
  directory, mode = sys.argv[1], sys.argv[2]
  ctl = sidecar.torch.connect()
  if not dist.is_initialized():
    dist.init_process_group("gloo")
  rank, world = dist.get_rank(), dist.get_world_size()
  # One write a record: print() writes the text and its newline apart (unbuffered under
  # sidecar launch), and a warning from a save's thread landed between them.
  say = lambda **kw: (sys.stdout.write(json.dumps({"rank": rank, **kw}) + "\n"),
                      sys.stdout.flush())
  if mode == "mix":
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if restart == 0:
      w = sidecar.torch.StorageWriter(f"{directory}/1", replicas=1, ram_steps=2, controller=ctl)
      dcp.save(state(rank, world, 1), storage_writer=w)
      if rank == 0:  # the coordinator replicates every part, apart from the commit
        w.replicated.result(timeout=60)
      dist.barrier()

      class ViaReplica(sidecar.torch.StorageReader):
        def _sources(self, owner, shard):  # host 1's own copy, as if it were lost
          return [(-1 if h == 1 and tier == "ram" else h, tier)
                  for h, tier in super()._sources(owner, shard)]
      target, r = zeros_like(state(rank, world, 1)), ViaReplica(f"{directory}/1", controller=ctl)
      dcp.load(target, storage_reader=r)
      say(first=same(target, state(rank, world, 1)), stats=r.last_stats)

      class NoReplicas(sidecar.torch.StorageWriter):
        def run(self, target):  # the step's run never replicates: stopped after the commit
          run = super().run(target)
          run._replicate = lambda: None
          return run
      w = NoReplicas(f"{directory}/1", replicas=1, ram_steps=2, controller=ctl)
      dcp.save(state(rank, world, 2), storage_writer=w)
      dist.barrier()
      if rank == 1:
        os.kill(next(h.pid for h in ctl.hosts if h.host_id == ctl.local_hosts[0]), 9)
        time.sleep(600)
      dist.barrier()
    target = {**zeros_like(state(rank, world, 2)), "rank1": torch.zeros(3)}
    r = sidecar.torch.StorageReader(f"{directory}/1", controller=ctl)
    try:
      dcp.load(target, storage_reader=r)
    except BaseException as e:
      say(restored=1, restart=restart, error=f"{type(e).__name__}: {e}"[:1500])
    else:
      want = {**state(rank, world, 2), "rank1": torch.full((3,), 21.0)}
      say(restored=1, restart=restart, same=same(target, want),
          rank1=target["rank1"].tolist(), stats=r.last_stats)
  elif mode == "enospc":
    ckpt = sidecar.torch.Checkpointer(directory, controller=ctl)
    ckpt.save(1, state(rank, world, 1)).durable.result(timeout=60)
    t0 = time.monotonic()
    handle = ckpt.save(2, state(rank, world, 2))
    # Waited for, its outcome not read from the handle (the checkpointer settles it: a
    # failed save costs only itself, issue 79 item 2): the next save goes on and commits.
    if not concurrent.futures.wait([handle.durable], 20).done:
      say(save2="hung", seconds=time.monotonic() - t0)
      os._exit(7)  # the sidecar is wedged: nothing after this can work
    seconds, e = time.monotonic() - t0, handle.durable.error()
    outcome = "durable" if e is None else type(e).__name__ + "".join(
        f" {w}" for w in ("CheckpointWriteError", "ENOSPC") if w in str(e))
    say(save2=outcome, seconds=seconds, listing=entries(directory))
    try:
      ckpt.save(3, state(rank, world, 3)).durable.result(timeout=60)
      target = ckpt.restore(None, zeros_like(state(rank, world, 3)))
      say(save3=True, same=same(target, state(rank, world, 3)), steps=ckpt.all_steps())
      ckpt.close()  # step 2's failure is settled by step 3's commit: nothing raised
    except BaseException as e:
      say(save3=f"{type(e).__name__}: {e}"[:500])
  elif mode == "swap":
    # sidecar launch stops every trainer (SIGTERM) as soon as it sees the sidecar die, which
    # may be before this rank's save has failed and said so: it waits for that instead
    # (os._exit below; the launcher's SIGKILL after its grace if the failure never came).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for step in (1, 2):
      w = sidecar.torch.StorageWriter(f"{directory}/1", controller=ctl)
      try:
        dcp.save(state(rank, world, step), storage_writer=w)
        say(saved=step)
      except BaseException as e:
        say(saved=step, error=f"{type(e).__name__}"[:200])
        os._exit(5)
  elif mode == "restore":  # after ``swap``: a new job, a new sidecar
    ckpt = sidecar.torch.Checkpointer(directory, controller=ctl)
    steps = ckpt.all_steps()
    got = {}
    for step in (1, 2):
      target = ckpt.restore(1, zeros_like(state(rank, world, step)))
      got[step] = same(target, state(rank, world, step))
    try:  # a Checkpointer never replaces a committed step (issue 55 item 2) ...
      ckpt.save(1, state(rank, world, 3))
    except errors.InvalidArgumentError:
      pass
    else:
      raise AssertionError("the Checkpointer replaced committed step 1")
    # ... a StorageWriter saves over its path, as DCP's FileSystemWriter does.
    dcp.save(state(rank, world, 3),
             storage_writer=sidecar.torch.StorageWriter(f"{directory}/1", controller=ctl))
    target = ckpt.restore(1, zeros_like(state(rank, world, 3)))
    say(steps=steps, got=got, resaved=same(target, state(rank, world, 3)))
    ckpt.close()
  elif mode == "relaunch":  # issue 55 item 2: a relaunch that forgot to resume
    with sidecar.torch.Checkpointer(directory, controller=ctl) as ckpt:
      for step in (3, 5):
        ckpt.save(step, state(rank, world, step)).durable.result(timeout=60)
    with sidecar.torch.Checkpointer(directory, controller=ctl) as ckpt:
      refused = {}
      for step in (5, 3):
        try:
          ckpt.save(step, state(rank, world, 6)).durable.result(timeout=60)
          refused[step] = None
        except BaseException as e:
          refused[step] = f"{type(e).__name__}: {e}"[:500]
      # A step not committed, lower than the latest, is saved (as ctl.checkpointer does).
      lower = ckpt.save(4, state(rank, world, 4)).durable.result(timeout=60)
      target = ckpt.restore(5, zeros_like(state(rank, world, 5)))
      say(refused=refused, lower=lower, steps=ckpt.all_steps(),
          restored5=same(target, state(rank, world, 5)))
  elif mode == "skip":  # the sidecars under ``slow@2``: step 2's write starts 2 s late
    try:
      sidecar.torch.Checkpointer(directory, if_busy="later", controller=ctl)
    except errors.InvalidArgumentError as e:
      say(refused=str(e))
    ckpt = sidecar.torch.Checkpointer(directory, if_busy="skip", controller=ctl)
    ckpt.save(1, state(rank, world, 1)).durable.result(timeout=60)
    second = ckpt.save(2, state(rank, world, 2))
    third = ckpt.save(3, state(rank, world, 3))  # step 2 in flight on every rank: skipped
    skipped = [third.staged.result(), third.durable.result(), third.replicated.result()]
    busy = not second.durable.done()
    second.durable.result(timeout=60)
    ckpt.save(4, state(rank, world, 4)).durable.result(timeout=60)
    say(skipped=skipped, busy=busy, steps=ckpt.all_steps())
    ckpt.close()
    # The options of ctl.checkpointer; `replicated` resolves apart from `durable`, on
    # every rank, once rank 0 has replicated every host's part.
    options = sidecar.CheckpointOptions(replicas=1, ram_steps=2)
    try:
      sidecar.torch.StorageWriter(f"{directory}/r/9", replicas=1, options=options,
                                  controller=ctl)
    except errors.InvalidArgumentError as e:
      say(both=str(e))
    with sidecar.torch.Checkpointer(f"{directory}/r", options=options, controller=ctl) as rep:
      handle = rep.save(5, state(rank, world, 5))
      say(durable=handle.durable.result(timeout=60),
          replicated=handle.replicated.result(timeout=60))
  elif mode == "listing":
    os.makedirs(f"{directory}/999", exist_ok=True)
    os.makedirs(f"{directory}/0", exist_ok=True)
    ckpt = sidecar.torch.Checkpointer(directory, max_to_keep=1, controller=ctl)
    say(latest=ckpt.latest_step())
    out = {}
    for step in (1, 2):
      try:
        handle = ckpt.save(step, state(rank, world, step))
        handle.durable.result(timeout=60)
        out[step] = "durable" if handle.replicated.result(timeout=5) == step else "?"
      except errors.SidecarError as e:
        out[step] = f"{type(e).__name__}: {e}"[:300]
    try:
      target = ckpt.restore(None, zeros_like(state(rank, world, 2)))
      restored = same(target, state(rank, world, 2))
    except BaseException as e:
      restored = f"{type(e).__name__}: {e}"[:300]
    steps = ckpt.all_steps()
    ckpt.close()  # waits for step 2's end, where max_to_keep deletes step 1
    say(saves=out, restored=restored, steps=steps, listing=entries(directory))
  dist.barrier()
  ctl.close()


if __name__ == "__main__":
  main()
