"""Random valid blocks of any format: inputs for tests and the conformance sweep.

A format without an encoder (the grid I-quants) can only be fed as raw blocks,
and random bytes alone make poor ones: a random f16 scale spans 2**30 (or is
inf/NaN), so a few blocks would hold all of a tensor's weight. `random_blocks`
draws every code and sub-scale byte at random and writes the block scales
(ggml-common.h's d, dmin, m) as finite values of one octave with a random sign.
"""

from __future__ import annotations

import numpy as np

from . import FORMATS
from .common import F16, QK_K

#: byte offsets of each format's f16 block scales (d, then dmin or m), as ggml-common.h lays them out
HALVES: dict[str, tuple[int, ...]] = {
    "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,),
    "q2_K": (80, 82), "q3_K": (108,), "q4_K": (0, 2), "q5_K": (0, 2), "q6_K": (208,),
    "iq4_nl": (0,), "iq4_xs": (0,), "iq2_xxs": (0,), "iq2_xs": (0,), "iq3_xxs": (0,), "iq1_s": (0,),
    "iq3_s": (0,), "iq2_s": (0,),
}
#: iq1_m keeps d as the top nibbles of its four u16 scale words, at this offset
IQ1M_SCALES = 48
#: mxfp4's e8m0 exponent byte (offset 0) is drawn from E8M0_LO .. E8M0_LO + 2: half scales 2**-4 .. 2**-2
E8M0_LO = 124


def random_blocks(rng: np.random.Generator, name: str, nblocks: int, scale: float = 2.0**-4) -> np.ndarray:
    """(nblocks, block bytes) uint8: random codes and sub-scales, block scales in +-[scale/2, scale).

    With the default scale every format's values stay well inside f16's normal
    range (q6_K's largest, d * 127 * 32, is 254), where GPU paths convert them.
    """
    fmt = FORMATS[name]
    raw = rng.integers(0, 256, (nblocks, fmt.block_bytes), dtype=np.uint8)

    def draw() -> np.ndarray:
        return (rng.choice((-1.0, 1.0), nblocks) * rng.uniform(scale / 2, scale, nblocks)).astype(np.float32)

    if name in HALVES:
        for at in HALVES[name]:
            raw[:, at:at + 2] = draw().astype(F16)[:, None].view(np.uint8)
    elif name == "q8_K":  # d is an f32; bsums[16] the int16 sums of each 16 codes (unused by the decoder)
        raw[:, :4] = draw()[:, None].view(np.uint8)
        codes = raw[:, 4:4 + QK_K].view(np.int8).astype(np.int16)
        raw[:, 4 + QK_K:] = codes.reshape(nblocks, 16, 16).sum(-1).astype("<i2").view(np.uint8)
    elif name == "iq1_m":  # nibble k of d's f16 bits tops scale word k
        bits = draw().astype(F16).view(np.uint16)
        words = raw[:, IQ1M_SCALES:IQ1M_SCALES + 8].copy().view("<u2")
        nibbles = (bits[:, None] >> (4 * np.arange(4, dtype=np.uint16))) & 0xF
        raw[:, IQ1M_SCALES:IQ1M_SCALES + 8] = ((words & 0x0FFF) | (nibbles << 12)).astype("<u2").view(np.uint8)
    elif name == "mxfp4":
        raw[:, 0] = rng.integers(E8M0_LO, E8M0_LO + 3, nblocks)
    else:
        raise ValueError(f"random_blocks: no scale layout for format {name!r}")
    return raw
