"""GGUF tensor data must follow ggml's packed layout: files written by gguf's GGUFWriter, then patched in
their tensor infos (u64 name length, name, u32 n_dims, u64 ne[n_dims], u32 type, u64 offset)."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from opdispatch.models.weights.gguf import read_gguf

#: name -> shape (numpy order), f32; data bytes 0..2048, 2048..3072, 3072..3456 (alignment 32)
TENSORS = {"a": (8, 64), "b": (4, 64), "c": (3, 32)}


@pytest.fixture
def good(tmp_path: Path, rng: np.random.Generator) -> Path:
    path = tmp_path / "good.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for name, shape in TENSORS.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _info(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (byte of its ne[1] field, byte of its offset field) in the tensor info of `path`."""
    reader = gguf.GGUFReader(str(path))
    at = {}
    for t in reader.tensors:
        ne_at = t.field.offset + 8 + len(t.name) + 4
        at[t.name] = (ne_at + 8, ne_at + 8 * len(t.shape) + 4)
    return at


def _patched(good: Path, name: str, field: int, value: int) -> Path:
    data = bytearray(good.read_bytes())
    at = _info(good)[name][field]
    data[at:at + 8] = struct.pack("<Q", value)
    bad = good.with_name("bad.gguf")
    bad.write_bytes(data)
    return bad


NE1, OFFSET = 0, 1


def test_a_packed_file_loads(good: Path) -> None:
    _, tensors = read_gguf(good)
    assert {n: t.shape for n, t in tensors.items()} == TENSORS


def test_two_tensors_at_one_offset_are_refused_naming_both(good: Path) -> None:
    bad = _patched(good, "b", OFFSET, 0)  # b's data would be a's first 1024 bytes
    with pytest.raises(ValueError, match=r"bad\.gguf: tensor 'b' \(data bytes 0\.\.1024\) overlaps tensor 'a' "
                                         r"\(data bytes 0\.\.2048\)"):
        read_gguf(bad)


def test_a_tensor_enlarged_into_its_neighbour_is_refused(good: Path) -> None:
    bad = _patched(good, "a", NE1, 12)  # a: 12 rows of 256 bytes, into b's bytes; the file is long enough
    with pytest.raises(ValueError, match=r"tensor 'b' \(data bytes 2048\.\.3072\) overlaps tensor 'a' "
                                         r"\(data bytes 0\.\.3072\)"):
        read_gguf(bad)


def test_a_gap_is_not_the_packed_layout(good: Path) -> None:
    with pytest.raises(ValueError, match=r"tensor 'b': data offset 2080, expected 2048: each tensor's data "
                                         r"follows the previous one's \('a', data bytes 0\.\.2048\) padded to "
                                         r"the alignment 32"):
        read_gguf(_patched(good, "b", OFFSET, 2080))
    with pytest.raises(ValueError, match=r"tensor 'a': data offset 32, expected 0: the first tensor's data starts"):
        read_gguf(_patched(good, "a", OFFSET, 32))


def test_a_declared_size_past_the_file_is_refused_however_large(good: Path) -> None:
    for rows in (4, 2**40, 2**63):  # one row more; terabytes; a product that overflows int64 many times
        with pytest.raises(ValueError, match=rf"tensor 'c' \(F32, ne \[32, {rows}\], {rows * 128} bytes at byte "
                                             r"\d+\) runs past the end of the file"):
            read_gguf(_patched(good, "c", NE1, rows))
