"""Generator: runs a LlamaModel on one device, step plans compiled once, prefill then decode; `generate`.

Greedy decoding picks each token on the device and queues the steps without
waiting (Generator.decode_greedy); other samplers pick on the host from each
step's logits.
"""

from __future__ import annotations

import math
import time
from typing import Any, Mapping, Sequence, TextIO

import attrs
import numpy as np

from ..compiler import compile
from ..hookspecs import Device
from ..manager import manager
from ..group import GroupPlan
from ..plan import Plan
from ..tensor import Tensor
from .llama.config import window_for
from .llama.inputs import StepInputs
from .llama.model import LlamaModel
from .llama.split import tensor_split
from .sampling import Sampler


class Progress:
    """Tokens generated so far: a bar redrawn with \\r on a terminal, else one summary line at the end."""

    def __init__(self, stream: TextIO | None, total: int, every_s: float = 0.1) -> None:
        self.stream, self.total, self.every_s = stream, total, every_s
        self.tty = stream is not None and hasattr(stream, "isatty") and stream.isatty()
        self.t0 = time.perf_counter()
        self.shown = -math.inf

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if self.tty and (now - self.shown >= self.every_s or done == self.total):
            self.shown = now
            width = 30
            bar = "#" * (width * done // self.total) + "-" * (width - width * done // self.total)
            self.stream.write(f"\r{bar} {done}/{self.total} tokens, {self._rate(done, now):.1f} tokens/s")
            self.stream.flush()

    def close(self, done: int) -> None:
        if self.stream is None:
            return
        now = time.perf_counter()
        if self.tty:
            self.update(done)
            self.stream.write("\n")
        else:
            self.stream.write(f"generated {done}/{self.total} tokens in {now - self.t0:.3f} s, "
                              f"{self._rate(done, now):.1f} tokens/s (wall clock, with prefill and sampling)\n")
        self.stream.flush()

    def _rate(self, done: int, now: float) -> float:
        return done / (now - self.t0) if now > self.t0 else math.nan


@attrs.frozen(kw_only=True)
class _Timing:
    """Where a generation's time went (first runs, which bind, are left out; so is sampling)."""

    compile_s: float
    prefill_s: float
    decode_s: float
    decode_steps: int
    prefill_plan: Plan | GroupPlan
    decode_plan: Plan | GroupPlan | None
    sampling: str


@attrs.frozen(kw_only=True)
class Generation(_Timing):
    """What Generator.generate made: the prompt, its new tokens, and the timing."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]

    @property
    def prefill_tps(self) -> float:
        return len(self.prompt) / self.prefill_s if self.prefill_s > 0 else math.nan

    @property
    def decode_tps(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else math.nan


@attrs.frozen(kw_only=True)
class BatchGeneration(_Timing):
    """What Generator.generate_batch made: per sequence its prompt and new tokens, and the shared timing."""

    prompts: tuple[tuple[int, ...], ...]
    tokens: tuple[tuple[int, ...], ...]

    @property
    def prefill_tps(self) -> float:
        """Prompt tokens per second (padding not counted)."""
        return sum(map(len, self.prompts)) / self.prefill_s if self.prefill_s > 0 else math.nan

    @property
    def decode_tps(self) -> float:
        """Tokens per second over all sequences: a step makes one per sequence."""
        return len(self.tokens) * self.decode_steps / self.decode_s if self.decode_s > 0 else math.nan


class Generator:
    """Runs a LlamaModel on one device, or split over `devices`: by layers (compile's layer split, `split`:
    its proportions, or "layer"), or split="tensor" (each device holds its shards of every layer:
    llama.split.tensor_split; each step is a GroupPlan of one plan per device): one compiled plan per step
    shape, and each sequence's cache position.

    `batch` sequences (at most the model's max_seqs) can step together:
    sequence b lives in cache region b. `forward` and `generate` run
    sequence 0 alone (one-sequence plans); `forward_batch` and
    `generate_batch` run all `batch` of them in one graph per step.
    Each plan is compiled once (per token count, attention window and
    batch). The first run of a plan binds it (buffers, weight upload,
    kernels) and is repeated untimed: a step rerun with the same inputs
    rewrites the same cache rows with the same values.
    """

    def __init__(self, model: LlamaModel, device: str | Device | None = None, *, fusion: bool | None = None,
                 batch: int = 1, devices: Sequence[str | Device] | None = None,
                 split: Sequence[float] | str | None = None) -> None:
        if not 1 <= batch <= model.max_seqs:
            raise ValueError(f"llama: batch {batch} must be in 1..max_seqs of the model ({model.max_seqs}): "
                             "LlamaModel(..., max_seqs=N) sizes the KV cache")
        self.model = model
        if devices is not None and device is not None:
            raise ValueError(f"llama: give device ({device}) or devices, not both")
        #: the devices the model is split over by layers (one: no split); `device` is the first
        self.devices = tuple(manager().device(d) for d in devices) if devices else (manager().device(device),)
        self.device = self.devices[0]
        self.split = split
        #: the ranks' models of a tensor split (None: the model runs whole)
        self.ranks = tensor_split(model, self.devices) if split == "tensor" and len(self.devices) > 1 else None
        self.fusion = fusion
        self.batch = batch
        #: cache positions filled, per sequence
        self.lengths = [0] * batch
        self.compile_s = 0.0
        self.last_run_s = 0.0
        self._steps: dict[tuple[int, int, int, str], tuple[Plan | GroupPlan, StepInputs]] = {}
        self._bound: set[Plan | GroupPlan] = set()
        self._last: Plan | GroupPlan | None = None

    @property
    def n_past(self) -> int:
        """Sequence 0's position (the one `forward` and `generate` use)."""
        return self.lengths[0]

    @n_past.setter
    def n_past(self, value: int) -> None:
        self.lengths[0] = value

    def reset(self) -> None:
        """Start new sequences (the cache rows past a position are masked, not cleared)."""
        self.lengths = [0] * self.batch

    def step(self, n_tokens: int, n_past: int, *, batch: int = 1, logits: str = "all",
             greedy: bool = False) -> tuple[Plan | GroupPlan, StepInputs]:
        """The compiled plan for `batch` sequences (0..) of n_tokens tokens, the furthest at n_past
        (compiled on first use); greedy: LlamaModel.build's greedy decode step."""
        key = (n_tokens, window_for(self.model.cfg, n_past + n_tokens), batch, "all" if n_tokens == 1 else logits,
               greedy)
        if key not in self._steps:
            t0 = time.perf_counter()
            shape = dict(batch=batch, logits=key[3], greedy=greedy)
            outputs, inp = (self.ranks or [self.model])[0].build(n_tokens, n_past, **shape)
            if self.ranks is not None:  # one graph per rank, reading the same inputs
                outputs = [outputs, *(r.build(n_tokens, n_past, **shape, inputs=inp)[0] for r in self.ranks[1:])]
            where = dict(device=self.device) if len(self.devices) == 1 else dict(devices=self.devices, split=self.split)
            self._steps[key] = (compile(outputs, **where, fusion=self.fusion), inp)
            self.compile_s += time.perf_counter() - t0
        return self._steps[key]

    def decode_greedy(self, first: Sequence[int], n_steps: int, progress: Progress | None = None) -> list[list[int]]:
        """n_steps greedy decode steps of sequences 0..len(first) - 1 from their current positions,
        sequence b starting from token first[b]: each step's tokens are the previous step's argmax,
        picked on the device (LlamaModel.build(greedy=True)), and the steps are queued without waiting
        (Plan.submit), so the host prepares step i + 1 while the device runs step i. Returns each
        sequence's n_steps new tokens, read once at the end; advances each sequence by n_steps.
        """
        model, batch = self.model, len(first)
        vocab = model.cfg.vocab
        if not 1 <= batch <= self.batch or any(not 0 <= t < vocab for t in first):
            raise ValueError(f"decode_greedy: needs 1..{self.batch} first tokens in [0, {vocab}), got {list(first)}")
        start = self.lengths[:batch]
        if max(start) + n_steps > model.cfg.max_ctx:
            raise ValueError(f"decode_greedy: {n_steps} steps after position {max(start)} do not fit max_ctx "
                             f"{model.cfg.max_ctx}")
        plan: Plan | GroupPlan | None = None
        t0 = time.perf_counter()
        compile_before = self.compile_s
        # Compiling a step's plan (a new attention window) and binding it (buffers, kernels loaded, graph
        # captured: done by its first write) are not decoding: left out of last_run_s.
        bind_s = 0.0
        for i in range(n_steps):
            nxt, inp = self.step(1, max(self.lengths[:batch]), batch=batch, greedy=True)
            if nxt is not plan:
                tokens = first if plan is None else self._read_next(plan, batch)
                plan = nxt
                b0 = time.perf_counter()
                bound = plan in self._bound
                self._write_next(plan, tokens)
                if not bound:  # binding runs the step: the same token at the same position, then the token again
                    self._bind(plan, inp.feeds_batch(None, self.lengths[:batch]))
                    self._write_next(plan, tokens)
                    bind_s += time.perf_counter() - b0
            plan.submit(inp.feeds_batch(None, self.lengths[:batch]))
            for b in range(batch):
                self.lengths[b] += 1
            if progress is not None:
                progress.update((i + 1) * batch)
        self._last = plan
        if plan is None:
            return [[] for _ in first]
        log = plan.read(model.token_log).reshape(-1)
        self.last_run_s = time.perf_counter() - t0 - bind_s - (self.compile_s - compile_before)
        rows = [b * model.cfg.max_ctx + start[b] for b in range(batch)]
        return [[int(log[r + i]) for i in range(n_steps)] for r in rows]

    def _bind(self, plan: Plan | GroupPlan, feeds: Mapping[Tensor, Any]) -> None:
        """Run a step's plan twice on `feeds`, outside any timing: the first run binds it (kernels
        loaded, launches direct), the second captures its CUDA graph (graphs.GraphRunner); both
        write the same cache rows the timed run then writes again."""
        for _ in range(2):
            plan.run(feeds)
        self._bound.add(plan)

    def _write_next(self, plan: Plan | GroupPlan, tokens: Sequence[int]) -> None:
        """Sequences 0..len(tokens) - 1's next tokens into the model's next_tokens state."""
        values = np.zeros(self.model.max_seqs, np.int32)
        values[:len(tokens)] = tokens
        plan.write(self.model.next_tokens, values)

    def _read_next(self, plan: Plan | GroupPlan, batch: int) -> list[int]:
        return [int(t) for t in plan.read(self.model.next_tokens)[:batch]]

    def forward(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits f32 (len(token_ids), vocab) for tokens of sequence 0 at its next positions; advances it."""
        return self._run([token_ids], batch=1)

    def forward_batch(self, token_ids: Sequence[Sequence[int]], *, last: bool = False) -> np.ndarray:
        """Every sequence's next tokens in one step: logits f32 (batch, n, vocab), n the longest of
        token_ids; with `last`, (batch, vocab): each sequence's last token only (the LM head runs on
        those alone when all have the same length). Advances each sequence by its own tokens.

        Sequences may get different numbers of tokens: shorter ones are padded, the padding written to
        cache rows past the sequence's end, which are masked until its next tokens overwrite them; their
        logits rows past its length are padding.
        """
        if len(token_ids) != self.batch:
            raise ValueError(f"llama: forward_batch needs tokens for each of the {self.batch} sequences, "
                             f"got {len(token_ids)}")
        return self._forward_seqs(token_ids, last=last)

    def _forward_seqs(self, token_ids: Sequence[Sequence[int]], *, last: bool) -> np.ndarray:
        """forward_batch for sequences 0..len(token_ids) - 1."""
        batch, lens = len(token_ids), [len(t) for t in token_ids]
        if min(lens) < 1:
            raise ValueError("llama: forward_batch needs at least one token per sequence")
        n = max(lens)
        padded = [list(t) + [0] * (n - len(t)) for t in token_ids]
        same = min(lens) == n
        out = self._run(padded, batch=batch, logits="last" if last and same else "all", advance=lens)
        if not last:
            return out.reshape(batch, n, -1)
        if same:
            return out
        return out.reshape(batch, n, -1)[np.arange(batch), np.array(lens) - 1]

    def _run(self, token_ids: Sequence[Sequence[int]], *, batch: int, logits: str = "all",
             advance: Sequence[int] | None = None, copy: bool = True) -> np.ndarray:
        """One step of sequences 0..batch-1 (token_ids[b] each, all of one length); advances sequence b
        by advance[b] (default: its token count). copy=False: the logits are a view that the next run of
        the same plan overwrites (see Plan.run)."""
        vocab = self.model.cfg.vocab
        bad = [t for ids in token_ids for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"llama: token ids {bad[:5]} outside the vocabulary of {vocab}")
        n = len(token_ids[0])
        n_past = self.lengths[:batch]
        plan, inp = self.step(n, max(n_past), batch=batch, logits=logits)
        feeds = inp.feeds_batch(token_ids, n_past)
        self._last = plan
        if plan not in self._bound:
            self._bind(plan, feeds)
        t0 = time.perf_counter()
        (out,) = plan.run(feeds, copy=copy)
        self.last_run_s = time.perf_counter() - t0
        for b in range(batch):
            self.lengths[b] += n if advance is None else advance[b]
        return out

    def generate(self, prompt_ids: Sequence[int], n_new: int, sampler: Sampler | None = None, *,
                 progress: TextIO | None = None) -> Generation:
        """Continue `prompt_ids` (as sequence 0) by n_new tokens: prefill, then one decode step per token.

        `sampler` (default greedy) picks each token from the last logits on
        the host, starting from its seed, so a seed repeats the tokens.
        `progress`: a stream for a progress bar (a terminal) or a summary line.
        """
        if not prompt_ids or n_new < 1:
            raise ValueError("generate: needs a non-empty prompt and n_new >= 1")
        (tokens,), timing = self._generate([prompt_ids], n_new, sampler, progress)
        return Generation(prompt=tuple(int(t) for t in prompt_ids), tokens=tokens, **timing)

    def generate_batch(self, prompts: Sequence[Sequence[int]], n_new: int, sampler: Sampler | None = None, *,
                       progress: TextIO | None = None) -> BatchGeneration:
        """Continue each of `batch` prompts by n_new tokens: one prefill step for all (padded to the longest
        prompt, see forward_batch), then decode steps that make one token per sequence each.

        Each sequence samples with its own copy of `sampler` (at its seed), so sequence b gets the
        tokens `generate(prompts[b], n_new, sampler)` would.
        """
        if len(prompts) != self.batch or not all(prompts) or n_new < 1:
            raise ValueError(f"generate_batch: needs {self.batch} non-empty prompts and n_new >= 1")
        tokens, timing = self._generate(prompts, n_new, sampler, progress)
        return BatchGeneration(prompts=tuple(tuple(int(t) for t in p) for p in prompts), tokens=tokens, **timing)

    def _generate(self, prompts: Sequence[Sequence[int]], n_new: int, sampler: Sampler | None,
                  progress: TextIO | None) -> tuple[tuple[tuple[int, ...], ...], dict[str, Any]]:
        """generate_batch for sequences 0..len(prompts) - 1: their new tokens, and _Timing's fields."""
        batch = len(prompts)
        sampler = sampler if sampler is not None else Sampler()
        samplers = [attrs.evolve(sampler) for _ in prompts]  # each starts at the seed
        self.reset()
        compile_before = self.compile_s
        lens = [len(p) for p in prompts]
        # The prompts' last logits only (the LM head on their last rows) when they are of one length.
        prefill_plan = self.step(max(lens), 0, batch=batch, logits="last" if min(lens) == max(lens) else "all")[0]
        if n_new > 1:
            self.step(1, max(lens), batch=batch, greedy=sampler.greedy)
        bar = Progress(progress, n_new * batch)
        last = self._forward_seqs(prompts, last=True)  # (batch, vocab)
        prefill_s = self.last_run_s
        tokens = [[s(row)] for s, row in zip(samplers, last)]
        bar.update(batch)
        decode_s = 0.0
        if sampler.greedy:
            if n_new > 1:
                for t, more in zip(tokens, self.decode_greedy([t[0] for t in tokens], n_new - 1, bar)):
                    t.extend(more)
                decode_s = self.last_run_s
        else:
            for _ in range(n_new - 1):
                # A view, sampled before its plan runs again.
                logits = self._run([t[-1:] for t in tokens], batch=batch, copy=False)  # (batch, vocab)
                decode_s += self.last_run_s
                for t, s, row in zip(tokens, samplers, logits):
                    t.append(s(row))
                bar.update(len(tokens[0]) * batch)
        bar.close(len(tokens[0]) * batch)
        timing = dict(compile_s=self.compile_s - compile_before, prefill_s=prefill_s, decode_s=decode_s,
                      decode_steps=n_new - 1, prefill_plan=prefill_plan,
                      decode_plan=self._last if n_new > 1 else None, sampling=sampler.describe())
        return tuple(tuple(int(x) for x in t) for t in tokens), timing


def generate(model: LlamaModel, prompt_ids: Sequence[int], n_new: int, device: str | Device | None = None,
             *, fusion: bool | None = None, sampler: Sampler | None = None,
             progress: TextIO | None = None) -> Generation:
    """Generation on `device` (default: the best available); greedy unless a sampler is given."""
    return Generator(model, device, fusion=fusion).generate(prompt_ids, n_new, sampler, progress=progress)
