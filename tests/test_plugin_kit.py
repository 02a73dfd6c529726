"""The plugin kit on the CPU: the predicate-table helpers, named kernel arguments, device facts, the scratch pool."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

import opdispatch as od
from opdispatch import support
from opdispatch.hookspecs import Device
from opdispatch.backends.cuda.args import ArgGroup, KernelArgs, Shape4, boolean, f32, i32, i64, instance, ptr, u32
from opdispatch.backends.cuda.devices import H200, facts
from opdispatch.backends.cuda.kernels import KernelSpec, kernel_param_types, kernel_params, opt_in_smem
from opdispatch.backends.cuda.scratch import MIN_BYTES, ScratchPool, Workspace


def test_first_failure_gives_true_or_the_first_failing_reason() -> None:
    x = od.input("x", (4, 8))
    rules = ((lambda t: t.ndim == 2, "2-d"), (lambda t: t.shape[0] == 3, "3 rows"), (lambda t: False, "never"))
    assert support.first_failure(x, rules) == "3 rows"
    assert support.first_failure(x, rules[:1]) is True


def test_whole_elements_checks_the_view_offset() -> None:
    x = od.input("x", (4, 8))
    assert support.whole_elements(x)
    assert support.whole_elements(x.view((3, 8), offset=32))
    assert not support.whole_elements(x.view((3, 4), offset=2)), "an f32 view at byte offset 2"
    assert not support.whole_elements(x.view((3, 4), (30, 4))), "a row stride of 30 bytes"
    assert support.whole_elements(None)


def test_block_formats_need_16_bit_words() -> None:
    w = od.param("w", np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32), "q8_0")
    assert support.access_unit(w) == 2
    assert support.whole_elements(w.view((2, 32), (68, 34), offset=68))
    assert not support.whole_elements(w.view((2, 32), (68, 34), offset=1))


def test_odd_size_blocks_are_read_by_bytes() -> None:
    """mxfp4's 17-byte blocks: their traits read bytes, so any offset of whole blocks is whole accesses."""
    w = od.param("w", np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32), "mxfp4")
    assert support.access_unit(w) == 1 and w.strides == (34, 17)
    assert support.whole_elements(w.view((2, 32), (34, 17), offset=17))


def test_dynamic_shared_memory_limit_only_grows() -> None:
    """One instance can serve nodes of several sizes: binding a smaller one after a larger must not lower
    the function's limit under the larger launch (the 1b Q4_K_M decode failed so on the H200)."""

    class Fn:
        max_dynamic_shared_size_bytes = 0

    fn = Fn()
    opt_in_smem(fn, 40 * 1024)  # under the 48 KiB default: nothing to opt into
    assert fn.max_dynamic_shared_size_bytes == 0
    for smem, limit in ((84480, 84480), (76416, 84480), (118272, 118272), (50000, 118272)):
        opt_in_smem(fn, smem)
        assert fn.max_dynamic_shared_size_bytes == limit


def test_row_packing_checks() -> None:
    x = od.input("x", (2, 3, 8))
    assert support.inner_packed(x, 3) and support.rows_apart(x) and support.rows_packed(x)
    t = x.permute(0, 2, 1)
    assert not support.rows_packed(t) and not support.inner_packed(t, 2)
    assert not support.rows_apart(x.view((3, 8), (16, 4)))
    assert support.contiguous_vector(od.input("v", (5,))) and not support.contiguous_vector(x)
    assert support.outer_rows(x) == 6
    assert support.fits_int(0, support.INT_MAX) and not support.fits_int(support.INT_MAX + 1)


@attrs.frozen
class _Layout(ArgGroup):
    d0: np.uint32 = u32()
    s0: np.int64 = i64()


@attrs.frozen
class _Args(KernelArgs):
    KERNELS = ("toy",)
    x: np.uint64 = ptr()
    n: np.int32 = i32()
    a: _Layout = attrs.field()
    eps: np.float32 = f32()
    in_: np.bool_ = boolean()


def test_kernel_args_convert_name_and_refuse() -> None:
    args = _Args(x=2**40, n=7, a=_Layout(3, -8), eps=0.5, in_=True)
    values = args.values()
    assert [type(v) for v in values] == [np.uint64, np.int32, np.uint32, np.int64, np.float32, np.bool_]
    assert [int(v) for v in values[:4]] == [2**40, 7, 3, -8]
    assert _Args.names() == ("x", "n", "ad0", "as0", "eps", "in")
    assert attrs.evolve(args, n=9).values()[1] == 9
    with pytest.raises(OverflowError, match="int"):
        _Args(x=1, n=2**31, a=_Layout(0, 0), eps=0.0, in_=False)
    with pytest.raises(OverflowError, match="pointer"):
        _Args(x=-1, n=0, a=_Layout(0, 0), eps=0.0, in_=False)
    with pytest.raises(TypeError, match="integer"):
        _Args(x=1, n=2.5, a=_Layout(0, 0), eps=0.0, in_=False)
    with pytest.raises(TypeError, match="bool"):
        _Args(x=1, n=2, a=_Layout(0, 0), eps=0.0, in_=1)
    spec = KernelSpec(__file__, "toy", 1, 32, args)  # type: ignore[arg-type]
    assert spec.arg_values == values


def test_instance_names() -> None:
    assert instance("k", 128, True, False, "float") == "k<128, true, false, float>"
    assert instance("k") == "k"


def test_kernel_params_expand_parameter_macros(tmp_path) -> None:
    (tmp_path / "h.cuh").write_text("#define GROUP(p) int p##n, \\\n    long long p##s\n")
    cu = tmp_path / "k.cu"
    cu.write_text('#include "h.cuh"\n// __global__ void fake(int no)\ntemplate <int B>\n'
                  "__global__ void __launch_bounds__(B) k(const float* __restrict__ x, GROUP(a), float y[4]) {\n}\n"
                  "__global__ void k2() {}\n")
    assert kernel_params(cu) == {"k": ("x", "an", "as", "y"), "k2": ()}
    assert kernel_param_types(cu) == {"k": (np.uint64, np.int32, np.int64, np.uint64), "k2": ()}


def test_kernel_param_types_name_a_parameter_of_no_scalar_type(tmp_path) -> None:
    cu = tmp_path / "k.cu"
    cu.write_text("__global__ void k(int n, half h) {}\n")
    with pytest.raises(ValueError, match="k's parameter h is a half"):
        kernel_param_types(cu)


def test_device_facts_fall_back_to_the_h200_description() -> None:
    f = facts(H200)
    assert (f.sm_count, f.smem_per_sm, f.smem_per_block_optin, f.warp_size) == (132, 228 * 1024, 227 * 1024, 32)
    small = facts(Device("cuda0", "cuda", "a small GPU", {"sm_count": 4, "smem_per_sm": 100 * 1024}))
    assert (small.sm_count, small.smem_per_sm, small.smem_per_block) == (4, 100 * 1024, 48 * 1024)


@attrs.define
class _Buf:
    nbytes: int
    what: str
    filled: int | None = None


def test_scratch_pool_shares_a_role_and_grows_it() -> None:
    made: list[_Buf] = []

    def alloc(n: int, what: str) -> _Buf:
        made.append(_Buf(n, what))
        return made[-1]

    def fill(buf: _Buf, byte: int) -> None:
        buf.filled = byte

    pool = ScratchPool(alloc, fill)
    a = pool.take(Workspace(100, "partials"))
    assert pool.take(Workspace(MIN_BYTES, "partials")) is a and a.nbytes == MIN_BYTES and a.filled is None
    big = pool.take(Workspace(MIN_BYTES + 1, "partials"))
    assert big is not a and big.nbytes == MIN_BYTES + 1
    c1, c2 = pool.take_all((Workspace(8, "counters", zeroed=True), Workspace(4, "counters", zeroed=True)))
    assert c1 is c2 and c1.filled == 0 and len(made) == 3
    with pytest.raises(ValueError, match="counters"):
        pool.take(Workspace(8, "counters"))


@attrs.frozen
class _Strided(KernelArgs):
    KERNELS = ("strided",)
    x: np.uint64 = ptr()
    _shape: Shape4 = attrs.field()


def test_a_group_field_named_with_an_underscore_adds_no_prefix() -> None:
    args = _Strided(x=8, shape=Shape4(1, 2, 3, 4, 40, 30, 20, 10))
    assert _Strided.names() == ("x", "n0", "n1", "n2", "n3", "s0", "s1", "s2", "s3")
    assert [int(v) for v in args.values()] == [8, 1, 2, 3, 4, 40, 30, 20, 10]
    # its parameters read by their C names, as the kernel's: args.n1 is args._shape.n1
    assert (int(args.x), int(args.n1), int(args.s3)) == (8, 2, 10)
    with pytest.raises(AttributeError, match="_Strided has no argument 'n4'"):
        args.n4  # noqa: B018
