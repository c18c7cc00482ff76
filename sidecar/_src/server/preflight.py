"""What ``sidecar serve`` checks before it makes its arena: the mounts, the memory and the
descriptors it needs.

In a container each of these is a mount or a limit of the pod spec, and each mistake would
otherwise surface late: a socket directory on the read-only root after seconds of arena
pre-faulting, a read-only checkpoint volume at the first save, an arena above the memory
limit as an OOM kill, a socket directory where another user could take the socket's name
as a client's token sent to an impostor. Each check raises at once with the flag, the path
and the fix. The descriptor limit is raised where the hard limit allows (:func:`raise_nofile`).
"""

from __future__ import annotations

import errno
import logging
import os
import resource

from sidecar._src.arena import shm
from sidecar._src.core import env as env_lib, options as options_lib
from sidecar._src.server import sockets

SOCKET_FLAG = f"--socket or ${env_lib.SOCKET}"
ROOTS_FLAG = f"--checkpoint-root, ${env_lib.CHECKPOINT_ROOTS}"
log = logging.getLogger(__name__)

# The soft descriptor limit a sidecar raises itself to (within the hard one): its ports'
# connection caps together stay well below it.
NOFILE = 65536


def raise_nofile() -> int:
  """Raises the soft RLIMIT_NOFILE toward ``NOFILE`` (never past the hard limit); returns it."""
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  want = NOFILE if hard == resource.RLIM_INFINITY else min(NOFILE, hard)
  if soft != resource.RLIM_INFINITY and soft < want:
    try:
      resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
      soft = want
    except (ValueError, OSError) as e:
      log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, want, e)
  return soft


def check(o: options_lib.ServerOptions) -> None:
  """Raises OSError for a mount this sidecar needs and lacks, ArenaCapacityError for an
  arena the machine or the container's memory limit (cgroup v2 or v1) cannot give."""
  socket_directory(o.socket_path)
  if (unix := o.unix) is not None:
    listen_directory(unix.path)
  for root in o.checkpoint_roots:
    checkpoint_root(root)
  shm.check_capacity(o.shm_size)


def _nearest_existing(path: str) -> str:
  while not os.path.lexists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  return path


def _who() -> str:
  return f"uid {os.getuid()}, gid {os.getgid()}"


def _not_writable(path: str) -> tuple[int, str] | None:
  """Why this process cannot make files in directory ``path`` (errno, text), or None."""
  if not os.path.isdir(path):
    return errno.ENOTDIR, f"{path} is not a directory"
  if os.access(path, os.W_OK | os.X_OK):
    return None
  if os.statvfs(path).f_flag & os.ST_RDONLY:
    return errno.EROFS, f"{path} is on a read-only file system"
  info = os.stat(path)
  return errno.EACCES, (f"{path} (owner uid {info.st_uid}, gid {info.st_gid}, mode "
                        f"{info.st_mode & 0o7777:o}) is not writable by this process ({_who()})")


def socket_directory(socket_path: str) -> None:
  """The worker socket's directory exists and is writable, or can be made; no other user
  can take the socket's name (``sockets.check_directories``)."""
  directory = os.path.dirname(os.path.abspath(socket_path))
  if problem := _not_writable(_nearest_existing(directory)):
    code, why = problem
    raise OSError(code, f"cannot make the worker socket {socket_path}: {why}. Mount a "
                  f"writable volume at {directory}, shared with the trainer (on Kubernetes: "
                  f"the manifests' sidecar-socket emptyDir), or give {SOCKET_FLAG} a path in "
                  "a writable directory")
  sockets.check_directories(socket_path, what="worker socket", flag=SOCKET_FLAG)


def listen_directory(path: str) -> None:
  """The directory of a ``unix:`` listen address exists and is writable, or can be made;
  no other user can take the socket's name."""
  directory = os.path.dirname(path)
  if problem := _not_writable(_nearest_existing(directory)):
    code, why = problem
    raise OSError(code, f"cannot make the gRPC socket {path} (--listen unix:{path}): {why}. "
                  "Give --listen a unix: path in a directory this sidecar may write, or "
                  "make that one writable for it")
  sockets.check_directories(path, what="gRPC socket", flag="--listen unix:PATH")


def checkpoint_root(root: str) -> None:
  """Checkpoints can be written in ``root``: it is a writable directory, or can be made."""
  if problem := _not_writable(_nearest_existing(root)):
    code, why = problem
    raise OSError(code, f"checkpoint root {root} ({ROOTS_FLAG}) cannot take checkpoints: "
                  f"{why}. Mount the checkpoint volume there read-write (on Kubernetes: no "
                  "readOnly on the sidecar's volumeMount, and a pod fsGroup the sidecar's "
                  "user belongs to), or name a writable directory")
