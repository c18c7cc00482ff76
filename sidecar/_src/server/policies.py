"""What a sidecar's clients may do: the policies the parts that run their work ask.

The call runner (``calls.Runner``) asks its :class:`CallPolicy` before it runs a call, a
stream or a feed; the checkpoint store (``checkpoint/checkpoints.Checkpoints``) asks its
:class:`CheckpointPolicy` where a client opens a directory, names a path, stores bytes,
keeps RAM-tier copies and writes. Each part is handed its policy when it is made: a
sidecar without a pool file gets the defaults here (nothing more to check, no bound), a
pool's sidecar its tenants' (``pool/tenant_checks.py``). No part is subclassed for a
quota, and neither part imports the pool.

A quota on something a hook already sees is one object in ``pool/quotas.py`` and its check
in the pool's policy (docs/pool.md, "Adding a quota"); a new hook is a method here, with
its default, and its one call in the part.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

from sidecar._src.ckptfmt import direct_io


class CallPolicy:
  """What the call runner asks before a call, a stream or a feed runs; by default, nothing.

  The client it runs for is ``tenants.CURRENT`` (its way in set it).
  """

  def check(self, kind: str, name: str, worker_session: str) -> None:
    """Raises ``PermissionDeniedError`` where the client may not run the registered
    ``kind`` ("function" or "pipeline") ``name``, or use the arena of ``worker_session``
    (the request's, "" for none)."""
    del kind, name, worker_session


class Store(Protocol):
  """What a :class:`CheckpointPolicy` reads of the checkpoint store that asks it."""

  @property
  def host_id(self) -> int: ...

  def opened_by(self, client: str) -> set[str]:
    """The directories (resolved) ``client`` opened here."""
    ...

  def writing(self) -> list[tuple[str, int]]:
    """The steps staged here and not yet written: (resolved tmp directory, bytes)."""
    ...


class CheckpointPolicy:
  """What the checkpoint store asks of a client's directories, bytes and copies; by
  default, nothing: every client has the sidecar's roots and no quota."""

  def clients_mode(self) -> str | None:
    """How the sidecar names its clients, for messages; None: per-client tokens."""
    return None

  def check_open(self, store: Store, client: str, directory: str) -> None:
    """Raises ``PermissionDeniedError`` (or ``ResourceExhaustedError``) where ``client``
    may not open ``directory`` (as named; the store then checks the sidecar's roots and
    the other clients' directories). A reopen is asked again."""
    del store, client, directory

  def ram_group(self, client: str) -> str | None:
    """The RAM-tier group whose budget the directories ``client`` opens count in (its
    ``ram_budget``); None: none."""
    del client
    return None

  def ram_budget(self, group: str) -> int | None:
    """The most bytes of committed RAM-tier copies group ``group`` keeps; None: no bound."""
    del group
    return None

  def replica_owner(self, tenant: str | None, directory: str) -> str | None:
    """The client a replica of ``tenant``'s (as its sender says) for ``directory`` is held
    for, which the store then opens the directory for; None: the job's, nobody's.

    Raises ``PermissionDeniedError`` where no such replica is held here."""
    del tenant, directory
    return None

  def check_path(self, client: str, path: str, name: str) -> None:
    """Raises ``PermissionDeniedError`` where ``client`` may not act at ``path`` (the
    store checked it lies in a directory the client opened)."""
    del client, path, name

  @contextlib.contextmanager
  def storage_reserved(self, store: Store, client: str | None, directory: str,
                       nbytes: int) -> Iterator[None]:
    """Checks (:meth:`check_storage`) and reserves ``nbytes`` more of a save by ``client``
    while the block runs the Stage that records them; here there is no quota."""
    self.check_storage(store, client, directory, nbytes)
    yield

  def check_storage(self, store: Store, client: str | None, directory: str,
                    nbytes: int) -> None:
    """Raises ``ResourceExhaustedError`` where ``nbytes`` more of a save by ``client`` in
    ``directory`` would pass its storage quota; here there is none."""
    del store, client, directory, nbytes

  def write_turn(self, owner: str) -> direct_io.Turn | None:
    """How the save of session ``owner`` takes its turns at the storage; None: at once."""
    del owner
    return None


OPEN_CALLS = CallPolicy()
OPEN_CHECKPOINTS = CheckpointPolicy()
