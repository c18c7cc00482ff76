"""Restore after a kernel restart: from the sidecars' RAM tier vs from storage.

A real Jupyter kernel saves the 1 GiB state of benchmarks/checkpoint.py (8 x 128 MiB
float32, sharded over 2 devices of 2 hosts) through `sidecar local` sidecars started
outside it. Then (1) the kernel restarts and a new Controller restores the step: from
the RAM tier; (2) the sidecars restart too (their RAM tier is gone) and a restarted
kernel restores it from storage (the page cache warm from the save). One run, each
restore timed inside the kernel, bit-exactness checked.

  python -m benchmarks.notebook
"""

import json
import shutil
import signal
import subprocess
import tempfile

from tests.support.kernels import Kernel, kernel_env, start_local

SETUP = """
import json, time
import jax, numpy as np, sidecar
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
ctl = sidecar.jax.Controller({addresses!r})
sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("d",)), P("d"))
ckpt = ctl.checkpointer({directory!r})
shape = (8192, 4096)  # 128 MiB of float32
target = {{f"w{{i}}": jax.ShapeDtypeStruct(shape, np.float32, sharding=sh) for i in range(8)}}
def expected(i):
  return np.arange(shape[0] * shape[1], dtype=np.float32).reshape(shape) + i
"""

SAVE = """
state = {f"w{i}": jax.device_put(expected(i), sh) for i in range(8)}
ckpt.save(1, state); ckpt.wait(progress=False)
print(json.dumps({"steps": ckpt.all_steps()}))
"""

RESTORE = """
t0 = time.perf_counter()
got = ckpt.restore(target=target, progress=False)
jax.block_until_ready(got)
seconds = time.perf_counter() - t0
exact = all((np.asarray(got[f"w{i}"]) == expected(i)).all() for i in range(8))
print(json.dumps({"seconds": seconds, "sources": sorted(ckpt.last_restore_stats().shards),
                  "exact": bool(exact)}))
ctl.close()
"""


def stop(proc: subprocess.Popen) -> None:
  proc.send_signal(signal.SIGINT)
  proc.wait(60)
  proc.stdout.close()


def last_json(text: str) -> dict:
  return json.loads(text.strip().splitlines()[-1])


def main() -> None:
  directory = tempfile.mkdtemp(prefix="bench-notebook-")
  proc, addresses = start_local("--shm-size", "1GiB")
  kernel = Kernel(kernel_env(2))
  rows = []
  try:
    setup = SETUP.format(addresses=addresses, directory=directory)
    kernel.run(setup + SAVE, timeout=300)
    kernel.restart()
    rows.append(("kernel restarted, sidecars kept: RAM tier",
                 last_json(kernel.run(setup + RESTORE, timeout=300))))
    stop(proc)
    proc, addresses = start_local("--shm-size", "1GiB")
    kernel.restart()
    setup = SETUP.format(addresses=addresses, directory=directory)
    rows.append(("kernel and sidecars restarted: storage (page cache warm)",
                 last_json(kernel.run(setup + RESTORE, timeout=300))))
  finally:
    kernel.shutdown()
    stop(proc)
    shutil.rmtree(directory, ignore_errors=True)  # 1 GiB of checkpoints
  base = rows[1][1]["seconds"]
  print("| restore of 1 GiB after a kernel restart | s | GB/s | storage / this | sources "
        "| bit-exact |")
  print("|---|---|---|---|---|---|")
  for name, r in rows:
    print(f"| {name} | {r['seconds']:.3f} | {(1 << 30) / r['seconds'] / 1e9:.2f} | "
          f"{base / r['seconds']:.1f}x | {', '.join(r['sources'])} | {r['exact']} |")


if __name__ == "__main__":
  main()
