"""Tier 1: the checkpoint protocol's messages <-> values, and replicas' raw-bytes serializer."""

import dataclasses
import json

import numpy as np
import pytest

from sidecar._src.ckptfmt import spec as spec_lib
from sidecar._src.ckptfmt.dcp import DcpCommit, DcpPart
from sidecar._src.ckptfmt.records import CommitPlan, ShardId, ShardRecord, Staged
from sidecar._src.ckptfmt.save_values import (
  Abort,
  AwaitCommit,
  Begin,
  Commit,
  Committed,
  Prepared,
  Stage,
)
from sidecar._src.core import errors
from sidecar._src.server.checkpoint import links as links_lib
from sidecar._src.wire import checkpoint_wire as wire, save_wire
from sidecar._src.wire.protocol import ckpt_pb, pb

pytestmark = pytest.mark.unit


def test_leaves_and_records_survive_the_wire_as_the_same_values():
  spec = spec_lib.LeafSpec(key_path=("opt", 0, "mu"), shape=(4, 6), dtype=np.float32,
                         write_shape=(2, 6), sharding='{"sharding_type": "x"}')
  leaf = ckpt_pb.LeafSpec.FromString(wire.leaf_to_pb(spec).SerializeToString())
  assert wire.leaf_from_pb(leaf, "leaves[0]") == spec
  record = ShardRecord(ShardId(("opt", 0, "mu"), ((0, 2), (0, 6))), 3, 1, "float32", (2, 6),
                       48, crc32c=123)
  sent = ckpt_pb.ShardRecord.FromString(wire.record_to_pb(record).SerializeToString())
  assert wire.record_from_pb(sent, "c") == record
  unchecked = ShardRecord(ShardId(("w",), ((0, 4),)), 0, None, "", (), 16)  # a stock item's
  assert wire.record_from_pb(wire.record_to_pb(unchecked), "c") == unchecked
  dcp = ShardRecord(ShardId(("m.w",), ()), 2, 0, "uint8", (9,), 9, rank=4)
  assert wire.record_from_pb(wire.record_to_pb(dcp), "c") == dcp
  # The manifest file's form, and back: the same value (JSON between processes too).
  assert ShardRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record


def test_a_stage_carries_each_record_with_its_bytes_beside_it():
  a, b = np.arange(6, dtype=np.int16), np.ones((2, 2), np.float32)
  shards = [Staged(ShardRecord.of(ShardId(("a",), ((0, 6),)), 0, a, host=1), a),
            Staged(ShardRecord.of(ShardId(("b",), ((0, 2), (2, 4))), 1, b, host=1), b)]
  request = ckpt_pb.CheckpointStageRequest()
  wire.staged_to_pb(request, shards, None)
  got = wire.staged_from_pb(_sent(request), None)
  assert [s.record for s in got] == [s.record for s in shards]
  assert all(np.array_equal(g.data, s.data) for g, s in zip(got, shards))
  lying = _sent(request)
  lying.records[1].shape[:] = [4]  # a record that does not describe its bytes
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"^records\[1\] describes \[4\] float32 \(16 bytes\), its data is "
                           r"\[2, 2\] float32 \(16 bytes\)$"):
    wire.staged_from_pb(lying, None)
  del lying.data[1]
  with pytest.raises(errors.InvalidArgumentError, match="one data per record: 2 records, 1 data"):
    wire.staged_from_pb(lying, None)


def test_a_stage_survives_the_wire_as_the_same_value_every_field_of_it():
  """A save's Stage phase is one value (``ckptfmt/save_values.Stage``) the wire alone converts:
  each field set (none at its default) comes back as sent."""
  a = np.arange(6, dtype=np.int16)
  spec = spec_lib.LeafSpec(key_path=("a",), shape=(6,), dtype=np.int16)
  plan = CommitPlan(save="s1", committer=1, hosts=(0, 1), data_state_json='{"epoch": 2}',
                    lead=True, replicas={0: (1,)})
  stage = Stage(directory="/ckpt", step=7, tmp_dir="/ckpt/7.dcp-checkpoint-tmp",
                final_dir="/ckpt/7", leaves=[spec],
                shards=[Staged(ShardRecord.of(ShardId(("a",), ((0, 6),)), 0, a, host=1), a)],
                last=False, writers=3, extra=DcpPart(2, 5), plan=plan,
                begin=Begin("/ckpt", 7, "dcp"))
  defaults = {f.name: f.default for f in dataclasses.fields(Stage)}
  assert all(getattr(stage, name) != default for name, default in defaults.items()
             if default is not dataclasses.MISSING), "a field left at its default"
  request = _sent(save_wire.stage_to_pb(stage, worker_session="w1", to_arena=None))
  assert request.worker_session == "w1"  # the caller's, beside the value
  got = save_wire.stage_from_pb(request, None)
  for name in defaults:
    if name != "shards":
      assert getattr(got, name) == getattr(stage, name), name
  assert [s.record for s in got.shards] == [s.record for s in stage.shards]
  assert all(np.array_equal(g.data, s.data) for g, s in zip(got.shards, stage.shards))
  with pytest.raises(dataclasses.FrozenInstanceError):
    got.step = 8  # type: ignore[misc]
  assert save_wire.stage_from_pb(_sent(save_wire.stage_to_pb(
      Stage("/ckpt", 7, "/t", "/f", [], []), worker_session="", to_arena=None)), None
  ) == Stage("/ckpt", 7, "/t", "/f", [], [])  # the defaults come back as defaults


def test_a_begin_survives_the_wire_as_the_same_value_every_field_of_it():
  """A save's Begin phase is one value (``ckptfmt/save_values.Begin``) the wire alone converts:
  each field comes back as sent, the caller's worker session beside it; a Stage that
  begins its step carries the same value (its ``begin_format`` on the wire)."""
  begin = Begin(directory="/ckpt/run", step=7, format="dcp")
  request = _sent(save_wire.begin_to_pb(begin, worker_session="w1"))
  assert (request.directory, request.step, request.format, request.worker_session) == (
      "/ckpt/run", 7, "dcp", "w1")
  got = save_wire.begin_from_pb(request)
  assert got == begin
  with pytest.raises(dataclasses.FrozenInstanceError):
    got.format = "orbax"  # type: ignore[misc]
  assert save_wire.begin_from_pb(_sent(save_wire.begin_to_pb(begin, worker_session=""))) == begin
  stage = Stage("/ckpt/run", 7, "/ckpt/run.dcp-checkpoint-tmp", "/ckpt/run", [], [],
                begin=begin)
  request = _sent(save_wire.stage_to_pb(stage, worker_session="", to_arena=None))
  assert request.begin_format == "dcp"
  assert save_wire.stage_from_pb(request, None).begin == begin


def test_a_stage_begins_only_its_own_step():
  """The Begin a Stage carries is of the Stage's directory and step (the wire sends only
  its format): another's is refused where the value is made."""
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"a Stage of step 7 of '/ckpt' cannot begin step 8 of '/ckpt'"):
    Stage("/ckpt", 7, "/t", "/f", [], [], begin=Begin("/ckpt", 8, "orbax"))
  with pytest.raises(errors.InvalidArgumentError, match="cannot begin step 7 of '/other'"):
    Stage("/ckpt", 7, "/t", "/f", [], [], begin=Begin("/other", 7, "orbax"))


def test_a_phase_value_and_its_sequences_are_immutable():
  """Frozen all through: a Stage's or a Commit's sequences are tuples (lists given become
  tuples) and a Commit's replicas a read-only mapping, so no holder of a value (the
  servicer, the writer) changes what another holds."""
  a = np.arange(6, dtype=np.int16)
  spec = spec_lib.LeafSpec(key_path=("a",), shape=(6,), dtype=np.int16)
  staged = Staged(ShardRecord.of(ShardId(("a",), ((0, 6),)), 0, a), a)
  stage = Stage("/ckpt", 7, "/t", "/f", [spec], [staged])
  assert (stage.leaves, stage.shards) == ((spec,), (staged,))
  with pytest.raises(AttributeError):
    stage.shards.clear()  # type: ignore[attr-defined]
  record = ShardRecord(ShardId(("a",), ((0, 6),)), 0, 1, "int16", (6,), 12, crc32c=7)
  commit = Commit(tmp_dir="/t", step=7, num_hosts=2, leaves=[spec], shards=[record],
                  data_state_json="", whole_step=True, replicas={0: [1]})
  assert (commit.leaves, commit.shards, dict(commit.replicas or {})) == (
      (spec,), (record,), {0: (1,)})
  with pytest.raises(TypeError):
    commit.replicas[1] = (0,)  # type: ignore[index]
  sent = save_wire.stage_to_pb(stage, worker_session="", to_arena=None)
  got = save_wire.stage_from_pb(_sent(sent), None)
  assert isinstance(got.leaves, tuple) and isinstance(got.shards, tuple)
  got_commit = save_wire.commit_from_pb(_sent(save_wire.commit_to_pb(commit)))
  assert isinstance(got_commit.shards, tuple) and got_commit == commit


def test_a_commit_survives_the_wire_as_the_same_value_every_field_of_it():
  """A save's Commit phase is one value (``ckptfmt/save_values.Commit``) the wire alone converts:
  each field set (none at its default) comes back as sent."""
  spec = spec_lib.LeafSpec(key_path=("a",), shape=(6,), dtype=np.int16)
  record = ShardRecord(ShardId(("a",), ((0, 6),)), 0, 1, "int16", (6,), 12, crc32c=7)
  commit = Commit(tmp_dir="/ckpt/7.dcp-checkpoint-tmp", step=7, num_hosts=2, leaves=[spec],
                  shards=[record], data_state_json='{"epoch": 2}', whole_step=False,
                  replicas={0: [1], 1: [0]},
                  extra=DcpCommit(b"\x80\x04N.", {0: 12}, '{"storage": []}'))
  defaults = {f.name: f.default for f in dataclasses.fields(Commit)}
  assert all(getattr(commit, name) != default for name, default in defaults.items()
             if default is not dataclasses.MISSING), "a field left at its default"
  got = save_wire.commit_from_pb(_sent(save_wire.commit_to_pb(commit)))
  assert got == commit
  with pytest.raises(dataclasses.FrozenInstanceError):
    got.whole_step = True  # type: ignore[misc]
  bare = Commit(tmp_dir="/t", step=7, num_hosts=1, leaves=[], shards=[], data_state_json="",
                whole_step=True)
  assert save_wire.commit_from_pb(_sent(save_wire.commit_to_pb(bare))) == bare  # None: no replicas


@pytest.mark.parametrize("value, method", [
    (Begin("/ckpt", 7, "orbax"), "Begin"),
    (Prepared("/ckpt/7/default", 30.0), "Prepared"),
    (AwaitCommit("/ckpt/7.orbax-checkpoint-tmp/default", 7), "Commit"),
    (Committed("/ckpt/7", '{"format": "dcp"}'), "Committed"),
    (Abort("/ckpt/7.orbax-checkpoint-tmp", "/ckpt/7/default"), "Abort"),
], ids=["begin", "prepared", "await-commit", "committed", "abort"])
def test_each_save_value_goes_by_its_type_to_its_rpc_and_comes_back_the_same(value, method):
  """The transport's one call sends every value of a save (``CheckpointTransport.send``):
  the wire picks the rpc by the value's type, and the sidecar reads the same value back
  (the wait for the sidecars' commit is its own value, a Commit request ``taken_over``)."""
  name, request = save_wire.request_of(value, worker_session="w")
  assert name == method
  from_pb = {"Begin": save_wire.begin_from_pb, "Prepared": save_wire.prepared_from_pb,
             "Commit": save_wire.commit_from_pb, "Committed": save_wire.committed_from_pb,
             "Abort": save_wire.abort_from_pb}[name]
  assert from_pb(_sent(request)) == value


def test_a_value_that_is_no_save_value_is_refused_naming_it():
  with pytest.raises(TypeError, match="ckptfmt/save_values.*'a path'"):
    save_wire.request_of("a path")  # type: ignore[arg-type]


@pytest.mark.parametrize("field, value, match", [
    ("dtype", "object", "dtype 'object' is not allowed"),
    ("kind", "pickle", "'pickle' is not a valid LeafKind"),
    ("write_shape", [9, 6], "write_shape of 'w' must be a shard shape"),
], ids=["dtype", "kind", "write-shape"])
def test_a_bad_leaf_is_refused_naming_the_field(field, value, match):
  leaf = wire.leaf_to_pb(spec_lib.LeafSpec(key_path=("w",), shape=(4, 6), dtype=np.float32))
  if isinstance(value, list):
    del getattr(leaf, field)[:]
    getattr(leaf, field).extend(value)
  else:
    setattr(leaf, field, value)
  with pytest.raises(errors.InvalidArgumentError, match=match):
    wire.leaf_from_pb(leaf, "leaves[3]")


def test_bad_shards_are_refused_naming_the_field():
  with pytest.raises(errors.InvalidArgumentError, match=r"shards\[1\].index: each interval"):
    wire.index_from_pb([ckpt_pb.Interval(start=5, stop=2)], "shards[1].index")
  with pytest.raises(errors.InvalidArgumentError, match="s.key_path: the key path is empty"):
    wire.shard_from_pb(ckpt_pb.ShardId(), "s")
  data = ckpt_pb.ShardData()
  wire.fill_data(data, np.arange(6, dtype=np.int16))
  data.array.data = data.array.data[:-1]
  with pytest.raises(errors.InvalidArgumentError, match=r"d: shape \[6\] of int16 needs 12"):
    wire.data_from_pb(data, None, "d")
  with pytest.raises(errors.InvalidArgumentError, match="this side maps no arena"):
    wire.data_from_pb(ckpt_pb.ShardData(arena=pb.ArenaRef(
        offset=0, nbytes=8, generation=1, dtype="uint8", shape=[8])), None, "d")


@pytest.mark.parametrize("nbytes", [0, 1, 127, 128, 1 << 20], ids=str)
def test_a_raw_part_serializes_as_protobuf_would(nbytes):
  """replicas._serialize writes a part's bytes straight into the message: the bytes parse as
  the message protobuf itself would make."""
  data = (np.arange(nbytes) % 251).astype(np.uint8)
  part = ckpt_pb.ReplicaPart(record=_record(nbytes), offset=64 << 20)
  raw = links_lib._serialize(links_lib._Piece(part, data.data))
  expected = ckpt_pb.ReceiveRequest(part=part)
  expected.part.data = data.tobytes()
  assert ckpt_pb.ReceiveRequest.FromString(raw) == expected


def _record(nbytes: int) -> ckpt_pb.ShardRecord:
  return wire.record_to_pb(ShardRecord(ShardId(("w", 1), ((0, 4),)), 0, 0, "uint8", (nbytes,),
                                       nbytes, crc32c=7))


def _as_protobuf_parses(message: ckpt_pb.ReceiveRequest, data) -> ckpt_pb.ReceiveRequest:
  if data is not None:
    message.part.data = bytes(data)
  return message


@pytest.mark.parametrize("nbytes", [0, 1, 128, 1 << 20], ids=str)
def test_the_receiver_reads_a_raw_part_as_protobuf_would_with_no_copy(nbytes):
  from sidecar._src.server.checkpoint.service import parse_receive
  data = (np.arange(nbytes) % 251).astype(np.uint8)
  part = ckpt_pb.ReplicaPart(record=_record(nbytes), offset=64 << 20)
  raw = links_lib._serialize(links_lib._Piece(part, data.data))
  message, view = parse_receive(raw)
  assert isinstance(view, memoryview) and view.obj is raw  # the bytes as they came
  assert _as_protobuf_parses(message, view) == ckpt_pb.ReceiveRequest.FromString(raw)


@pytest.mark.parametrize("message", [
    ckpt_pb.ReceiveRequest(done=True),
    ckpt_pb.ReceiveRequest(header=ckpt_pb.ReplicaHeader(directory="/d", step=3, final_dir="i",
                                                        source=1), worker_session="s"),
    ckpt_pb.ReceiveRequest(part=ckpt_pb.ReplicaPart(record=ckpt_pb.ShardRecord(
        dtype="float32", shape=[2]), data=b"12345678"), done=True),
    ckpt_pb.ReceiveRequest(part=ckpt_pb.ReplicaPart()),  # a part with nothing set
], ids=["done", "header", "part-and-done", "empty-part"])
def test_the_receiver_reads_any_receive_request_as_protobuf_would(message):
  from sidecar._src.server.checkpoint.service import parse_receive
  raw = message.SerializeToString()
  assert _as_protobuf_parses(*parse_receive(raw)) == message
  # The same fields twice (protobuf merges them) and garbage take protobuf's own path.
  doubled, _ = parse_receive(raw + raw)
  assert doubled == ckpt_pb.ReceiveRequest.FromString(raw + raw)
  with pytest.raises(errors.InvalidArgumentError, match="malformed ReceiveRequest"):
    parse_receive(raw + b"\x22\xff")


def _sent(message):
  return type(message).FromString(message.SerializeToString())


def test_the_services_records_survive_the_wire_as_the_same_values():
  from sidecar._src.ckptfmt.records import (
    Held,
    Manifest,
    Replicated,
    SavedLeaf,
    ShardId,
  )
  done = Replicated((1, 2), 3, 4096, 0.5)
  assert wire.replicated_from_pb(_sent(wire.replicated_to_pb(done))) == done
  a, b = ShardId(("w",), ((0, 2),)), ShardId(("b", 0), ())
  held = Held({"/d/1/default": [a, b]}, {"/d/1/default": {3: [a]}})
  assert wire.held_from_pb(_sent(wire.held_to_pb(held))) == held
  manifest = Manifest(
      "dcp", [SavedLeaf(("w",), (4,), "float32", "jax.Array", (2,), '{"s": 1}')],
      [ShardRecord(ShardId(("w",), ((0, 2),)), 0, 0, "float32", (2,), 8, crc32c=7),
       ShardRecord(ShardId(("w",), ((2, 4),)), 0, None, "", (), 8)],
      {"epoch": 1}, {0: [1]}, extras={"plan": {"state": {}}}, step=5)
  info = _sent(wire.manifest_to_pb(manifest))
  assert wire.manifest_from_pb(info) == manifest
  assert json.loads(info.extras_json) == {"plan": {"state": {}}}  # the format's, as it gave it


def test_a_formats_parts_travel_in_the_format_part_oneof():
  from sidecar._src.ckptfmt.dcp import DcpCommit, DcpPart
  part = DcpPart(1, 2)  # its items are the Stage's records: only their count travels here
  stage = ckpt_pb.CheckpointStageRequest()
  wire.format_extra_to_pb(stage, part, wire.STAGE_EXTRAS)
  assert wire.format_extra_from_pb(_sent(stage), wire.STAGE_EXTRAS) == part
  assert (stage.dcp.rank, stage.dcp.item_count) == (1, 2)
  assert wire.format_extra_from_pb(ckpt_pb.CheckpointStageRequest(), wire.STAGE_EXTRAS) is None
  done = DcpCommit(b"\x80\x04N.", {0: 4096, 1: 8192}, '{"storage": []}')
  commit = ckpt_pb.CheckpointCommitRequest()
  wire.format_extra_to_pb(commit, done, wire.COMMIT_EXTRAS)
  assert wire.format_extra_from_pb(_sent(commit), wire.COMMIT_EXTRAS) == done
  with pytest.raises(errors.InvalidArgumentError, match="no format extra is a DcpCommit"):
    wire.format_extra_to_pb(stage, done, wire.STAGE_EXTRAS)
  with pytest.raises(errors.InvalidArgumentError, match=r"^dcp.item_count must be an int >= 0"):
    DcpPart(1, -1)


def test_every_registered_formats_parts_travel_under_its_one_name():
  """A format's typed parts have a wire entry, keyed (the oneof member) by its name."""
  from sidecar._src.ckptfmt import registry as formats_lib
  for fmt in formats_lib.DEFAULT.formats.values():
    for part, table, request in ((fmt.stage_extra, wire.STAGE_EXTRAS, "CheckpointStageRequest"),
                                 (fmt.commit_extra, wire.COMMIT_EXTRAS,
                                  "CheckpointCommitRequest")):
      members = {name for name, (kind, _, _) in table.items() if kind is part}
      assert members == (set() if part is None else {fmt.name}), (fmt.name, request)
      if part is not None:
        oneof = getattr(ckpt_pb, request).DESCRIPTOR.oneofs_by_name["format_part"]
        assert fmt.name in {f.name for f in oneof.fields}


@pytest.mark.parametrize("a", [np.arange(12, dtype=np.float32).reshape(3, 4),
                               np.zeros((0, 5), np.int64), np.array(7, np.uint8),
                               np.arange(300_000, dtype=np.int32)],
                         ids=["matrix", "empty", "scalar", "large"])
def test_a_read_s_inline_answer_is_the_message_protobuf_would_make(a):
  raw = wire.read_response_bytes(a)
  expected = ckpt_pb.CheckpointReadResponse()
  wire.fill_data(expected.data, a)
  assert raw == expected.SerializeToString()
  got = ckpt_pb.CheckpointReadResponse.FromString(raw)
  np.testing.assert_array_equal(wire.data_from_pb(got.data, None, "shard"), a)
