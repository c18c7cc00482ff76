"""Where a read takes a shard's copy: :class:`Tier`, what the ``Read`` rpc names.

Both halves use it: the trainer's restore picks a tier for each source it tries
(``controller/checkpoint/shard_reads.Source``), ``wire/checkpoint_wire.TIERS`` converts it
to the protocol's enum, and the sidecar reads from that tier
(``server/checkpoint/read.Reader.read``). A ``StrEnum``: its value is the wire's and the
sidecar's spelling (``"ram"``, ``"replica"``, ``"disk"``, ``"any"``), so a tier compares
equal to it.
"""

from __future__ import annotations

import enum


class Tier(enum.StrEnum):
  """A tier of a shard's copies on one host."""

  RAM = "ram"  # the arena of the host that staged the shard (its RAM tier)
  REPLICA = "replica"  # a replica another host's sidecar keeps of it, in its RAM tier
  STORAGE = "disk"  # the step's files, read through the host (the wire's TIER_DISK)
  ANY = "any"  # the host's RAM copy where it keeps one, else its storage (its choice)
