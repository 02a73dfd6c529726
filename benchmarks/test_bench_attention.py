"""cuda_attention beside torch: flash attention decode (us, GB/s) and prefill (TFLOP/s), softmax and rope (GB/s).

Decode: 1 query, 8192 keys, 32 query / 8 KV heads, D = 128, batch 1 and 16,
f16 and bf16 K/V, against F.scaled_dot_product_attention(enable_gqa=True)
(docs/design.md target: <= 20 us at batch 1; torch 47.5 us). Bytes: K, V, q, out.
Prefill: causal through the mask, D = 128, 4096 tokens, 32 heads, batch 4,
FLOPs = 4*B*H*Tq*Tk*D/2 (causal: half the products), against SDPA
is_causal=True (target: >= 50% of its TFLOP/s); test_prefill_gqa the same at
the shapes of a small model's prompt (32 query / 8 KV heads, one sequence:
the 1b preset's D = 64 at 512 and 4096 tokens, D = 128 at 2048, bf16 K/V
beside f32 queries). Softmax and rope: bytes
read + written, against the copy bandwidth (target >= 85%); rope is timed cold
(conftest.measure_cold: 32 or more instances over several buffers in one CUDA graph),
since at 4096 tokens its 67 MB are near the L2's size.
"""

from __future__ import annotations

import numpy as np
import pytest

import opdispatch as od
from bench import cold, ready
from opdispatch import ops

pytestmark = pytest.mark.gpu




def rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.uniform(-1, 1, shape).astype(np.float32)


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("kv", ["f16", "bf16"])
def test_decode(measure, torch_cuda, batch: int, kv: str) -> None:  # noqa: ANN001
    torch = torch_cuda
    rng = np.random.default_rng(0)
    hq, hkv, tk, d = 32, 8, 8192, 128
    q_dtype = "f16" if kv == "f16" else "f32"  # the op takes f32 or f16 queries
    q = od.input("q", (batch, hq, 1, d), q_dtype)
    k = od.input("k", (batch, hkv, tk, d), kv)
    v = od.input("v", (batch, hkv, tk, d), kv)
    fq, fk, fv = rand(rng, *q.shape), rand(rng, *k.shape), rand(rng, *v.shape)
    scale = 1 / np.sqrt(d)
    plan = ready(ops.flash_attn_ext(q, k, v, None, scale), {q: fq, k: fk, v: fv}, "cuda_attention")
    tdt = torch.float16 if kv == "f16" else torch.bfloat16
    tq, tk_, tv = (torch.from_numpy(a).cuda().to(tdt) for a in (fq, fk, fv))
    F = torch.nn.functional
    nbytes = k.nbytes + v.nbytes + q.nbytes + batch * hq * d * 4
    info = measure(plan, nbytes, lambda: F.scaled_dot_product_attention(tq, tk_, tv, scale=scale, enable_gqa=True))
    print(f"decode batch {batch} {kv}: {info['us']:.1f} us (torch {info['torch_us']:.1f} us), "
          f"{info['GB/s']:.0f} GB/s")


def test_prefill_causal(measure, torch_cuda) -> None:  # noqa: ANN001
    torch = torch_cuda
    rng = np.random.default_rng(0)
    b, h, t, d = 4, 32, 4096, 128
    q = od.input("q", (b, h, t, d), "f16")
    k = od.input("k", (b, h, t, d), "f16")
    v = od.input("v", (b, h, t, d), "f16")
    m = od.input("m", (1, 1, t, t), "f16")
    causal = np.where(np.arange(t)[None, :] > np.arange(t)[:, None], -np.inf, 0.0).astype(np.float32)
    fq, fk, fv = (rand(rng, b, h, t, d) for _ in range(3))
    scale = 1 / np.sqrt(d)
    plan = ready(ops.flash_attn_ext(q, k, v, m, scale), {q: fq, k: fk, v: fv, m: causal[None, None]}, "cuda_attention")
    tq, tk_, tv = (torch.from_numpy(a).cuda().half() for a in (fq, fk, fv))
    F = torch.nn.functional
    flops = 4 * b * h * t * t * d // 2
    nbytes = q.nbytes + k.nbytes + v.nbytes + m.nbytes + b * t * h * d * 4
    info = measure(plan, nbytes, lambda: F.scaled_dot_product_attention(tq, tk_, tv, is_causal=True, scale=scale),
                   flops=flops)
    print(f"prefill causal: {info['TFLOP/s']:.0f} TFLOP/s, {info['us']:.0f} us "
          f"(torch {flops / info['torch_us'] / 1e6:.0f} TFLOP/s)")


@pytest.mark.parametrize(("t", "d", "kv"), [(512, 64, "f16"), (4096, 64, "f16"), (2048, 128, "bf16")])
def test_prefill_gqa(measure, torch_cuda, t: int, d: int, kv: str) -> None:  # noqa: ANN001
    torch = torch_cuda
    rng = np.random.default_rng(0)
    hq, hkv = 32, 8
    q_dtype = "f16" if kv == "f16" else "f32"  # the op takes f32 or f16 queries
    q = od.input("q", (1, hq, t, d), q_dtype)
    k = od.input("k", (1, hkv, t, d), kv)
    v = od.input("v", (1, hkv, t, d), kv)
    m = od.input("m", (1, 1, t, t), "f16")
    causal = np.where(np.arange(t)[None, :] > np.arange(t)[:, None], -np.inf, 0.0).astype(np.float32)
    fq, fk, fv = rand(rng, *q.shape), rand(rng, *k.shape), rand(rng, *v.shape)
    scale = 1 / np.sqrt(d)
    plan = ready(ops.flash_attn_ext(q, k, v, m, scale), {q: fq, k: fk, v: fv, m: causal[None, None]}, "cuda_attention")
    tdt = torch.float16 if kv == "f16" else torch.bfloat16
    tq, tk_, tv = (torch.from_numpy(a).cuda().to(tdt) for a in (fq, fk, fv))
    F = torch.nn.functional
    flops = 4 * hq * t * t * d // 2
    nbytes = q.nbytes + k.nbytes + v.nbytes + m.nbytes + t * hq * d * 4
    info = measure(plan, nbytes, lambda: F.scaled_dot_product_attention(tq, tk_, tv, is_causal=True, scale=scale,
                                                                        enable_gqa=True), flops=flops)
    print(f"prefill gqa t={t} d={d} {kv}: {info['TFLOP/s']:.0f} TFLOP/s, {info['us']:.1f} us "
          f"(torch {info['torch_us']:.1f} us)")


def test_soft_max(measure, torch_cuda) -> None:  # noqa: ANN001
    torch = torch_cuda
    rng = np.random.default_rng(0)
    shape = (1, 32, 512, 4096)
    a = od.input("a", shape)
    m = od.input("m", (1, 1, 512, 4096), "f16")
    fa_, fm = rand(rng, *shape), rand(rng, 1, 1, 512, 4096)
    plan = ready(ops.soft_max(a, m, 0.088), {a: fa_, m: fm}, "cuda_attention")
    ta = torch.from_numpy(fa_).cuda()
    out = torch.empty_like(ta)
    measure(plan, 2 * a.nbytes + m.nbytes, lambda: torch.softmax(ta, -1, out=out))


@pytest.mark.parametrize("tokens", [4096, 16384])  # f16: 67 MB and 268 MB moved
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_rope(measure_cold, torch_cuda, dt: str, tokens: int) -> None:  # noqa: ANN001
    torch = torch_cuda
    rng = np.random.default_rng(0)
    shape = (1, tokens, 32, 128)
    pos = od.input("pos", (tokens,), "i32")
    nbytes = 2 * od.input("x", shape, dt).nbytes + pos.nbytes
    lay = cold(nbytes)
    xs = [od.input(f"x{i}", shape, dt) for i in range(lay.sets)]
    fx = rand(rng, *shape)
    plan = ready([ops.rope(xs[lay.of(i)], pos, 128, "neox") for i in range(lay.instances)],
                 {**{x: fx for x in xs}, pos: np.arange(tokens, dtype=np.int32)}, "cuda_attention")
    tdt = torch.float32 if dt == "f32" else torch.float16
    txs = [torch.from_numpy(fx).cuda().to(tdt) for _ in range(lay.sets)]
    ang = torch.arange(tokens, device="cuda")[:, None] * 10000.0 ** (-torch.arange(64, device="cuda") / 64)
    cos = torch.cat([ang.cos(), ang.cos()], -1)[None, :, None, :].to(tdt)
    sin = torch.cat([ang.sin(), ang.sin()], -1)[None, :, None, :].to(tdt)

    def torch_rope(i: int):  # noqa: ANN202 - the usual rotate-half formulation
        tx = txs[lay.of(i)]
        x1, x2 = tx[..., :64], tx[..., 64:]
        return tx * cos + torch.cat([-x2, x1], -1) * sin

    measure_cold(plan, lay, nbytes, torch_rope)
