"""Sampler: picks the next token from a row of logits on the host (greedy, top-k, top-p), seeded."""

from __future__ import annotations

import attrs
import numpy as np

SAMPLING = ("greedy", "top-k", "top-p")


@attrs.define
class Sampler:
    """Picks each next token from a row of logits, on the host, with a seeded numpy RNG.

    greedy: the argmax (the first of equal maxima here; Generator.generate
    picks greedy decode tokens on the device instead, where ggml's argmax
    takes the last of equal maxima). top-k: the top_k largest
    logits, drawn by softmax(logits / temperature) over them (top_k = 1 is
    greedy). top-p (nucleus): softmax(logits / temperature), then the most
    probable tokens until their probability reaches top_p (at least one
    token), renormalized. Only the parameters of `method` are checked and
    used. `reset` restarts the RNG from `seed`; Generator.generate
    does at the start of every sequence, so a seed repeats a generation.
    """

    method: str = attrs.field(default="greedy", validator=attrs.validators.in_(SAMPLING))
    top_k: int = 40
    top_p: float = 0.9
    temperature: float = 1.0
    seed: int = 0
    _rng: np.random.Generator = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        bad = [why for uses, ok, why in (
            ("top-k", self.top_k >= 1, f"top_k must be >= 1, got {self.top_k}"),
            ("top-p", 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            ("top-k top-p", self.temperature > 0,
             f"temperature must be > 0 (greedy is its own method), got {self.temperature}"),
        ) if self.method in uses.split() and not ok]
        if bad:
            raise ValueError("sampler: " + "; ".join(bad))
        self.reset()

    def reset(self) -> None:
        self._rng = np.random.default_rng(self.seed)

    @property
    def greedy(self) -> bool:
        """Picks the argmax (Generator.generate then picks on the device)."""
        return self.method == "greedy" or (self.method == "top-k" and self.top_k == 1)

    def describe(self) -> str:
        if self.method == "greedy":
            return "greedy"
        cut = f"k {self.top_k}" if self.method == "top-k" else f"p {self.top_p:g}"
        return f"{self.method} ({cut}, temperature {self.temperature:g}, seed {self.seed})"

    def candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, their probabilities summing to 1) that the next draw picks from, most probable first.

        Whole-vocabulary work stays in the logits' own float type (f32 from a
        model: a few hundred microseconds for 32000 tokens) and sorts only a
        top-m that holds the candidates; their probabilities are float64.
        """
        z = np.asarray(logits).reshape(-1)
        if z.dtype not in (np.float32, np.float64):
            z = z.astype(np.float64)
        if self.greedy:
            return np.array([int(np.argmax(z))]), np.ones(1)
        if self.method == "top-k":
            ids = _largest(z, self.top_k)
        else:
            w = np.exp((z - z.max()) / z.dtype.type(self.temperature))
            total = w.sum(dtype=np.float64)
            m = 64
            while True:  # the nucleus is a prefix of the sorted order: find a top-m that holds it
                ids = _largest(z, m)
                if m >= z.size or w[ids].sum(dtype=np.float64) >= self.top_p * total:
                    break
                m *= 8
        x = z[ids].astype(np.float64) / self.temperature
        q = np.exp(x - x[0])  # ids[0] holds the largest logit
        if self.method == "top-p":
            q /= total
            before = np.cumsum(q) - q  # probability of the tokens ranked above each
            ids, q = ids[before < self.top_p], q[before < self.top_p]
        return ids, q / q.sum()

    def __call__(self, logits: np.ndarray) -> int:
        ids, p = self.candidates(logits)
        if ids.size == 1:
            return int(ids[0])
        c = np.cumsum(p)
        return int(ids[min(int(np.searchsorted(c, self._rng.random() * c[-1], side="right")), ids.size - 1)])


def _largest(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, largest first (ties: lower index first; at the k-th value, any)."""
    idx = np.argpartition(x, x.size - k)[x.size - k:] if k < x.size else np.arange(x.size)
    return idx[np.lexsort((idx, -x[idx]))]
