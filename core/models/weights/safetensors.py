"""load_safetensors: a safetensors file or a directory of shards -> params, parsed here (no package needed).

The format: an 8-byte little-endian header length, a JSON header of
``{name: {dtype, shape, data_offsets}}``, then the data; every extent is
checked against the file's size before anything is mapped.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from ...dtypes import dtype as as_dtype
from ...tensor import Tensor, param

#: safetensors dtype names loaded -> opdispatch dtype names. Others are refused.
SAFETENSORS_DTYPES: dict[str, str] = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
_ST_HEADER_MAX = 100 << 20  # the safetensors library's own limit on the JSON header


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _safetensors_file(path: Path) -> dict[str, Tensor]:
    size = path.stat().st_size
    if size < 8:
        raise ValueError(f"{path}: {size} bytes, too short for a safetensors header length")
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if n > size - 8:
            raise ValueError(f"{path}: header length {n} runs past the end of the file ({size} bytes): "
                             f"truncated or not a safetensors file")
        if n > _ST_HEADER_MAX:
            raise ValueError(f"{path}: header length {n} is over the {_ST_HEADER_MAX}-byte limit")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: the header is not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is a JSON {type(header).__name__}, not an object")
    start, data_len = 8 + n, size - 8 - n
    mm = np.memmap(path, dtype=np.uint8, mode="r") if data_len else np.zeros(0, np.uint8)

    out: dict[str, Tensor] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict):
                raise ValueError(f"{path}: __metadata__ is not a JSON object")
            continue
        where = f"{path}: tensor '{name}'"
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise ValueError(f"{where}: needs dtype, shape and data_offsets, got {info!r}")
        st_dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if st_dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{where} has dtype {st_dtype!r}; opdispatch loads {', '.join(SAFETENSORS_DTYPES)}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise ValueError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise ValueError(f"{where}: data_offsets {offsets!r} is not a pair of integers")
        begin, end = offsets
        if not 0 <= begin <= end <= data_len:
            raise ValueError(f"{where}: data_offsets [{begin}, {end}] fall outside the data area of {data_len} "
                             f"bytes (file of {size} bytes): truncated or corrupt")
        dt = as_dtype(SAFETENSORS_DTYPES[st_dtype])
        want = math.prod(shape) * dt.block_bytes
        if end - begin != want:
            raise ValueError(f"{where}: {st_dtype} {tuple(shape)} takes {want} bytes but data_offsets "
                             f"[{begin}, {end}] hold {end - begin}")
        spans.append((begin, end, name))
        out[name] = param(name, mm[start + begin:start + end], dt, shape=shape)
    spans.sort()
    for (_, e0, a), (b1, _, b) in zip(spans, spans[1:]):
        if b1 < e0:
            raise ValueError(f"{path}: tensors '{a}' and '{b}' overlap in the data area")
    return out


def load_safetensors(path_or_dir: str | os.PathLike[str]) -> dict[str, Tensor]:
    """A safetensors file, or a directory of shards -> {name: param}, names and f32/f16/bf16 kept.

    In a directory with ``model.safetensors.index.json`` the shards it names
    are loaded and every tensor it lists must be in its shard; without one,
    every ``*.safetensors`` file is loaded. A name in two shards is an error.
    """
    root = Path(path_or_dir)
    if not root.is_dir():
        return _safetensors_file(root)
    index = root / "model.safetensors.index.json"
    weight_map: dict[str, str] | None = None
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from None
        files = [root / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{root}: no *.safetensors files")
    out: dict[str, Tensor] = {}
    origin: dict[str, Path] = {}
    for f in files:
        if not f.is_file():
            raise ValueError(f"{index}: shard {f.name} is missing")
        for name, t in _safetensors_file(f).items():
            if name in out:
                raise ValueError(f"{root}: tensor '{name}' is in two shards, {origin[name].name} and {f.name}")
            out[name], origin[name] = t, f
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in out or origin[name].name != Path(shard).name:
                found = origin[name].name if name in out else "no shard"
                raise ValueError(f"{index}: tensor '{name}' is listed in {shard} but found in {found}")
    return out
