"""StepInputs: the inputs of one step's graph (tokens, positions, cache rows, mask) and the arrays that fill them."""

from __future__ import annotations

import functools
from typing import Sequence

import attrs
import numpy as np

from ...tensor import Tensor


@attrs.frozen
class StepInputs:
    """The inputs of one step's graph: `batch` sequences of n tokens each, sequence b in cache region
    first_seq + b (rows (first_seq + b) * max_ctx ..); `feeds` / `feeds_batch` fill them."""

    tokens: Tensor | None  # i32 (B * n,): sequence b's tokens at b * n ..; None: greedy steps read next_tokens
    pos: Tensor  # i32 (B * n,)
    kv_idx: Tensor  # i64 (B * n,): cache rows written, (first_seq + b) * max_ctx + position
    mask: Tensor  # f16 (B, 1, n, window): per sequence, 0 up to each token's position, -inf beyond
    first_seq: int = 0
    max_ctx: int = 0  # cache rows per sequence

    @property
    def batch(self) -> int:
        return self.mask.shape[0]

    def feeds(self, token_ids: Sequence[int], n_past: int) -> dict[Tensor, np.ndarray]:
        """One sequence (batch 1): token_ids at positions n_past.."""
        return self.feeds_batch([token_ids], [n_past])

    def feeds_batch(self, token_ids: Sequence[Sequence[int]] | None,
                    n_past: Sequence[int]) -> dict[Tensor, np.ndarray]:
        """Sequence b's tokens token_ids[b] (each of the step's n) at positions n_past[b]..
        (token_ids None for a greedy step, whose tokens are on the device).

        Fresh arrays every call (a caller may keep them); the mask rows are cut from a precomputed
        staircase (`_mask_rows`), so a decode step's inputs cost a few small numpy calls.
        """
        b_, n, window = self._dims
        if (token_ids is None) != (self.tokens is None):
            raise ValueError("llama step: token ids are given for a greedy step (or missing for another)")
        if len(n_past) != b_ or (token_ids is not None and (len(token_ids) != b_
                                                            or any(len(t) != n for t in token_ids))):
            got = "no" if token_ids is None else [len(t) for t in token_ids]
            raise ValueError(f"llama step built for {b_} sequence(s) of {n} tokens, got "
                             f"{got} tokens at {len(n_past)} position(s)")
        # Python ints: a decode step has B positions, and numpy's per-call cost dominates at that size
        positions = [int(p) for p in n_past] if n == 1 else [int(p) + i for p in n_past for i in range(n)]
        lo, hi = min(positions), max(positions)
        if lo < 0 or hi >= window:
            raise ValueError(f"llama step: positions {lo}..{hi} outside its window of {window}")
        pos = np.array(positions, np.int32)
        # mask row of a token at position p: staircase row window - 1 - p (0 up to p, -inf beyond)
        if len(positions) == 1:
            mask = self._mask_rows[window - 1 - lo].reshape(1, 1, 1, window).copy()
        else:
            mask = self._mask_rows[(window - 1) - pos].reshape(b_, 1, n, window)
        feeds = {
            self.pos: pos,
            self.kv_idx: np.array([r + p for r, p in zip(self._row_base, positions)], np.int64),
            self.mask: mask,
        }
        if self.tokens is not None:
            feeds[self.tokens] = np.array(token_ids, np.int32).reshape(-1)
        return feeds

    @property
    def _dims(self) -> tuple[int, int, int]:
        return self.mask.shape[0], self.mask.shape[2], self.mask.shape[-1]

    @functools.cached_property
    def _row_base(self) -> list[int]:
        """Cache row of position 0 of each of the step's B * n rows: (first_seq + b) * max_ctx."""
        b_, n, _ = self._dims
        return [(self.first_seq + b) * self.max_ctx for b in range(b_) for _ in range(n)]

    @functools.cached_property
    def _mask_rows(self) -> np.ndarray:
        """(window, window) f16: row r is 0 for columns <= window - 1 - r, -inf beyond (read-only)."""
        window = self.mask.shape[-1]
        stair = np.full(2 * window - 1, -np.inf, np.float16)
        stair[:window] = 0
        rows = np.lib.stride_tricks.sliding_window_view(stair, window)  # row r = stair[r:r + window]
        return rows
