"""Stage 3's unit schedule (csrc/engine/unit_schedule.h: Note [Stage 3 unit sequence]) through
the binding, table by table: a pass's needs in, the units gathered ahead (and whether in one
collective) out. csrc/core/tests/test_unit_schedule.cpp checks the same rules under the sanitizers.

Run: .venv/bin/python -m pytest -q tests/test_unit_schedule.py
"""
import pytest

from zero_ext._C import UnitSchedule, buffer_bytes, replay_peak


def run(s, held: set, rows: str) -> None:
    """rows: "F3>1,2" unit 3's forward fetches 1 and 2 one by one; "B2>+1,3" unit 2's backward
    fetches 1 and 3 together; "F1>" nothing. A unit is dropped from `held` after its backward,
    and after its forward unless the schedule keeps it."""
    for row in rows.split():
        need, want = row.split(">")
        k, backward = int(need[1:]), need[0] == "B"
        if k:
            s.need(k, backward)
        together, launch = s.ahead_of(k, backward, sorted(held))
        got = ("+" if together else "") + ",".join(map(str, launch))
        assert got == want, f"{row}: fetched {got!r}"
        held.update(launch)
        if k:
            held.add(k)
            if backward or not s.kept_after_forward(k):
                held.discard(k)


def test_registration_order_then_its_reverse():
    s, held = UnitSchedule([10, 100, 100, 100], 1, 0), set()
    s.begin_pass(True)
    run(s, held, "F0>1 F1>2 F2>3 F3>")
    assert held == {3}, "only the last unit is kept across the loss"
    s.end_forward(True, True)
    run(s, held, "B3>2 B2>1 B1>")
    assert not held and s.fetches == 6 and s.out_of_order == 0


def test_small_units_coalesce_once_half_the_window_is_missing():
    s, held = UnitSchedule([10, 5, 5, 5, 5, 1000], 1, 16), set()
    s.begin_pass(False)
    run(s, held, "F0>+1,2,3 F1> F2>4 F3> F4>5 F5>")
    s, held = UnitSchedule([10, 5, 5, 5], 0, 16), set()   # prefetch_depth 0: nothing ahead or kept
    s.begin_pass(True)
    run(s, held, "F0> F1> F2> F3>")
    assert not held


def test_a_pass_out_of_order_is_learned():
    s, held = UnitSchedule([1, 1, 1, 1], 1, 0), set()
    s.begin_pass(True)
    run(s, held, "F0>1 F3> F1> F2>")   # F1 meets the guess's B1: nothing predicted after it
    s.end_forward(True, True)          # backward guessed: this forward reversed
    run(s, held, "B2>1 B2> B1> B3>")   # one backward need per unit in a row
    held.clear()
    s.begin_pass(True)
    run(s, held, "F0>3 F3>1 F1>2 F2>")
    s.end_forward(True, True)
    run(s, held, "B2>1 B1>3 B3>")


def test_an_evaluation_or_a_compiled_pass_is_not_learned():
    s, held = UnitSchedule([1, 1, 1, 1], 1, 0), set()
    s.begin_pass(True)
    run(s, held, "F0>1 F3> F1> F2>")
    s.end_forward(True, True)          # its loss is dropped: no backward
    held.clear()
    s.begin_pass(True)
    run(s, held, "F0>1")               # registration order again
    s.stop_recording()
    held.clear()
    s.begin_pass(False)
    run(s, held, "F0>1 F2>3 F3>")      # the cursor resynchronizes on 2


def test_replay_peak():
    assert replay_peak([10, 100, 100, 100], 2, 1, 0, 2) == 400     # the computing unit and the next
    assert replay_peak([10, 100, 100, 100], 2, 0, 0, 2) == 200
    assert replay_peak([10, 5, 5, 5], 4, 1, 16, 2) == (15 + 15 + 7) * 4   # + the staging pair
    assert replay_peak([10], 4, 1, 16, 2) == 0


def test_bad_input_raises():
    with pytest.raises(ValueError, match="one element count"):
        UnitSchedule([], 1, 0)
    with pytest.raises(IndexError, match="not one of the 2 units"):
        UnitSchedule([1, 1], 1, 0).need(2, False)
    with pytest.raises(ValueError, match="one unit and one padded count per bucket"):
        buffer_bytes([0], [1, 2], [], stage=2, world=2, param_bytes=2, reduce_bytes=2, grad_ring_buckets=1,
                     depth=0, coalesce_numel=0, accum=1, piece_align=1, slice_align=1, alltoall=False,
                     on_meta=False, narrow_wire=False)
