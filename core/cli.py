"""The `opdispatch` command: info, ops, test-ops, run, quantize.

Errors a user can fix (an unknown device, a prompt longer than the context)
print one line on stderr and exit with status 2, like argparse's own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import attrs
import numpy as np

from . import __version__
from .backends.cuda.devices import peer_links
from .hookspecs import Device
from .manager import PluginManager, manager
from .models.generate import Generator
from .models.llama.config import CACHE_DTYPES, CONVERTIBLE_DTYPES, PRESETS, WEIGHT_DTYPES, WINDOW_STEP, LlamaConfig
from .models.llama.model import LlamaModel
from .models.llama.names import random_weights
from .models.mixture import PRESETS as MIXTURE_PRESETS
from .models.sampling import SAMPLING, Sampler
from .ops import OPS
from .plan import Plan
from .tensor import Tensor

if TYPE_CHECKING:
    from .testing.cases import Case

class UsageError(Exception):
    """A mistake in the command line: reported in one line, exit status 2."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or argparse's own usage error (already printed)
        return int(exc.code or 0)
    try:
        return int(args.handler(args) or 0)
    except UsageError as exc:
        print(f"opdispatch {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="opdispatch", description="Tensor compute graphs on GPUs through op plugins.")
    parser.add_argument("--version", action="version", version=f"opdispatch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("info", help="devices, and plugins in dispatch order")
    p.set_defaults(handler=cmd_info)

    p = sub.add_parser("ops", help="support matrix: op x dtype x device -> the plugin that runs it")
    p.add_argument("--device", help="one device (default: every device, and a description of each kind a plugin "
                                    "brings but found none of: cuda0 is an H200 description without a GPU)")
    p.add_argument("--markdown", nargs="?", const="docs/support-matrix.md", metavar="PATH",
                   help="write the matrix as a markdown table (default path: docs/support-matrix.md)")
    p.set_defaults(handler=cmd_ops)

    _add_test_ops(sub)

    p = sub.add_parser(
        "run", help="generate with a Llama-style decoder, report the plan and tokens/s",
        description="Generate from a random prompt with a Llama-style decoder (random weights of a preset shape, "
                    "or weights from a GGUF file or safetensors files), then print the plan summary and "
                    "prefill/decode tokens/s. The preset stays 'tiny' on every device unless another is given "
                    "(1b is meant for a GPU: on the numpy reference it takes minutes).")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--device", help="device name or kind (default: the best available, a GPU if there is one)")
    where.add_argument("--devices", metavar="D0,D1,...",
                       help="split the model over these devices (cuda0,cuda1; cpu0,cpu1 are the CPU twice, with memory "
                            "of its own each: a split that runs anywhere)")
    p.add_argument("--split", choices=("layer", "tensor"), default="layer",
                   help="how --devices share the model: layer = contiguous layers per device, balanced by the "
                        "devices' free memory; tensor = every layer's heads and ffn features shared out, "
                        "all-reduces between (NCCL on GPUs) (default: layer)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=tuple(PRESETS),
                     help="random weights of this shape (default: tiny; tiny-moe: 4 experts, 2 used; 8b: Llama-3-8B's, "
                          "drawn as 32 GB of f32 on the host first)")
    src.add_argument("--gguf", metavar="PATH", help="weights and config from a llama GGUF file")
    src.add_argument("--safetensors", metavar="DIR",
                     help="weights from the *.safetensors files in DIR (or one file), config from config.json there")
    p.add_argument("--dtype", choices=CONVERTIBLE_DTYPES,
                   help="dtype of random weights (default: the preset's: tiny f32, 1b and 8b bf16); loaded weights "
                        "keep their stored types")
    p.add_argument("--cache-dtype", choices=CACHE_DTYPES, help="KV cache dtype (default: f16)")
    p.add_argument("--tokens", type=int, default=32, help="tokens to generate (default: 32)")
    p.add_argument("--prompt-len", type=int, default=16, help="random prompt length (default: 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, the prompt and sampling (default: 0)")
    p.add_argument("--sample", choices=SAMPLING, default="greedy", help="how tokens are picked (default: greedy)")
    p.add_argument("--top-k", type=int, default=40, help="top-k: tokens kept (default: 40)")
    p.add_argument("--top-p", type=float, default=0.9, help="top-p: probability kept (default: 0.9)")
    p.add_argument("--temperature", type=float, default=1.0, help="top-k/top-p: logits are divided by it (default: 1)")
    p.add_argument("--batch", type=int, default=1, metavar="B",
                   help="generate B sequences at once (B random prompts): one decode graph makes a token for each "
                        "(default: 1)")
    p.add_argument("--no-fusion", action="store_true", help="compile without fusion rules")
    p.set_defaults(handler=cmd_run)

    p = sub.add_parser(
        "quantize", help="write a Llama GGUF in a block format or a llama-quantize file type (Q4_K_M, ...)",
        description="Read a GGUF file (any types it loads) or a directory of HF Llama safetensors (with its "
                    "config.json) and write a GGUF file whose tensors are quantized by opdispatch (byte-exact with "
                    "ggml). TYPE is a llama-quantize file type, its mixture of types per tensor included ("
                    "uppercase: " + ", ".join(MIXTURE_PRESETS) + "), or one opdispatch dtype for every tensor "
                    "llama-quantize would quantize (lowercase, as llama-quantize --pure: q4_0, q8_0, ...). Norms "
                    "stay f32; a row that is not whole blocks of its type falls back as llama-quantize's does "
                    "(docs/models.md). A progress bar goes to stderr.")
    p.add_argument("input", metavar="IN", help="a GGUF file, or a safetensors directory with config.json")
    p.add_argument("output", metavar="OUT", help="the GGUF file to write")
    p.add_argument("type", metavar="TYPE", help="a file type (Q4_K_M, Q8_0, ...) or a dtype (q4_0, q8_0, ...)")
    p.set_defaults(handler=cmd_quantize)
    return parser


def _add_test_ops(sub: Any) -> None:
    """The conformance harness brings its own arguments; `info` and `run` must work even if it does not import."""
    try:
        from .testing.cli import add_test_ops_parser
    except ImportError as exc:
        reason = f"{type(exc).__name__}: {exc}"
        p = sub.add_parser("test-ops", help=f"conformance sweep (unavailable: {reason})")
        p.set_defaults(handler=lambda args: _unavailable(reason))
        return
    add_test_ops_parser(sub)


def _unavailable(reason: str) -> int:
    raise UsageError(f"the conformance harness did not import ({reason})")


# -- info -----------------------------------------------------------------------------


def cmd_info(args: argparse.Namespace) -> int:
    mgr = manager()
    print(f"opdispatch {__version__}")
    print("devices:")
    for dev in mgr.devices():
        print(f"  {dev.name:8s} {dev.kind:6s} {dev.description}{_cuda_facts(dev)}")
    for absent in mgr.absent_devices():
        print(f"  (no {absent.stand_in.kind.upper()} device: {absent.why})")
    print("  cpu0, cpu1, ...: the CPU with memory of its own each, to split a model over (run --devices cpu0,cpu1)")
    _print_peer_links(mgr.devices())
    print("plugins, in dispatch order:")
    for i, p in enumerate(mgr.order(), 1):
        print(f"  {i}. {p.name:16s} {p.info.version or '-':8s} priority {p.priority:<4d} {p.origin}"
              + (f"  ({p.info.description})" if p.info.description else ""))
    for name, reason in mgr.skipped:
        print(f"  left out: {name}: {reason}")
    switches = {k: v for k, v in sorted(os.environ.items()) if k.startswith("OPDISPATCH_")}
    if switches:
        print("environment: " + ", ".join(f"{k}={v}" for k, v in switches.items()))
    return 0


def _print_peer_links(devices: Sequence[Device]) -> None:
    """Between every two GPUs: can one read the other's memory directly (else a split copies through the host)?"""
    try:
        links = peer_links(tuple(devices))
    except Exception as exc:  # noqa: BLE001 - info must work whatever the driver says
        print(f"peer access: unknown ({type(exc).__name__}: {exc})")
        return
    if links:
        print("peer access between GPUs:")
    for (a, b), ok in links.items():
        print(f"  {a} -> {b}: {'yes' if ok else 'no (copies go through pinned host memory)'}")


def _cuda_facts(dev: Device) -> str:
    p = dev.props
    if dev.kind != "cuda" or "cc" not in p:
        return ""
    gib = 2**30
    return (f"  cc {p['cc'][0]}.{p['cc'][1]}, {p['sm_count']} SMs, {p['total_memory'] / gib:.1f} GiB "
            f"({p['free_memory'] / gib:.1f} free), PCI {p['pci_bus_id'] or '-'}")


# -- ops ------------------------------------------------------------------------------


def cmd_ops(args: argparse.Namespace) -> int:
    mgr = manager()
    devices = _matrix_devices(mgr, args.device)
    rows = support_matrix(mgr, devices)
    names = [d.name for d in devices]
    table = [["op", "dtype", *names]] + [[op, dt, *cells] for op, dt, cells in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    if args.markdown:
        path = args.markdown
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(_markdown(table, devices))
        print(f"wrote {path}")
    return 0


def _matrix_devices(mgr: PluginManager, name: str | None) -> list[Device]:
    """The devices here, plus the plugins' descriptions of those they found none of (an H200 when no
    GPU is here), so a column of every kind is there."""
    devices = [*mgr.devices(), *(absent.stand_in for absent in mgr.absent_devices())]
    if name is None:
        return devices
    for d in devices:
        if name in (d.name, d.kind):
            return [d]
    raise UsageError(f"unknown device '{name}' (known: {', '.join(d.name for d in devices)})")


def support_matrix(mgr: PluginManager, devices: Sequence[Device]) -> list[tuple[str, str, list[str]]]:
    """(op or fused pattern, dtypes, who runs it on each device), from the conformance cases.

    Every case of the full sweep is built (cheap: no device is touched) and the
    first one of each dtype signature is planned for each device.
    """
    from .testing.cases import cases, groups
    from .testing.harness import Status, support

    rows = []
    for group in groups():
        if OPS.get(group) is not None and OPS[group].family == "view":
            continue  # views run no kernel
        first: dict[str, Case] = {}
        for case in cases(group, full=True):
            try:
                outputs, _ = case.build(np.random.default_rng(0))
            except Exception:  # noqa: BLE001 - a broken case is the harness's bug; test-ops reports it
                continue
            first.setdefault(dtype_signature(outputs[0]), case)
        if not first:
            rows.append((group, "-", ["no case"] * len(devices)))
        for sig, case in first.items():
            cells = []
            for dev in devices:
                r = support(case, dev, mgr)
                cells.append({Status.SUPPORTED: r.plugin, Status.UNSUPPORTED: f"{r.plugin} (fallback)"}
                             .get(r.status, "none"))
            rows.append((group, sig, cells))
    return rows


def dtype_signature(node: Tensor) -> str:
    """The dtypes a node takes, in source order, and its result's when that is not one of them: 'q4_0,i32 -> f32'."""
    srcs = list(dict.fromkeys(s.dtype.name for s in node.srcs if s is not None))
    return ",".join(srcs) + ("" if node.dtype.name in srcs else f" -> {node.dtype.name}")


def _markdown(table: list[list[str]], devices: Sequence[Device]) -> str:
    head, *body = table
    lines = [
        "# Op support matrix",
        "",
        "Which plugin runs a representative node of each op and dtype on each device, as dispatch picks it",
        "(first plugin in order that accepts it). Generated by `opdispatch ops --markdown`; do not edit.",
        "What each op computes: [ops.md](ops.md).",
        "",
        "Devices: " + "; ".join(f"`{d.name}` ({d.description or d.kind})" for d in devices) + ".",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(r) + " |" for r in body),
        "",
        "## Semantics",
        "",
        "Each op's builder docstring says it in full (numpy order, ggml's meaning); its first line:",
        "",
        *(f"- `{op.name}` ({op.family}): {op.doc}" for op in OPS.values()),
    ]
    return "\n".join(lines) + "\n"


# -- run ------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    try:
        names = [n.strip() for n in args.devices.split(",") if n.strip()] if args.devices else [args.device]
        devices = tuple(manager().device(n) for n in names)
        if args.devices and (len(devices) < 2 or len({d.name for d in devices}) < len(devices)):
            raise ValueError(f"--devices needs two distinct devices or more, got {args.devices!r}")
        sampler = Sampler(args.sample, args.top_k, args.top_p, args.temperature, args.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.tokens < 1 or args.prompt_len < 1 or args.batch < 1:
        raise UsageError(f"--prompt-len {args.prompt_len}, --tokens {args.tokens} and --batch {args.batch} must be "
                         "positive")
    need = args.prompt_len + args.tokens
    loaded = args.gguf or args.safetensors
    if loaded and args.dtype:
        raise UsageError("--dtype sets the dtype of random weights; loaded weights keep their stored types")
    t0 = time.perf_counter()
    if loaded:
        cfg, weights, what = _load_weights(args)
        # The KV cache is allocated whole: hold what this run needs, in whole attention windows.
        if need <= cfg.max_ctx:
            cfg = attrs.evolve(cfg, max_ctx=min(cfg.max_ctx, -(-need // WINDOW_STEP) * WINDOW_STEP))
    else:
        what = args.preset or "tiny"
        cfg = attrs.evolve(PRESETS[what], **({"dtype": args.dtype} if args.dtype else {}))
        weights = None
    if need > cfg.max_ctx:
        raise UsageError(f"--prompt-len {args.prompt_len} plus --tokens {args.tokens} must fit the context of "
                         f"{cfg.max_ctx}")
    try:
        if args.cache_dtype:
            cfg = attrs.evolve(cfg, cache_dtype=args.cache_dtype)
        print(f"model: llama {what}: {cfg.describe()}")
        model = LlamaModel(cfg, random_weights(cfg, args.seed) if weights is None else weights, max_seqs=args.batch)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    size = sum(t.nbytes for t in {id(t): t for t in model.params.values()}.values())
    cache = sum(t.nbytes for t in model.states)
    source = f"random, seed {args.seed}" if weights is None else _type_counts(model)
    print(f"weights: {source}, {_size(size)}, {'built' if weights is None else 'loaded'} in "
          f"{time.perf_counter() - t0:.2f} s; KV cache {_size(cache)}")
    prompts = np.random.default_rng(args.seed).integers(0, cfg.vocab, (args.batch, args.prompt_len)).tolist()
    print(f"sampling: {sampler.describe()}")
    fusion = False if args.no_fusion else None
    try:
        gen = Generator(model, fusion=fusion, batch=args.batch, devices=devices,
                        split="tensor" if args.split == "tensor" and len(devices) > 1 else None)
    except ValueError as exc:  # PlacementError: heads or features that do not divide among the devices
        raise UsageError(str(exc)) from None
    if args.batch == 1:
        out = gen.generate(prompts[0], args.tokens, sampler, progress=sys.stderr)
        generated = [out.tokens]
    else:
        out = gen.generate_batch(prompts, args.tokens, sampler, progress=sys.stderr)
        generated = list(out.tokens)
    placement = out.prefill_plan.placement
    where = (f"{devices[0].name} ({devices[0].description})" if placement is None else
             f"{', '.join(d.name for d in devices)}, {args.split} split: {placement.describe()}")
    print(f"device: {where}; fusion {'off' if args.no_fusion else 'on'}; compile {out.compile_s:.2f} s")
    _print_plan("prefill", out.prefill_plan)
    if out.decode_plan is not None:
        _print_plan("decode", out.decode_plan)
    for i, toks in enumerate(generated):
        label = "" if args.batch == 1 else f"sequence {i}: "
        print(f"{label}prompt: {args.prompt_len} tokens; generated: {' '.join(map(str, toks))}")
    n_prompt = args.batch * args.prompt_len
    seqs = "" if args.batch == 1 else f" ({args.batch} sequences)"
    print(f"prefill: {n_prompt} tokens{seqs} in {out.prefill_s * 1e3:.2f} ms = {out.prefill_tps:.1f} tokens/s")
    if out.decode_steps:
        made = out.decode_steps * args.batch
        print(f"decode: {made} tokens{seqs} in {out.decode_s * 1e3:.2f} ms = {out.decode_tps:.1f} tokens/s "
              f"({out.decode_s / out.decode_steps * 1e3:.3f} ms/{'token' if args.batch == 1 else 'step'})")
    return 0


# -- quantize -------------------------------------------------------------------------


def cmd_quantize(args: argparse.Namespace) -> int:
    from .models.quantize import file_type, quantize_model

    t0 = time.perf_counter()
    try:
        types = quantize_model(args.input, args.output, args.type, progress=sys.stderr)
    except OSError as exc:
        raise UsageError(f"{exc.strerror or exc}: {exc.filename}") from None
    except (ValueError, ImportError) as exc:
        raise UsageError(str(exc)) from None
    counts = ", ".join(f"{dt} x {n}" for dt, n in Counter(types.values()).most_common())
    print(f"wrote {args.output}: {args.type} (general.file_type {file_type(args.type)}), {counts}; "
          f"{_size(os.path.getsize(args.output))} from {_size(_input_size(Path(args.input)))} in "
          f"{time.perf_counter() - t0:.2f} s")
    return 0


def _input_size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return path.stat().st_size


def _load_weights(args: argparse.Namespace) -> tuple[LlamaConfig, dict[str, Tensor], str]:
    """(config, params, a name for them) from --gguf or --safetensors; the loaders import lazily."""
    try:
        from .models.weights.gguf import load_gguf
        from .models.weights.safetensors import load_safetensors
    except ImportError as exc:
        raise UsageError(f"weight loading is unavailable ({type(exc).__name__}: {exc})") from None
    try:
        if args.gguf:
            cfg, params = load_gguf(args.gguf)
            return cfg, params, f"gguf {args.gguf}"
        root = Path(args.safetensors)
        config = (root if root.is_dir() else root.parent) / "config.json"
        if not config.is_file():
            raise UsageError(f"--safetensors {args.safetensors}: no config.json beside the weights ({config})")
        try:
            cfg = LlamaConfig.from_hf(json.loads(config.read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UsageError(f"{config}: not JSON ({exc})") from None
        params = load_safetensors(root)
        common = Counter(t.dtype.name for name, t in params.items() if t.ndim >= 2).most_common(1)
        if common and common[0][0] in WEIGHT_DTYPES:  # what describe() says the weights are in
            try:
                cfg = attrs.evolve(cfg, dtype=common[0][0])
            except ValueError:
                pass
        return cfg, params, f"safetensors {args.safetensors}"
    except OSError as exc:
        raise UsageError(f"--{'gguf' if args.gguf else 'safetensors'}: {exc.strerror or exc}: {exc.filename}") from None
    except (ValueError, ImportError) as exc:
        raise UsageError(str(exc)) from None


def _type_counts(model: LlamaModel) -> str:
    """'q4_K x 97, q6_K x 17, f32 x 33': the model's weights by storage type, commonest first."""
    return ", ".join(f"{dt} x {n}" for dt, n in Counter(t.dtype.name for t in model.params.values()).most_common())


def _print_plan(what: str, plan: Plan) -> None:
    s = plan.summary()
    plugins = ", ".join(f"{name} {n}" for name, n in s["plugins"].items())
    fusions = ", ".join(f"{name} x{n}" for name, n in s["fusions"].items()) or "none"
    peak = ", ".join(f"{dev} {_size(n)}" for dev, n in s["peak"].items()) or "none"
    print(f"{what} plan: {s['nodes']} nodes -> {s['launches']} launches ({plugins}); fusions: {fusions}; "
          f"copies: {s['copies']}; arena peak: {peak}")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"

