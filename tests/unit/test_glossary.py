"""ARCHITECTURE.md's "Words with one meaning" is what the code's names keep: every name
defined in sidecar/_src (a module, class, function, parameter, module or class constant,
an attribute set on ``self``) that holds one of its words (host, peer, pool, part, lot,
record, replica, agreement, phase) as a word of its own carries that word's one meaning:
it is named in the word's entry, or it is one of the names below that were read and carry
it (:data:`SAME`), so a new name fails here until it is read (or renamed). The names that
still carry another meaning are listed in :data:`KNOWN`, each with its reason; that list
may only shrink.

A name read in every module that defines it is written bare (``hosts``); one that carries
the word's meaning in some modules and not in others (``record``: a shard's record in
``controller/framework.py``, a RAM-tier step in ``server/checkpoint/ram_tier.py``) is read
module by module, ``"module:name"``, so the same name in a new module fails until read.
A word of :data:`BY_MODULE` is read module by module only: its entry naming ``ctl.phase``
says nothing of a ``phase`` in a checkpoint module."""

import ast
import functools
import re

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.unit

SRC = ROOT / "sidecar" / "_src"
TEXT = (ROOT / "ARCHITECTURE.md").read_text()
WORDS = ("host", "peer", "pool", "part", "lot", "record", "replica", "agreement", "phase")
# Words whose names are read only module by module (SAME's "module:name"), never by the
# entry: the meaning lives in a few modules, and the same name elsewhere is another.
BY_MODULE = frozenset({"phase"})
# Read, and carrying the word's one meaning (beside those its entry names), by word.
SAME = {
    # a machine of the job: its index, how many, which ones, what one of them runs or holds,
    # its name where one is dialed (HOST:PORT, discovery's host names)
    "host": frozenset({
        "ADVICE_HOSTS", "DEFAULT_HOST_TEMPLATE", "HOSTS", "HOSTS_DIR", "HOSTS_PER_SLICE",
        "HOST_HEADER", "HOST_ID", "HOST_TEMPLATE", "REPLICA_HOSTS", "REPLICA_HOSTS_FILE",
        "HostState", "_check_replica_hosts", "_device_hosts", "_first_host", "_from_host_list",
        "_host", "_host_batches", "_host_env", "_host_id", "_host_start", "_host_was_lost",
        "_hosts", "_lost_hosts", "_min_hosts", "_primary_host", "_rank_hosts", "_replica_hosts",
        "_rows_disjoint_across_hosts", "_write_replica_hosts", "chips_per_host",
        "device_hosts", "devices_per_host", "host", "host_back", "host_entry", "host_env",
        "host_index", "host_info", "host_lost", "host_rows", "hosts", "hosts_block",
        "hosts_by_process", "hosts_entry", "hosts_per_node", "hosts_per_slice", "local_hosts",
        "lost_hosts", "max_single_host_chips", "min_hosts", "num_hosts", "on_host_back",
        "on_host_lost", "primary_host", "processes_by_host", "procs_per_host", "rank_hosts",
        "read_hosts", "replica_hosts", "replica_hosts_file", "uncovered_hosts",
        "write_host_part"}),
    # one of a job's trainer processes (``peers`` module by module: replica hosts were
    # ``peers`` too)
    "peer": frozenset({
        "_peers",
        "controller/checkpoint/checkpointer.py:peers",
        "controller/checkpoint/coordination.py:peers",
        "controller/checkpoint/fallback.py:peers",
        "controller/checkpoint/holds.py:peers",
        "controller/checkpoint/plugs.py:peers",
        "controller/checkpoint/save_run.py:peers",
        "controller/controller.py:peers",
        "controller/feed.py:peers",
        "controller/framework.py:peers",
        "controller/peers.py:peers",
        "controller/sidecars.py:peers",
        "jax/distributed.py:peers",
        "jax/framework.py:peers",
        "torch/distributed.py:peers",
        "torch/framework.py:peers"}),
    # a shared pool's tenants: the pool file, its operator's tools, its sidecar
    "pool": frozenset({
        "POOL_FLAG", "_POOL_KEYS", "_check_pool_file", "_pool", "_pool_sidecar", "check_pool",
        "pool", "pool_file", "pool_sets", "pool_status"}),
    # one host's (or rank's) share of a step, the files it writes
    "part": frozenset({
        "dcp_part_from_pb", "dcp_part_to_pb", "write_item_part",
        "write_rank_part"}),
    # the shards a save hands on together
    "lot": frozenset({"STAGE_LOT_BYTES", "lot", "lots"}),
    # a shard's record (records.ShardRecord): the field of what carries one, the module of
    # the frozen values it is one of, a host's written ones; read module by module
    "record": frozenset({
        "ckptfmt/dcp/distcp.py:record",  # Item.record: an item's shard record, as staged
        # What a restore reads by, from the manifest down to the read (issue 65, item 2).
        "ckptfmt/dcp/format.py:record", "ckptfmt/format.py:record",  # Format.read's
        "ckptfmt/orbax/format.py:record",
        "controller/checkpoint/client.py:record",  # CheckpointTransport.read's
        "controller/checkpoint/shard_reads.py:record",
        "controller/checkpoint/shard_reads.py:_record",
        "server/checkpoint/read.py:record",  # Reader.read's
        "server/checkpoint/checkpoints.py:record",  # Checkpoints.read's
        "torch/storage.py:_records",  # StorageReader's: each item's, by fqn and offsets
        "ckptfmt/records.py:record",  # Staged.record, ReplicaPiece.record
        "ckptfmt/records.py:records",  # the module
        "controller/checkpoint/staging.py:record",  # ShardCopy.record
        "controller/framework.py:record",  # LocalShard.record
        "server/checkpoint/agreement.py:records",  # a host's written shards' records
        "server/checkpoint/step.py:_written_records",  # a step's shards' records as written
        "server/checkpoint/step.py:records",  # Step.end_write's: the same
        "server/checkpoint/replication.py:record",  # a shard's, as a replica receives it
        "server/tenant_procs/messages.py:record",  # ReadJob.record: the shard a read reads
        "server/tenant_procs/jobs.py:record",  # Work.read's, in a tenant's process
        "server/isolation.py:record",  # TenantWork.read's
        "server/checkpoint/restores.py:record",  # Read's, and _nbytes
        "written_records"}),
    # a copy of a host's shards that another host's sidecar keeps, the hosts that keep
    # them, how many per shard, how they travel and whose RAM-tier group they count in
    # the sidecars' commit of a step taken over: its module (server/checkpoint/agreement.py)
    "agreement": frozenset({"agreement"}),
    # a named stretch of a trainer's time without steps, declared by it or its startup:
    # where it is declared, told, watched and counted
    "phase": frozenset({
        "arena/worker.py:phase",  # Worker.phase
        "controller/controller.py:phase",  # Controller.phase: ctl.phase
        "controller/startup.py:phase",  # Startup.phase, behind it
        "controller/elastic.py:phase",  # sidecar.elastic.phase: an attempt's, as its event
        "core/stall.py:Phase",  # the frame a trainer tells its sidecar
        "server/goodput/steps.py:phase",  # Steps.phase (the frame), a trainer's phase
        "server/goodput/steps.py:phase_s", "server/goodput/steps.py:phase_since",
        "server/goodput/steps.py:phase_began",  # its length (Status), its ledger span
        "core/accounting.py:phases"}),  # the ledger's phase time by name
    "replica": frozenset({
        "REPLICA_HOSTS_FILE", "REPLICA_KEY", "REPLICA_SHM", "REPLICA_TOKEN_DIR",
        "_REPLICA_LINK_RPCS",
        "_check_not_replica_link", "_check_replica_hosts", "_is_replica_link",
        "_no_replica_link", "_replica_bandwidth", "_replica_bearer", "_replica_fault",
        "_replica_hosts", "_replica_links", "_replica_sessions", "_replica_tenant",
        "_replica_token", "_replica_warnings", "_replicas", "_write_replica_hosts",
        "accept_replica", "is_replica_link", "needs_replica_token", "open_replica", "replica",
        "replica_bandwidth", "replica_blocks_from_pb", "replica_bytes", "replica_credentials",
        "ckptfmt/tiers.py:REPLICA",  # Tier.REPLICA: a read of a replica's copy
        "replica_header_from_pb", "replica_header_to_pb", "replica_hosts_file",
        "replica_link", "replica_owner", "replica_piece_from_pb", "replica_steps",
        "replicas", "replicas_from_pb", "replicas_to_pb"}),
}
# Still named for another meaning: (word, name) -> why it is not renamed yet.
KNOWN = {
    ("host", "DeviceToHost"): "JAX's DeviceCopy; named for the copy's direction",
    ("peer", "PEER_TIMEOUT"): "names SIDECAR_PEER_TIMEOUT (a sidecar's silence), a user's "
                              "variable",
    ("peer", "PEER_TOKEN"): "names SIDECAR_PEER_TOKEN (the replica token), a user's variable",
    ("peer", "PEER_TOKEN_FILE"): "names SIDECAR_PEER_TOKEN_FILE, a user's variable",
    ("peer", "peer_token_secret"): "the rendered Job's Secret of the replica token "
                                   "(sidecar-peer-token), a deployed name",
    ("part", "parts"): "the module wire/parts.py, named for the wire's CallParts (a large "
                       "call in pieces); ckptfmt/dcp/parts.py is DcpPart's, a rank's part",
    ("record", "controller/elastic.py:record"): "Retry.record, Retry.note's deprecated "
                                                "spelling (a public method), until 0.4.0",
}


def _entries() -> dict[str, str]:
  """Each word's glossary entry, by word."""
  section = TEXT.split("## Words with one meaning", 1)[1].split("\n## ", 1)[0]
  return {m.group(1): m.group(2) for m in re.finditer(
      r"^- \*\*([a-z]+)\*\*:(.*?)(?=^- \*\*|\Z)", section, re.M | re.S)}


def _defined(tree: ast.Module) -> set[str]:
  """The names ``tree`` defines: classes, functions, parameters, attributes set on self,
  and what its module's and its classes' bodies assign."""
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      out.add(node.name)
    elif isinstance(node, ast.arg):
      out.add(node.arg)
    elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
          and isinstance(node.value, ast.Name) and node.value.id == "self"):
      out.add(node.attr)
  bodies = [tree.body] + [n.body for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
  for statement in (s for body in bodies for s in body):
    targets = (statement.targets if isinstance(statement, ast.Assign)
               else [statement.target] if isinstance(statement, ast.AnnAssign) else [])
    out |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
  return out


def _names() -> dict[str, set[str]]:
  """Every name defined in sidecar/_src (its modules' and folders' too): the modules. A
  copy of one walk of the tree, which the file's tests share (2.5 s of CPU a walk)."""
  return {name: set(modules) for name, modules in _walk().items()}


@functools.cache
def _walk() -> dict[str, frozenset[str]]:
  out: dict[str, set[str]] = {}
  for path in SRC.rglob("*.py"):
    module = str(path.relative_to(SRC))
    for name in {*path.relative_to(SRC).with_suffix("").parts,
                 *_defined(ast.parse(path.read_text()))}:
      out.setdefault(name, set()).add(module)
  return {name: frozenset(modules) for name, modules in out.items()}


def _words(name: str) -> set[str]:
  """The words of a name, snake_case or CamelCase, lower case, plurals as one:
  ``JaxPeers`` -> jax, peer; ``_arena_parts`` -> arena, part; ``partial`` -> partial."""
  return {w.lower().removesuffix("s")
          for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+", name)}


def _holding(word: str, names) -> list[str]:
  return sorted(n for n in names if word in _words(n))


def _named_in(entry: str, name: str) -> bool:
  return f"`{name}`" in entry or re.search(rf"[./]{re.escape(name)}`", entry) is not None


def test_the_glossary_has_an_entry_for_each_word_it_keeps():
  assert set(WORDS) - {"lot"} <= set(_entries())  # a lot is defined in part's entry


def test_the_words_of_a_name_are_its_own():
  assert _words("JaxPeers") == {"jax", "peer"}
  assert _words("_arena_parts") == {"arena", "part"}
  assert _words("DCPPart") == {"dcp", "part"}
  assert not {"part", "lot", "host"} & (_words("partial") | _words("rpartition") | _words(
      "apart") | _words("departure") | _words("slot") | _words("ghost") | _words("spool"))


def _read(word: str, name: str, module: str, entries: dict[str, str]) -> bool:
  """Whether ``name``, defined in ``module``, is known to carry ``word``'s meaning (or
  listed with the other it carries)."""
  return ((word not in BY_MODULE and _named_in(entries[word], name))
          or bool({name, f"{module}:{name}"} & SAME[word])
          or bool({(word, name), (word, f"{module}:{name}")} & set(KNOWN)))


def _unexplained(names: dict[str, set[str]]) -> list[str]:
  """``module: name uses 'word'`` for each name of ``names`` (name -> the modules that
  define it) that holds a glossary word and was not read."""
  entries = _entries()
  entries["lot"] = entries["part"]
  return sorted(f"{module}: {name} uses {word!r}"
                for word in WORDS for name in _holding(word, names)
                for module in sorted(names[name])
                if not _read(word, name, module, entries))


def test_a_new_name_of_another_meaning_fails():
  # Names that issue 65 renamed, back in a module, and ``record`` in a module not read.
  assert _unexplained({"sidecar_records": {"controller/sidecars.py"},
                       "record": {"server/goodput/ledgers.py", "controller/framework.py"},
                       "peers": {"server/checkpoint/replication.py"},
                       "replica_peer": {"server/checkpoint/links.py"}}) == [
      "controller/sidecars.py: sidecar_records uses 'record'",
      "server/checkpoint/links.py: replica_peer uses 'peer'",
      "server/checkpoint/links.py: replica_peer uses 'replica'",
      "server/checkpoint/replication.py: peers uses 'peer'",
      "server/goodput/ledgers.py: record uses 'record'",
  ]


def test_a_phase_is_a_trainers_time_alone():
  # Issue 80: where a sidecar's step is, where a host is in the agreement, a host's
  # background work and a save's sequence were phases too. Such a name back in a
  # checkpoint module fails, though the entry names ``ctl.phase``: "phase" is read module
  # by module, and only the trainer's modules carry it.
  assert _unexplained({"step_phase": {"server/checkpoint/step.py"},
                       "Phase": {"server/checkpoint/lifecycle.py", "core/stall.py"},
                       "phase": {"server/checkpoint/save.py", "controller/controller.py"},
                       "save_phases": {"controller/checkpoint/save_run.py"}}) == [
      "controller/checkpoint/save_run.py: save_phases uses 'phase'",
      "server/checkpoint/lifecycle.py: Phase uses 'phase'",
      "server/checkpoint/save.py: phase uses 'phase'",
      "server/checkpoint/step.py: step_phase uses 'phase'",
  ]


def test_every_name_holding_a_glossary_word_carries_its_meaning():
  names = _names()
  assert len(names) > 2000  # the walk sees the code's names
  unexplained = _unexplained(names)
  assert unexplained == [], (
      "a name holds a word of ARCHITECTURE.md's glossary, but not known to carry the "
      "meaning its entry gives: rename it (the glossary names the other meanings' words), "
      "or, where it carries that meaning, add it to SAME or name it in the entry")


def _bare(name: str) -> str:
  """``name`` without its module (``"module:name"``)."""
  return name.rpartition(":")[2]


def test_the_names_read_and_the_known_exceptions_still_exist():
  names = _names()
  listed = {n for _, n in KNOWN} | {n for same in SAME.values() for n in same}
  gone = sorted(n for n in listed
                if _bare(n) not in names
                or ":" in n and n.rpartition(":")[0] not in names[_bare(n)])
  assert gone == [], "renamed or removed: drop them from KNOWN or SAME"
  assert not {(w, n) for w, same in SAME.items() for n in same} & set(KNOWN)
  assert all(w in _words(_bare(n)) for w, same in SAME.items() for n in same)
  assert all(w in _words(_bare(n)) for w, n in KNOWN)


def test_a_retired_name_stays_retired():
  # The review's words with two meanings, renamed by issue 56: a shard's copy from a
  # device is not a host's (DeviceCopy), the shards handed on together are a lot.
  names = _names()
  assert "HostCopy" not in names and names.get("DeviceCopy") == {"controller/framework.py"}
  assert "Part" not in names and names.get("Lot") == {"controller/checkpoint/staging.py"}
  # Issue 56's names read: a format's extra, a large call's and a replica's pieces, a
  # read's byte range, a quota's share of the arena, a socket's server, host memory.
  assert not {"stage_part", "commit_part", "call_parts", "run_parts", "PARTS_FROM",
              "PART_BYTES", "replica_part_from_pb", "ArenaPart", "ARENA_PARTS",
              "peer_or_none", "host_value", "host_array", "_copy_pool", "_pools",
              "HostArrays"} & set(names)

  # Issue 65's: "record" is a shard's record only (the goodput ledger's client and its
  # frames, a sidecar's handshake, a log entry, a Retry's events were "record" too).
  assert not {"sidecar_records", "_goodput_recorder", "_TEXT_RECORD"} & set(names)
  assert "controller/goodput.py" not in names.get("Recorder", set())
  assert names.get("LedgerClient") == {"controller/goodput.py"}
  assert not {m for m in names.get("record", set()) if "goodput" in m}

  # Issue 80's: a phase is a trainer's time without steps alone (a sidecar's step has a
  # state, a host a standing in the agreement, a host's write and replication are its
  # background work, a save's calls its sequence of values).
  assert names.get("Phase") == {"core/stall.py"}
  assert "server/checkpoint/lifecycle.py" in names["State"]
  assert names.get("Standing") == {"ckptfmt/records.py"}
  assert not {"AgreePhase", "_PHASES", "_PHASES_BACK", "_phases"} & set(names)
  assert names.get("phases") == {"core/accounting.py"}  # ckptfmt/phases.py: save_values.py
  assert "server/metrics.py" in names["background"] and "server/metrics.py" not in names[
      "phase"]


def test_agreement_is_the_sidecars_commit_alone():
  # Issue 72: the trainer's plug agreed on nothing (it drives a step's phases), and
  # ``Peers.agree`` / ``agree_on_save`` check that the processes pass the same values.
  names = _names()
  assert not {"Agreement", "KeyValueAgreement", "DcpAgreement", "key_value_agreement",
              "agree_on_save", "SaveCoordinator", "_agreement"} & {
      n for n, modules in names.items() if modules - {"server/checkpoint/agreement.py"}}
  assert names.get("Driver") == {"controller/checkpoint/plugs.py"}
  assert names.get("check_same") == {"controller/peers.py"}
