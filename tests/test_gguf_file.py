"""pipeserve's GGUF header reader (model/loader/gguf_file.py) against the gguf package's."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
import torch

from pipeserve.model.loader.gguf_file import GGUFFile
from tests.checkpoints import build_checkpoint, write_llama_gguf


def _write_metadata_file(path, byteswap: bool = False) -> None:
    """A file with one value of every metadata type, and three small tensors."""
    w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG if byteswap else gguf.GGUFEndian.LITTLE)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.125)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.strs", ["a", "", "ünïcode"])
    w.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("f16", np.arange(64, dtype=np.float16).reshape(2, 32))
    q = gguf.quants.quantize(np.linspace(-1, 1, 64 * 2, dtype=np.float32).reshape(2, 64), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _same_as_gguf(path) -> None:
    ours, theirs = GGUFFile(str(path)), gguf.GGUFReader(str(path))
    assert set(ours.fields) == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            assert ours.get_field(key).contents() == field.contents(), key
    assert ours.get_field("no.such.key") is None
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (b.tensor_type, b.n_elements, b.n_bytes,
                                                                          b.data_offset), a.name
        assert a.shape.tolist() == b.shape.tolist(), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name


def test_every_metadata_type_and_tensor_kind(tmp_path) -> None:
    path = tmp_path / "m.gguf"
    _write_metadata_file(path)
    _same_as_gguf(path)
    f = GGUFFile(str(path))
    assert f.get_field("t.strs").contents() == ["a", "", "ünïcode"]
    assert f.get_field("t.u64").contents() == 2**63 + 5


@pytest.mark.parametrize("qtype", ["F32", "Q4_1", "Q8_0"])
def test_a_written_model(tmp_path, qtype: str) -> None:
    _same_as_gguf(write_llama_gguf(build_checkpoint("llama_tied_gqa", tmp_path / "hf"), tmp_path / "m.gguf", qtype))


def test_bad_files_are_refused_with_a_reason(tmp_path) -> None:
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(not_gguf))
    good = tmp_path / "m.gguf"
    _write_metadata_file(good)
    data = good.read_bytes()
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(data[:200])
    with pytest.raises(ValueError, match="truncated"):
        GGUFFile(str(truncated))
    old = tmp_path / "v1.gguf"
    old.write_bytes(data[:4] + struct.pack("<I", 1) + data[8:])
    with pytest.raises(ValueError, match="version 1 is not supported"):
        GGUFFile(str(old))
    big = tmp_path / "big.gguf"
    _write_metadata_file(big, byteswap=True)
    with pytest.raises(ValueError, match="big-endian"):
        GGUFFile(str(big))
    with pytest.raises(ValueError, match="cannot read"):
        GGUFFile(str(tmp_path / "missing.gguf"))


@pytest.mark.parametrize("qtype", ["F32", "Q4_1"])
def test_a_split_model_loads_as_the_whole_file(tmp_path, qtype: str) -> None:
    # gguf-split's layout, written by the gguf package: metadata in part 1, tensors spread over
    # the parts. Opened from its first part it is the same model as the single file.
    from pipeserve.model.loader import resolve_model
    from tests.test_loaders import run_stages
    hf = build_checkpoint("llama_tied_gqa", tmp_path / "hf")
    whole = write_llama_gguf(hf, tmp_path / "whole.gguf", qtype)
    first = write_llama_gguf(hf, tmp_path / "split.gguf", qtype, split_max_tensors=5)
    parts = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert first == parts[0] and len(parts) > 2
    one, split = GGUFFile(str(whole)), GGUFFile(str(first))
    assert sorted(t.name for t in split.tensors) == sorted(t.name for t in one.tensors)
    ids, layers = list(range(3, 20)), resolve_model(str(whole)).load_config().num_layers
    for quantization in ("none", "auto"):
        ref = run_stages(resolve_model(str(whole)), [0, layers // 2, layers], ids, quantization=quantization)
        got = run_stages(resolve_model(str(first)), [0, layers // 2, layers], ids, quantization=quantization)
        assert torch.equal(ref, got), quantization
    with pytest.raises(ValueError, match="pass its first part"):
        GGUFFile(str(parts[1]))
    parts[-1].unlink()
    with pytest.raises(ValueError, match=f"part {len(parts)} .* is missing"):
        GGUFFile(str(first))
