"""Fuzzing: random graphs, params and feeds, valid and deliberately bad, each run in a worker process.

A case is drawn from a seed (`draw`): a valid base (a default conformance case, or a graph whose
indices a `top_k` computes) and a family that leaves it valid or breaks one thing: a param's type
or range, a source's shape, rank or dtype, a huge tensor, a feed, index data. Each case knows
whether it is bad. A valid case must match the CPU reference within the conformance bounds; a bad
one must raise an `OpdispatchError` naming the op, or the tensor or input concerned. The runner
(`Runner`, `run_fuzz`) sends cases to a long-lived worker process that it restarts after a crash
or a hang, so no case can take the caller down. `python -m opdispatch.testing.fuzz` runs it from
the command line; docs/conformance.md ("Fuzzing") has the outcomes and what each family does.
"""

from .case import FAILING, Built, FuzzCase, Outcome
from .draw import FAMILIES, case_seeds, draw
from .runner import Report, Result, Runner, run_fuzz

__all__ = ["FAILING", "FAMILIES", "Built", "FuzzCase", "Outcome", "Report", "Result", "Runner", "case_seeds",
           "draw", "run_fuzz"]
