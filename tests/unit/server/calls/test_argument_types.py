"""Tier 1: a pipeline's keyword arguments and a function's arguments are checked against
their annotations."""

import inspect
from typing import Literal, Optional

import numpy as np
import pytest

import sidecar
from sidecar._src.server.calls import argument_types

pytestmark = pytest.mark.unit


class Config:
  pass


class Opaque:
  """A value of a type no annotation names; its repr is the same in every process (test
  ids must be, for pytest-xdist's workers to agree on them)."""

  def __repr__(self) -> str:
    return "Opaque()"


def pipeline(ctx, n: int = 3, rate: float = 1.0, split: Optional[str] = None,  # noqa: UP045
             mode: Literal["a", "b"] = "a", sizes: list[int] | None = None,
             table: np.ndarray | None = None, config: Config | None = None, free=None):
  return []


@pytest.mark.parametrize("kwargs", [
    {"n": 3}, {"n": np.int64(3)}, {"rate": 2}, {"rate": np.float32(2)}, {"split": None},
    {"split": "train"}, {"mode": "b"}, {"sizes": [1, 2]}, {"sizes": None},
    {"table": np.zeros(2)}, {"table": [1]}, {"config": "anything"}, {"free": Opaque()},
], ids=repr)
def test_what_the_annotations_allow_goes_through(kwargs):
  argument_types.check(pipeline, kwargs, what="pipeline 'p'")


@pytest.mark.parametrize("kwargs,match", [
    ({"n": "ten"}, r"argument 'n' must be int \(as annotated\), got str 'ten'"),
    ({"n": True}, r"argument 'n' must be int .*got bool True"),
    ({"n": 2.5}, r"argument 'n' must be int .*got float 2.5"),
    ({"rate": "fast"}, r"argument 'rate' must be float"),
    ({"split": 1}, r"argument 'split' must be Optional\[str\] .*got int 1"),
    ({"mode": "c"}, r"argument 'mode' must be Literal\['a', 'b'\]"),
    ({"sizes": (1, 2)}, r"argument 'sizes' must be list\[int\] \| None .*got tuple"),
], ids=["str-for-int", "bool-for-int", "float-for-int", "str-for-float", "optional",
        "literal", "tuple-for-list"])
def test_a_value_its_annotation_refuses_names_the_parameter_and_the_type(kwargs, match):
  with pytest.raises(sidecar.InvalidArgumentError, match=r"^pipeline 'p': " + match):
    argument_types.check(pipeline, kwargs, what="pipeline 'p'")


def test_annotations_that_cannot_be_resolved_are_not_checked():
  def p(ctx, n: "NotAName" = 1):  # noqa: F821
    return []
  argument_types.check(p, {"n": "ten"}, what="pipeline 'p'")


def function(n: int, *rest: int, scale: float = 1.0, **named: str):
  return n


@pytest.mark.parametrize("args,kwargs,match", [
    (("x",), {}, r"function 'f': argument 'n' must be int \(as annotated\), got str 'x'"),
    ((1, 2, "3"), {}, r"argument 'rest\[1\]' must be int .*got str '3'"),
    ((1,), {"scale": "2"}, r"argument 'scale' must be float .*got str '2'"),
    ((1,), {"tag": 5}, r"argument 'tag' must be str .*got int 5"),
], ids=["positional", "var-positional", "keyword", "var-keyword"])
def test_a_functions_positional_and_keyword_arguments_are_checked(args, kwargs, match):
  with pytest.raises(sidecar.InvalidArgumentError, match=match):
    argument_types.check_call(function, inspect.signature(function), args, kwargs,
                              what="function 'f'")
