"""tandem's safetensors reader against the reference implementation (the safetensors
package) and against checkpoints written by transformers."""
import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import tandem

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8,
          torch.uint8, torch.int16, torch.int32, torch.int64, torch.float64, torch.bool]


def raw_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def test_matches_reference_writer_for_every_dtype(tmp_path, seed):
    tensors = {}
    for i, dt in enumerate(DTYPES):
        shape = (3, 5, 2) if i % 2 else (7,)
        if dt.is_floating_point:
            tensors[f"t{i}.{str(dt)[6:]}"] = torch.randn(shape).to(dt)
        elif dt == torch.bool:
            tensors[f"t{i}.bool"] = torch.rand(shape) > 0.5
        else:
            tensors[f"t{i}.{str(dt)[6:]}"] = torch.randint(0, 100, shape, dtype=dt)
    tensors["scalar"] = torch.tensor(3.5)
    tensors["empty"] = torch.zeros((0, 4), dtype=torch.bfloat16)
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})

    ckpt = tandem.Checkpoint(path)
    assert sorted(ckpt.names()) == sorted(tensors)
    for name, t in tensors.items():
        dtype, shape, file = ckpt.info(name)
        assert shape == list(t.shape), name
        assert ckpt.read_bytes(name) == raw_bytes(t), name
        assert file == str(path)


def test_sharded_transformers_checkpoint(tiny_qwen3_moe_dir):
    """Every tensor of a 10-shard checkpoint saved by transformers reads back bit-exact."""
    ckpt = tandem.Checkpoint(tiny_qwen3_moe_dir)
    index = json.load(open(f"{tiny_qwen3_moe_dir}/model.safetensors.index.json"))["weight_map"]
    assert ckpt.num_files == len(set(index.values())) > 1
    assert sorted(ckpt.names()) == sorted(index)
    for name, shard in index.items():
        with safe_open(f"{tiny_qwen3_moe_dir}/{shard}", framework="pt") as f:
            ref = f.get_tensor(name)
        dtype, shape, file = ckpt.info(name)
        assert file.endswith(shard)
        assert shape == list(ref.shape)
        assert ckpt.read_bytes(name) == raw_bytes(ref), name
    assert ckpt.info("model.layers.1.mlp.experts.7.down_proj.weight")[:2] == ("BF16", [32, 16])


def test_truncated_file_gives_clear_error(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(64)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(ValueError) as info:
        tandem.Checkpoint(path)
    assert str(info.value).startswith(
        f"{path}: tensor 'w': data_offsets [0, 256] run past the data section (246 bytes); "
        "the file is truncated or corrupt  [")


def test_hostile_header_length(tmp_path):
    path = tmp_path / "evil.safetensors"
    path.write_bytes(struct.pack("<Q", 2**63) + b"{}")
    with pytest.raises(ValueError, match=r"header length 9223372036854775808 exceeds the limit of 100000000 bytes"):
        tandem.Checkpoint(path)


def test_header_bytes_that_are_not_utf8_name_the_file(tmp_path):
    path = tmp_path / "latin1.safetensors"
    header = b'{"w\xff": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(ValueError) as info:  # not a UnicodeDecodeError without the file
        tandem.Checkpoint(path)
    assert str(info.value).startswith(f"{path}: ")


def test_missing_tensor_and_path(tmp_path, tiny_qwen3_moe_dir):
    ckpt = tandem.Checkpoint(tiny_qwen3_moe_dir)
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.mlp.experts.0.gate.weight' not found in checkpoint"):
        ckpt.info("model.layers.0.mlp.experts.0.gate.weight")
    with pytest.raises(OSError, match="does not exist"):
        tandem.Checkpoint(tmp_path / "nope")
