"""The main of a pool tenant's feed worker process
(``python -m sidecar._src.server.tenant_procs.feed_worker LIMITS FD ARENA_FD``).

The sidecar starts it (``feeds/processes.FeedProcesses``, with its tenant's ``Launch``:
``jobs.py``), as it starts the tenant's process: its first act is its tenant's limits
(``limits.ProcessLimits.apply``, ``LIMITS`` their JSON); then it is any feed worker
(``feeds/child.py``), which becomes the tenant's user (``ProcessLimits.become``) once the
pipeline's modules are imported, before it reads the request's arguments, and writes
batches into the blocks of the tenant's arena it is sent.
"""

from __future__ import annotations

import json
import socket
import sys

from sidecar._src.core import platform
from sidecar._src.server.feeds import child
from sidecar._src.server.tenant_procs import limits as limits_lib

if __name__ == "__main__":
  limits = limits_lib.ProcessLimits.from_dict(json.loads(sys.argv[1]))
  limits.apply()
  platform.apply_to_sidecar()
  child.serve(socket.socket(fileno=int(sys.argv[2])), int(sys.argv[3]), imported=limits.become)
  child.exit_now()
