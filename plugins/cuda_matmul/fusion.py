"""When matrix products and what follows them run as one mat-vec kernel (ggml's rules).

Groups (consecutive in execution order; `can_fuse` already checked that every
node but the last is read only inside the group):
  mul_mat_add           mul_mat -> add(bias)                       one row of bias (M values), or an
                                                                   addend of the product's own shape
                                                                   (a residual: its rows evenly spaced)
  mul_mat_id_add_id     mul_mat_id -> add_id(bias, same ids)       bias (E, M)
  mul_mat_glu           mul_mat(wg, x), mul_mat(wu, x) -> glu(gate, up)
  mul_mat_add_glu       the same with a bias after each mul_mat
  mul_mat_id_glu        mul_mat_id(wg, x, ids), mul_mat_id(wu, x, ids) -> glu
  mul_mat_id_add_id_glu the same with add_id biases (gpt-oss)
  rms_norm_mul_mat      rms_norm(x) -> mul(w) -> mul_mat           a decoder's norm before its q/k/v or
  rms_norm_mul_mat_glu  rms_norm(x) -> mul(w) -> mul_mat_glu       gate/up (or LM head) product
  rms_norm_mul_mat_pair  rms_norm(x) -> mul(w) -> mul_mat, mul_mat  two products of the normed values on the
                                                                   quantized GEMMs (a gate/up pair at 9 or
                                                                   more columns, whose GLU does not fuse there)
  rms_norm_mul_mat_share  rms_norm(x) -> mul(w) -> mul_mat          the same when other nodes read the normed
                                                                   values too (a decoder's q/k stack beside
                                                                   its v), at one column: the kernel also
                                                                   writes them
  glu_mul_mat           glu(gate, up) -> mul_mat                   a decoder's down product, its b the glu's
  glu_mul_mat_add       the same with an add after the mul_mat     result, on the GEMMs of 16-bit b
The fused kernels are the mat-vec ones, mmf, mmq and mmq_small (mul_mat_add only), the GEMMs of 16-bit b
(B16_PATHS: mul_mat_add, the rms_norm and glu groups) and mmq_id and mmq_wgmma_id (the bias of add_id), so
each product must take a mat-vec path (mul_mat with N <= 8; mul_mat_id with one token for the GLU groups),
mmf (mul_mat, f16/bf16 weights, up to 16 columns), a GEMM (mul_mat -> add, more than 8 columns; cuBLAS: a
contiguous addend of the product's shape) or a quantized GEMM of mul_mat_id (mul_mat_id -> add_id with many
tokens), with b in f32.
The add may read the product as either source; the addend is only read (it may be
the residual stream other nodes read too). The kernels add element
r * bias_col + m of the addend to output row r = (i3 * B2 + i2) * N + n, column m
(`bias_col`: 0 for one row). GLU groups need both weights of one dtype, shape and
strides, the same b (and ids), and biases whose rows are spaced alike. The rms_norm
groups take mmvq_stream (its kernel quantizes x * w and scales each column's products by
the norm's rsqrt) or the quantized GEMMs (their quantize_q8_1 launch rounds rms_norm(x) * w,
once for a pair: NORM_PATHS), with x f32 of one batch and w one contiguous f32 row of K
values; the norm's kernel launch and its result's round trip through memory go
(rms_norm_mul_mat_share: the launch only; its blocks write the normed values, f32 and
contiguous as every mul's result, for the other readers). On the GEMMs of 16-bit b the
launch that converts b writes rms_norm(x) * w or glu(gate, up) in its place (convert.cu's
convert_norm, convert_glu). Anything else: a reason, and the nodes run unfused (or by a
smaller rule: cuda_norm's rms_norm -> mul).
"""

from __future__ import annotations

from typing import Sequence

import attrs

from opdispatch.graph import Graph
from opdispatch.hookspecs import Device
from opdispatch.ops.base import pad4
from opdispatch.ops.elementwise import GLU_KINDS
from opdispatch.support import whole_elements
from opdispatch.tensor import Tensor

from . import support
from .specs import B16_TYPES, KEEP_NT
from .specs.gemm import compute_type
from .specs.stream import STREAMED, ragged

MMV_PATHS = ("mmvf", "mmvq_stream", "mmvq", "mmv_id", "mmv_id_grouped")
#: the quantized GEMMs of mul_mat: a bias or residual epilogue (mq::finish), no GLU
GEMM_PATHS = ("mmq", "mmq_small")
#: the quantized GEMMs of mul_mat_id: add_id's bias (mq::store_pairs)
ID_GEMM_PATHS = ("mmq_id", "mmq_wgmma_id")
#: the GEMMs whose b goes in as 16-bit rows, converted by a launch before the product (cuBLAS: the weights' compute
#: type, f16 or bf16; mmq_wgmma: bf16). A fused rms_norm or glu before the product writes those rows itself
#: (convert.cu's convert_norm, convert_glu: the f32 values never go through memory); an add after it is the
#: product's own (cublasLt's C, a residual of the product's shape; mmq_wgmma's mq::finish, as mmq's). One batch.
B16_PATHS = ("cublas", "dequant_cublas", "mmq_wgmma")
#: the paths whose kernels take the epilogues: the mat-vecs, the tensor-core mmf, the quantized GEMMs and the
#: 16-bit-b GEMMs (a bias or a residual only), and those of mul_mat_id (add_id's bias; its GLU groups are one
#: token's, which mmv_id takes)
FUSED_PATHS = (*MMV_PATHS, "mmf", *GEMM_PATHS, *B16_PATHS, *ID_GEMM_PATHS)

#: the paths whose kernels take a fused rms_norm (the rms_norm_mul_mat groups): the mat-vec quantizing b itself,
#: the quantized GEMMs through their quantize_q8_1 launch, the 16-bit-b GEMMs through convert_norm
NORM_PATHS = ("mmvq_stream", *GEMM_PATHS, *B16_PATHS)
#: the ops a group opens with when a glu's result is the product's b (B16_PATHS only)
GLU_PREFIX = ("glu",)
#: the ops a group opens with when it fuses the rms_norm before its products
NORM_PREFIX = ("rms_norm", "mul")

#: the rule that keeps the normed values (written besides the product: position 1 of its pattern an output)
SHARE = "rms_norm_mul_mat_share"
#: the rule of two products of the normed values on the GEMMs (the first product, position 2, an output too)
PAIR = "rms_norm_mul_mat_pair"

#: (rule name, pattern), longest first: dispatch takes the first rule whose check passes (SHARE after the rule
#: that drops the normed values, which takes the group when nothing else reads them)
PATTERNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("rms_norm_mul_mat_glu", (*NORM_PREFIX, "mul_mat", "mul_mat", "glu")),
    (PAIR, (*NORM_PREFIX, "mul_mat", "mul_mat")),
    ("rms_norm_mul_mat", (*NORM_PREFIX, "mul_mat")),
    (SHARE, (*NORM_PREFIX, "mul_mat")),
    ("mul_mat_add_glu", ("mul_mat", "add", "mul_mat", "add", "glu")),
    ("mul_mat_id_add_id_glu", ("mul_mat_id", "add_id", "mul_mat_id", "add_id", "glu")),
    ("mul_mat_glu", ("mul_mat", "mul_mat", "glu")),
    ("mul_mat_id_glu", ("mul_mat_id", "mul_mat_id", "glu")),
    ("mul_mat_add", ("mul_mat", "add")),
    ("mul_mat_id_add_id", ("mul_mat_id", "add_id")),
    ("glu_mul_mat_add", (*GLU_PREFIX, "mul_mat", "add")),
    ("glu_mul_mat", (*GLU_PREFIX, "mul_mat")),
)


@attrs.frozen
class Norm:
    """A group's fused rms_norm: the products read rms_norm(x) * w (eps the norm's), which the kernel also writes
    to `out` (the group's mul node) when other nodes read them (None: it does not)."""

    x: Tensor
    w: Tensor
    eps: float
    out: Tensor | None = None


def norm_of(nodes: Sequence[Tensor], share: bool = False) -> Norm | None:
    """The fused rms_norm of a group that passed `check` (`share`: the SHARE rule's), None for a group without
    one."""
    if nodes[0].op != "rms_norm":
        return None
    norm, mul = nodes[:2]
    return Norm(norm.srcs[0], _other(mul, norm), float(norm.params["eps"]), mul if share else None)


def glu_in_of(nodes: Sequence[Tensor]) -> Tensor | None:
    """The glu whose result a group's product reads as b (the glu_mul_mat groups), None for other groups."""
    return nodes[0] if nodes[0].op == "glu" else None


def b_form(node: Tensor, path: str) -> str | None:
    """What b becomes before product `node` on `path` reads it, which one launch can write for two products: "q8_1"
    (the quantized GEMMs' quantize_q8_1), a B16_TYPES name (B16_PATHS), or None (b read as it is)."""
    if path in GEMM_PATHS:
        return "q8_1"
    if path == "mmq_wgmma":
        return "bf16"
    if path in B16_PATHS:
        ct = compute_type(node.srcs[0])
        return ct if ct in B16_TYPES else None
    return None


def _other(node: Tensor, src: Tensor) -> Tensor:
    """The source of a binary `node` that is not `src`."""
    return node.srcs[1] if node.srcs[0] is src else node.srcs[0]


def _norm_ok(device: Device, nodes: Sequence[Tensor]) -> bool | str:
    """True if the products after rms_norm -> mul (nodes[2:]) can take the norm in their kernel, else why not."""
    norm, mul, *rest = nodes
    if norm not in mul.srcs:
        return "mul does not read the rms_norm"
    x, w = norm.srcs[0], _other(mul, norm)
    if w is norm:
        return "mul squares the rms_norm"
    k = x.shape[-1]
    if mul.shape != x.shape:
        return f"mul broadcasts the rms_norm result into {mul.shape}"
    if w.dtype.name != "f32" or w.size != k or w.shape[-1] != k or not w.is_contiguous():
        return f"the norm weight {w.describe()} is not one contiguous f32 row of {k} values"
    if x.dtype.name != "f32" or pad4(x.shape)[:2] != (1, 1):
        return f"the rms_norm input {x.describe()} is not f32 of one batch"
    for p in (n for n in rest if n.op == "mul_mat"):
        if p.srcs[1] is not mul:
            return "a mul_mat does not read the normed values as b"
        path = support.choose(p, device).path
        if path not in NORM_PATHS:
            return f"mul_mat takes {path}; the rms_norm fuses into {', '.join(NORM_PATHS)} only"
        if path in B16_PATHS and b_form(p, path) is None:
            return f"mul_mat takes {path} with {p.srcs[0].dtype.name} weights, which reads b as it is"
    return True


def check_share(device: Device, nodes: Sequence[Tensor], graph: Graph) -> bool | str:
    """`check` for the SHARE rule, whose kernel instances take KEEP_NT columns (one sequence's decode)."""
    n = support.batch_n(nodes[-1])
    if n != KEEP_NT:
        return f"{n} columns: the kernels that write the normed values take {KEEP_NT}"
    w = nodes[-1].srcs[0]
    if w.dtype.name in STREAMED and ragged(w.dtype.name, w.shape[-1]):
        return "rows that are not whole chunks: the kernels that write the normed values take whole chunks"
    return check(device, nodes, graph)


def check_pair(device: Device, nodes: Sequence[Tensor], graph: Graph) -> bool | str:
    """`check` for the PAIR rule: both products on GEMMs that take b in one form (one quantize_q8_1 or
    convert_norm launch feeds both)."""
    forms = []
    for p in nodes[2:]:
        path = support.choose(p, device).path
        if path not in (*GEMM_PATHS, *B16_PATHS):
            return (f"mul_mat takes {path}; two products share the fused rms_norm on "
                    f"{', '.join((*GEMM_PATHS, *B16_PATHS))} only")
        forms.append(b_form(p, path))
    if forms[0] != forms[1]:
        return f"the two products take b as {forms[0]} and {forms[1]}: one launch writes one form"
    return check(device, nodes, graph)


def _mmv(device: Device, node: Tensor, glu: bool) -> bool | str:
    """True if `node` runs on a path that fuses (a mat-vec, mmf, or without `glu` a quantized GEMM) with an f32 b,
    else why not."""
    c = support.choose(node, device)
    if c.reason:
        return f"{node.op}: {c.reason}"
    if c.path not in FUSED_PATHS:
        return f"{node.op} takes {c.path}, whose kernels take no fused epilogue (batch {support.batch_n(node)})"
    if glu and c.path in (*GEMM_PATHS, *B16_PATHS):
        return f"{node.op} takes {c.path}, which fuses a bias or residual, not a GLU (batch {support.batch_n(node)})"
    if c.path in B16_PATHS and pad4(node.shape)[:2] != (1, 1):
        return f"{node.op} takes {c.path}, whose fused groups are one batch's, not {node.shape}"
    if node.srcs[1].dtype.name != "f32":
        return f"{node.op}: b must be f32 to fuse, got {node.srcs[1].dtype.name}"
    return True


def _one_row(prod: Tensor, bias: Tensor) -> bool:
    """The addend is one row of the product's M values (a bias added to every output row)."""
    m = prod.shape[-1]
    return bias.size == m and bias.shape[-1] == m


def _row_step(t: Tensor) -> int | None:
    """Bytes from one row of t to the next, its axes but the last flattened in order (0 for one row), or None
    when its rows are not evenly spaced (a batch axis's stride is not its inner axes' rows times the step)."""
    axes = [(n, s) for n, s in zip(t.shape[:-1], t.strides[:-1]) if n > 1]
    if not axes:
        return 0
    step = want = axes[-1][1]
    for n, s in reversed(axes):
        if s != want:
            return None
        want = s * n
    return step


def bias_col(prod: Tensor, bias: Tensor | None) -> int:
    """The kernels' bias_col for the addend of a group that passed `check`: floats from one of its rows to the
    next, 0 for one row (or none)."""
    if bias is None or _one_row(prod, bias):
        return 0
    return _row_step(bias) // bias.dtype.block_bytes


def _bias_ok(prod: Tensor, add: Tensor) -> bool | str:
    """True if the kernel can add the bias that an add/add_id after `prod` adds, else why not."""
    if add.op == "add":
        if prod not in add.srcs:
            return "add does not read the mul_mat before it"
        bias = _bias_of(prod, add)
        if bias is prod:
            return "add adds the mul_mat to itself"
        if add.shape != prod.shape:
            return f"add broadcasts the mul_mat result into {add.shape}"
        m = prod.shape[-1]
        if not _one_row(prod, bias) and pad4(bias.shape) != pad4(prod.shape):
            return (f"the addend {bias.describe()} is neither one row of {m} values nor of the product's shape "
                    f"{prod.shape} (other broadcasts do not fuse)")
    else:  # add_id(prod, bias, ids)
        if add.srcs[0] is not prod:
            return "add_id does not add to the mul_mat_id before it"
        bias = add.srcs[1]
        if add.srcs[2] is not prod.srcs[2]:
            return "add_id reads other ids than the mul_mat_id"
    if bias.dtype.name != "f32":
        return f"the bias {bias.describe()} must be f32"
    if not bias.rows_contiguous() or not whole_elements(bias):
        return f"the bias {bias.describe()} rows must be contiguous"
    if add.op == "add" and _row_step(bias) is None:
        return f"the addend {bias.describe()} rows are not evenly spaced (strides {bias.strides})"
    if add.dtype.name != "f32" or not add.is_contiguous():
        return f"{add.op} must give a contiguous f32 result"
    return True


def _addend_ok(device: Device, prod: Tensor, add: Tensor) -> bool | str:
    """True if the path of `prod` adds what `add` adds (a check after _bias_ok), else why not: cuBLAS adds its C, a
    contiguous matrix of the product's shape, not one row or spaced rows."""
    path = support.choose(prod, device).path
    bias = _bias_of(prod, add)
    if path in ("cublas", "dequant_cublas") and (pad4(bias.shape) != pad4(prod.shape) or not bias.is_contiguous()):
        return (f"mul_mat takes {path}, which adds a contiguous addend of the product's shape {prod.shape} (its C), "
                f"not {bias.describe()} {bias.strides}")
    return True


def _glu_form_ok(glu: Tensor) -> bool | str:
    """True if a fused kernel computes `glu` (gate and up two tensors, a known kind, not swapped), else why not."""
    if glu.srcs[1] is None:
        return "glu over one tensor's halves, not a gate and an up tensor"
    if glu.params.get("swapped"):
        return "swapped glu"
    if glu.params["kind"] not in GLU_KINDS:
        return f"unknown glu kind {glu.params['kind']}"
    return True


def _glu_in_ok(device: Device, nodes: Sequence[Tensor]) -> bool | str:
    """True if the glu a group opens with can be written as the b of the product after it, else why not."""
    glu, prod = nodes[:2]
    why = _glu_form_ok(glu)
    if why is not True:
        return why
    if prod.srcs[1] is not glu:
        return "the mul_mat does not read the glu's result as b"
    for t in glu.srcs:
        if t.dtype.name != "f32" or not t.is_contiguous() or t.shape != glu.shape:
            return f"the glu's sources must be contiguous f32 of its shape {glu.shape}, got {t.describe()}"
    c = support.choose(prod, device)
    if c.reason:
        return f"mul_mat: {c.reason}"
    if c.path not in B16_PATHS or b_form(prod, c.path) is None:
        return f"mul_mat takes {c.path}; a glu's result is written as b for {', '.join(B16_PATHS)} (16-bit b) only"
    return True


def _bias_of(prod: Tensor, add: Tensor) -> Tensor:
    return add.srcs[1] if add.op == "add_id" else _other(add, prod)


def parts(nodes: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor | None], Tensor | None]:
    """(the products, their biases (None where absent), the glu node or None) of a group
    that passed `check`; a GLU group's pair comes as (gate, up), glu's first source first. A fused
    rms_norm (norm_of) is not among them."""
    if nodes[0].op == "rms_norm":
        nodes = nodes[2:]
    elif nodes[0].op == "glu":
        nodes = nodes[1:]
    glu = nodes[-1] if nodes[-1].op == "glu" else None
    groups: list[list] = []  # [product, bias, the node glu reads]
    for n in nodes[:-1] if glu is not None else nodes:
        if n.op in ("mul_mat", "mul_mat_id"):
            groups.append([n, None, n])
        else:
            groups[-1][1] = _bias_of(groups[-1][0], n)
            groups[-1][2] = n
    if glu is not None and glu.srcs[0] is groups[1][2]:
        groups.reverse()
    return [g[0] for g in groups], [g[1] for g in groups], glu


def check(device: Device, nodes: Sequence[Tensor], graph: Graph) -> bool | str:
    """True if one mat-vec kernel computes `nodes` (see the module docstring); else why not."""
    if nodes[0].op == "rms_norm":
        why = _norm_ok(device, nodes)
        if why is not True:
            return why
        nodes = nodes[2:]
    elif nodes[0].op == "glu":
        why = _glu_in_ok(device, nodes)
        if why is not True:
            return why
        nodes = nodes[1:]
    glu = nodes[-1] if nodes[-1].op == "glu" else None
    body = list(nodes[:-1] if glu is not None else nodes)
    prods = [n for n in body if n.op in ("mul_mat", "mul_mat_id")]
    for p in prods:
        why = _mmv(device, p, glu is not None)
        if why is not True:
            return why
    ends = []
    for i, n in enumerate(body):
        if n.op in ("add", "add_id"):
            why = _bias_ok(body[i - 1], n)
            if why is True:
                why = _addend_ok(device, body[i - 1], n)
            if why is not True:
                return why
            ends.append(n)
    if glu is None:
        return True
    heads = ends if ends else prods
    why = _glu_form_ok(glu)
    if why is not True:
        return why
    if {id(s) for s in glu.srcs} != {id(h) for h in heads}:
        return "glu does not combine the two products"
    if glu.dtype.name != "f32" or not glu.is_contiguous():
        return "glu must give a contiguous f32 result"
    g, u = prods
    wg, wu = g.srcs[0], u.srcs[0]
    if g.srcs[1] is not u.srcs[1]:
        return "the two products read different inputs"
    if g.op == "mul_mat_id":
        if g.srcs[2] is not u.srcs[2]:
            return "the two products read different ids"
        if g.shape[0] != 1:
            return f"{g.shape[0]} tokens: the fused GLU is for one token"
    _, biases, _ = parts(nodes)
    if None not in biases and g.op == "mul_mat_id" and biases[0].strides != biases[1].strides:
        return "the two add_id biases have different strides"
    if None not in biases and g.op == "mul_mat" and bias_col(g, biases[0]) != bias_col(u, biases[1]):
        return "the two addends' rows are spaced differently (the kernels take one bias_col)"
    if (wg.dtype, wg.shape, wg.strides) != (wu.dtype, wu.shape, wu.strides):
        return (f"the weights differ in dtype, shape or strides: {wg.describe()} {wg.strides} "
                f"and {wu.describe()} {wu.strides}")
    return True
