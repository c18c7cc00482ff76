"""Tier 1: one CheckpointOptions checks a checkpointer's options once, for JAX and PyTorch."""

import re

import pytest

from sidecar._src.ckptfmt import registry as formats_lib
from sidecar._src.controller.checkpoint.options import CheckpointOptions, options_or
from sidecar._src.core import errors
from tests.support.fake_sidecars import FakeSidecars, checkpointer

pytestmark = pytest.mark.unit

# The registered formats as messages list them (a new format changes no test here).
NAMES = re.escape(repr(formats_lib.DEFAULT.names))


@pytest.mark.parametrize("kwargs, match", [
    ({"max_to_keep": 0}, r"max_to_keep must be None or an int >= 1, got 0"),
    ({"keep_period": "5"}, r"keep_period must be None or an int >= 1, got '5'"),
    ({"replicas": -1}, r"replicas must be an int >= 0 \(other sidecars that keep each shard\), "
     r"got -1"),
    ({"replicas": True}, r"replicas must be an int >= 0 .*got True"),
    ({"ram_steps": 1.5}, r"ram_steps must be an int >= 0 \(0: the RAM tier keeps no step\)"),
    ({"ram_budget": -1}, r"ram_budget must be None or bytes \(an int >= 0\), got -1"),
    ({"replica_bandwidth": "fast"}, r"replica_bandwidth: cannot parse size 'fast'; write e.g."),
    ({"replica_bandwidth": 0}, r"replica_bandwidth must be None or bytes per second .*got 0"),
    ({"if_busy": "later"}, r"if_busy must be 'wait' or 'skip', got 'later'"),
    ({"format": "safetensors"}, r"format must be None \(the framework's own\) or one of the "
                                rf"registered formats {NAMES}, got 'safetensors'"),
    ({"format": ""}, r"format must be None .*got ''"),
    ({"format": "colocated-sidecar"}, r"format must be None .*got 'colocated-sidecar'"),
], ids=["max_to_keep", "keep_period", "replicas", "replicas-bool", "ram_steps", "ram_budget",
        "bandwidth-text", "bandwidth-zero", "if_busy", "format", "format-empty",
        "format-old-spelling"])
def test_a_bad_option_is_refused_naming_the_value_and_what_it_must_be(kwargs, match):
  with pytest.raises(errors.InvalidArgumentError, match=match):
    CheckpointOptions(**kwargs)


def test_options_are_frozen_keyword_only_and_a_size_becomes_bytes():
  options = CheckpointOptions(replicas=1, replica_bandwidth="2MiB")
  assert options.replica_bandwidth == options.bandwidth == 2 << 20
  with pytest.raises(AttributeError):
    options.replicas = 2  # type: ignore[misc]
  with pytest.raises(TypeError):
    CheckpointOptions(3)  # type: ignore[misc]


def test_a_format_is_the_chosen_one_or_the_frameworks_and_one_it_writes():
  from sidecar._src.ckptfmt.dcp import DcpCommit, DcpPart
  dcp_extras = (DcpPart, DcpCommit)
  assert CheckpointOptions().format_for("JAX", default="orbax") == "orbax"
  assert CheckpointOptions().format_for("PyTorch", default="dcp", extras=dcp_extras) == "dcp"
  assert CheckpointOptions(format="dcp").format_for("PyTorch", default="dcp",
                                                    extras=dcp_extras) == "dcp"
  # The registered formats each framework writes (a new format changes no test here).
  writes = {p: [n for n, f in sorted(formats_lib.DEFAULT.formats.items())
                if (f.stage_extra, f.commit_extra) == p] for p in ((None, None), dcp_extras)}
  assert "orbax" in writes[None, None] and writes[dcp_extras] == ["dcp"]
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"format 'dcp' is not one a JAX save writes \(it needs DcpPart and "
                     r"DcpCommit, the save makes no format extras\); choose one of "
                     + re.escape(repr(writes[None, None]))):
    CheckpointOptions(format="dcp").format_for("JAX", default="orbax")
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"format 'orbax' is not one a PyTorch save writes \(it needs no "
                     r"format extras, the save makes DcpPart and DcpCommit\); choose one of "
                     r"\['dcp'\]"):
    CheckpointOptions(format="orbax").format_for("PyTorch", default="dcp", extras=dcp_extras)


def test_options_or_the_keyword_arguments_not_both():
  given = CheckpointOptions(max_to_keep=3)
  assert options_or(given, replicas=0, if_busy="wait") is given
  assert options_or(None, replicas=2) == CheckpointOptions(replicas=2)
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"give either options=CheckpointOptions\(...\) or max_to_keep, "
                           r"replicas, not both"):
    options_or(given, replicas=1, max_to_keep=None)


def test_the_core_checkpointer_checks_its_options_with_the_same_type():
  with pytest.raises(errors.InvalidArgumentError, match=r"ram_steps must be an int >= 0"):
    checkpointer(FakeSidecars(), ram_steps=-1)
