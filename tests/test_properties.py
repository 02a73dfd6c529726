"""Property-based tests (hypothesis): memory placement and views over random cases."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import opdispatch as od
from opdispatch import ops
from opdispatch.alloc import ALIGN, MemoryPlan, align, overlapping

slots = st.lists(
    st.tuples(st.integers(1, 10_000), st.integers(0, 40), st.integers(0, 10)),  # bytes, first, length
    min_size=1, max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(slots)
def test_placement_never_overlaps_live_slots(spec: list[tuple[int, int, int]]) -> None:
    mem = MemoryPlan()
    for i, (nbytes, first, length) in enumerate(spec):
        mem.add(i, nbytes, first, first + length)
    mem.place()
    assert not overlapping(mem.slots)
    assert all(s.offset % ALIGN == 0 for s in mem.slots)
    # The arena holds the largest set of slots live at one step, and never more than all of them.
    live_max = max(sum(align(n) for n, f, ln in spec if f <= step <= f + ln) for step in range(0, 51))
    assert live_max <= mem.peak <= mem.total()


shapes = st.lists(st.integers(1, 5), min_size=2, max_size=4)


@settings(max_examples=60, deadline=None)
@given(shapes, st.randoms(use_true_random=False))
def test_permuted_views_read_like_numpy(shape: list[int], rnd) -> None:  # noqa: ANN001
    axes = list(range(len(shape)))
    rnd.shuffle(axes)
    x = od.input("x", shape)
    y = ops.cont(x.permute(*axes))
    values = np.random.default_rng(rnd.randrange(2**32)).uniform(-1, 1, shape).astype(np.float32)
    (out,) = od.compile(y, "cpu").run({x: values})
    np.testing.assert_array_equal(out, values.transpose(axes))
