"""The cuda_misc plugin: elementwise, unary, glu, copies, rows, layout ops, reductions, sorting; multi-add,
softcap, top-k MoE and greedy-pick fusions, for CUDA devices.

The hooks only: `KERNELS` pairs each op's bind (bind.py) with its support predicate (support.py);
the fusion rules are fusion.py's. Kernel instances and launch specs are in specs/, how the kernels
work in docs/cuda_misc.md.
"""

from __future__ import annotations

from opdispatch.backends.cuda.hooks import cuda_op_hooks
from opdispatch.hookspecs import PRIORITY_BUILTIN, Kernel, PluginInfo

from . import bind, fusion, support
from .specs import layout, reduce
from .specs.elementwise import BINARY_OPS
from .specs.unary import MAP_OPS

KERNELS: tuple[Kernel, ...] = (
    *(Kernel(op, bind.bind_copy, support.copy_ok, name="copy") for op in ("cpy", "dup", "cont")),
    Kernel("get_rows", bind.bind_get_rows, support.get_rows_ok, name="get_rows"),
    Kernel("set_rows", bind.bind_set_rows, support.set_rows_ok, name="set_rows"),
    Kernel("concat", bind.binder(layout.concat_specs), support.concat_ok, name="concat"),
    Kernel("repeat", bind.binder(layout.repeat_specs), support.repeat_ok, name="repeat"),
    Kernel("pad", bind.binder(layout.pad_specs), support.f32_layout_ok, name="pad"),
    Kernel("pad_reflect_1d", bind.binder(layout.pad_reflect_specs), support.f32_layout_ok, name="pad_reflect_1d"),
    Kernel("roll", bind.binder(layout.roll_specs), support.f32_layout_ok, name="roll"),
    Kernel("diag", bind.binder(layout.diag_specs), support.f32_layout_ok, name="diag"),
    Kernel("tri", bind.binder(layout.tri_specs), support.f32_layout_ok, name="tri"),
    Kernel("arange", bind.binder(layout.arange_specs), support.arange_ok, name="arange"),
    Kernel("fill", bind.binder(layout.fill_specs), support.fill_ok, name="fill"),
    Kernel("set", bind.binder(layout.set_acc_specs), support.set_acc_ok, name="set"),
    Kernel("acc", bind.binder(layout.set_acc_specs), support.set_acc_ok, name="acc"),
    Kernel("timestep_embedding", bind.binder(layout.timestep_specs), support.timestep_ok, name="timestep_embedding"),
    Kernel("sum", bind.binder(reduce.sum_specs), support.sum_ok, name="sum"),
    Kernel("sum_rows", bind.binder(reduce.sum_rows_specs), support.row_reduce_ok, name="sum_rows"),
    Kernel("mean", bind.binder(reduce.sum_rows_specs), support.row_reduce_ok, name="mean"),
    Kernel("cumsum", bind.binder(reduce.cumsum_specs), support.row_reduce_ok, name="cumsum"),
    # few long rows (a decode step's logits) split over blocks; the rest one block a row
    Kernel("argmax", bind.bind_argmax_split, support.argmax_split_ok, name="argmax_split"),
    Kernel("argmax", bind.binder(reduce.argmax_specs), support.row_reduce_ok, name="argmax_block"),
    Kernel("count_equal", bind.binder(reduce.count_equal_specs), support.count_equal_ok, name="count_equal"),
    Kernel("argsort", bind.bind_argsort, support.argsort_ok, name="bitonic"),
    Kernel("top_k", bind.bind_top_k, support.top_k_ok, name="top_k"),
    *(Kernel(op, bind.bind_binary, support.binary_ok, name="binary") for op in BINARY_OPS),
    Kernel("add_id", bind.bind_add_id, support.add_id_ok, name="add_id"),
    *(Kernel(op, bind.bind_map, support.map_ok, name="unary") for op in MAP_OPS),
    Kernel("glu", bind.bind_glu, support.glu_ok, name="glu"),
)


plugin_info, supports_op, kernels, fusion_rules = cuda_op_hooks(
    PluginInfo("cuda_misc", "0.1.0", PRIORITY_BUILTIN,
               "elementwise, unary, glu, copies, rows, reductions, sorting; "
               "multi-add, softcap, top-k MoE, greedy-pick fusions"),
    lambda: KERNELS, lambda: fusion.FUSIONS)
