"""The verdict on a trainer past its stall timeout (core/stall.py's judge): busy is not hung."""

import pytest

from sidecar._src.core import stall

pytestmark = pytest.mark.unit
V = stall.Verdict


@pytest.mark.parametrize("since, busy, others, want", [
    (12.0, True, False, V.SLOW),  # it works: left to work
    (12.0, False, True, V.WAITING),  # idle while another works: it waits for it
    (12.0, False, False, V.HUNG),  # idle, none works: stopped at its timeout
    (12.0, None, True, V.HUNG),  # its work cannot be read: as before the rule
    (10.0 * stall.SLOW_MULTIPLE + 0.1, True, False, V.HUNG),  # past the bound: a livelock
    (10.0 * stall.SLOW_MULTIPLE + 0.1, False, True, V.HUNG),
    (10.0 * stall.SLOW_MULTIPLE, True, True, V.SLOW),  # at it, not past
], ids=["slow", "waiting", "hung", "unknown", "slow-past-bound", "waiting-past-bound",
        "at-bound"])
def test_busy_is_not_hung(since, busy, others, want):
  assert stall.judge(since, 10.0, busy=busy, others_work=others) is want


def test_the_bound_holds_the_held_out_case():
  # An undeclared evaluation of twice the timeout is never past the bound.
  assert stall.SLOW_MULTIPLE > 2
