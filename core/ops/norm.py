"""Normalizations over rows (the last axis) and over channel groups.

All take f32 `x` of 1..4 dims with any strides and return a contiguous f32
tensor of x's shape. `eps` must be finite and >= 0 (ggml asserts eps >= 0 in
the kernel; we check at build time).
"""

from __future__ import annotations

from ..tensor import Tensor
from .base import check_dtype, check_rank, check_tensor, float_param, int_param, node, op

__all__ = ["norm", "rms_norm", "l2_norm", "group_norm"]


def _norm_node(op_name: str, x: Tensor, eps: float, *groups: object) -> Tensor:
    """Validate x, eps (and group_norm's groups, given as the one extra argument); the f32 result node of
    x's shape."""
    check_tensor(op_name, x, "x")
    check_dtype(op_name, x, ("f32",), "x")
    check_rank(op_name, x, 1, 4)
    params: dict = {"eps": float_param(op_name, "eps", eps, x, lo=0.0)}
    if groups:
        params["groups"] = int_param(op_name, "groups", groups[0], x, lo=1)
    return node(op_name, (x,), x.shape, "f32", params)


@op("norm", reuses_src0=True)
def norm(x: Tensor, eps: float = 1e-5) -> Tensor:
    """Layer norm without affine terms, per row: (x - mean) / sqrt(var + eps) (ggml_norm).

    mean and var (biased, divided by n) are over the last axis.
    """
    return _norm_node("norm", x, eps)


@op("norm", reuses_src0=True)
def rms_norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """RMS norm per row: x / sqrt(mean(x**2) + eps) over the last axis (ggml_rms_norm)."""
    return _norm_node("rms_norm", x, eps)


@op("norm", reuses_src0=True)
def l2_norm(x: Tensor, eps: float = 1e-12) -> Tensor:
    """L2 normalization per row: x / max(||x||_2, eps) over the last axis (ggml_l2_norm)."""
    return _norm_node("l2_norm", x, eps)


@op("norm", reuses_src0=True)
def group_norm(x: Tensor, groups: int, eps: float = 1e-6) -> Tensor:
    """Group norm without affine terms: x (N, C, H, W) normalized over (C/groups, H, W) slices (ggml_group_norm).

    numpy order: ggml's ne = [W, H, C, N] is our (N, C, H, W); fewer dims are
    padded with leading 1s, so channels are axis -3 (a 2-D x has one channel).
    Like ggml, each group takes cpg = ceil(C / groups) consecutive channels,
    the last non-empty group what remains, and groups past C are empty: C=10,
    groups=4 gives channel slices [0:3], [3:6], [6:9], [9:10]. Per sample n and
    group, out = (x - mean) / sqrt(var + eps) with the biased variance over
    the group's channels and all of H and W.
    """
    return _norm_node("group_norm", x, eps, groups)
