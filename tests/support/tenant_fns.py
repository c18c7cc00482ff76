"""Functions and pipelines of the tests of tenant processes (issue 76;
``--import tests.support.tenant_fns``): what a tenant's process is, and what it does when
its code asks for more than its limits."""

import os
import resource
import tempfile
import time

import grain
import numpy as np

import sidecar

_LIMITS = {"nofile": resource.RLIMIT_NOFILE, "data": resource.RLIMIT_DATA,
           "fsize": resource.RLIMIT_FSIZE, "nproc": resource.RLIMIT_NPROC,
           "core": resource.RLIMIT_CORE}


@sidecar.function
def whoami() -> dict:
  """Where this call runs: its process, user, limits, temporary directory, environment."""
  return {"pid": np.int64(os.getpid()), "uid": np.int64(os.getuid()),
          "gid": np.int64(os.getgid()), "groups": np.asarray(os.getgroups(), np.int64),
          "nice": np.int64(os.getpriority(os.PRIO_PROCESS, 0)),
          "fds": np.int64(len(os.listdir("/proc/self/fd"))),
          "tmp": tempfile.gettempdir(),
          "secrets": sorted(k for k in os.environ if "TOKEN" in k or "SECRET" in k),
          **{k: np.int64(resource.getrlimit(v)[0]) for k, v in _LIMITS.items()}}


@sidecar.function
def read_bytes(path: str) -> np.ndarray:
  """The bytes of the file at ``path``, read as this process may (a function that takes a
  path: the kernel's permission checks decide)."""
  with open(path, "rb") as f:
    return np.frombuffer(f.read(), np.uint8)


@sidecar.function
def allocate(nbytes: int) -> int:
  """Makes (and touches) an array of ``nbytes``."""
  return int(np.ones(nbytes, np.uint8).sum())


@sidecar.function
def write_tmp(files: int, nbytes: int) -> int:
  """Writes ``files`` files of ``nbytes`` in this process's temporary directory, and
  waits a moment there (for the sidecar's next look)."""
  directory = tempfile.mkdtemp(prefix="fill-")
  for i in range(files):
    with open(os.path.join(directory, f"f{i}"), "wb") as f:
      f.write(b"x" * nbytes)
  time.sleep(3)
  return files


@sidecar.function
def slow(seconds: float) -> int:
  """This process's pid, after ``seconds``."""
  time.sleep(seconds)
  return os.getpid()


@sidecar.pipeline
def counting(ctx: sidecar.PipelineContext, *, n: int = 1 << 20) -> grain.MapDataset:
  """``{"x": i}`` for i in [0, n)."""
  del ctx
  return grain.MapDataset.range(n).map(lambda i: {"x": np.int64(i)})


@sidecar.pipeline
def hungry(ctx: sidecar.PipelineContext, *, nbytes: int) -> grain.MapDataset:
  """Elements that each take ``nbytes`` of memory to make (in a feed worker, say)."""
  del ctx
  return grain.MapDataset.range(64).map(
      lambda i: {"x": np.int64(np.ones(nbytes, np.uint8).sum() + i)})
