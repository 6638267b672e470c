"""tandem._C.LoraEngine (sft/lora_engine.h through the bindings): the training side built from a
config, loaded from a checkpoint like the inference engine. Its layers compute exactly (bit for
bit) what stand-alone ``_C.LoraLayer`` objects on a ``_C.Pool`` compute when each loads its
layer from the same checkpoint (the way ``load_model(train=True)`` built them before), and a
bad tensor anywhere is named before any layer is packed. The C++ tests
(tests/cpp/test_lora_engine.cpp) check formats, kernel levels and backward too.
"""
import pytest
import torch

import tandem
from tandem import _C

CFG = {"version": 1, "cpu": {"threads": 1, "virtual_subpools": 2}, "gpu": {"device": "none"}}
CFG_TEXT = "version: 1\ncpu: {threads: 1, virtual_subpools: 2}\ngpu: {device: none}\n"


def run(layer, x, ids, w):
    out = torch.full_like(x, float("nan"))
    layer.forward(x.data_ptr(), False, x.shape[0], ids.data_ptr(), w.data_ptr(), ids.shape[1], out.data_ptr(), [],
                  False)
    return out


def test_load_model_train_builds_the_cpp_engine(tiny_qwen3_moe_dir):
    model = tandem.load_model(tiny_qwen3_moe_dir, CFG, device="cpu", train=True, progress=False)
    engine = model.tandem_engine
    assert isinstance(engine, _C.LoraEngine) and isinstance(engine, tandem.engine.LoraEngine)
    assert engine.loaded and not engine.is_cuda
    assert engine.isa == _C.select_isa("auto")
    assert engine.subpools == 2 and engine.threads == 2 and engine.pool.subpools == 2
    assert engine.model_layers == [0, 1] and engine.moe_layers == 2 and engine.index_of(1) == 1
    assert engine.layers[0] is engine.layers[0]
    experts = [m for m in model.modules() if type(m).__name__ == "TandemLoraExperts"]
    assert [m.lora_layer for m in experts] == engine.layers
    assert engine.packed_bytes == sum(layer.packed_bytes for layer in engine.layers) > 0
    assert engine.backward_bytes == 0
    engine.prepare_backward()
    assert engine.backward_bytes == sum(layer.backward_bytes for layer in engine.layers) > 0

    # The same bits as stand-alone layers loaded per layer from the checkpoint.
    ckpt = _C.Checkpoint(tiny_qwen3_moe_dir)
    naming = _C.expert_naming(ckpt, 0)
    pool = _C.Pool(config_text=CFG_TEXT)
    g = torch.Generator().manual_seed(20261121)
    for i, ours in enumerate(engine.layers):
        E, H, I = ours.experts, ours.hidden, ours.inter
        alone = _C.LoraLayer(pool, E, H, I, layer=i)
        alone.load_checkpoint(ckpt, i, naming)
        assert alone.packed_bytes == ours.packed_bytes and alone.isa == ours.isa
        x = torch.randn(9, H, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(9)])
        w = torch.rand(9, 2, generator=g)
        assert torch.equal(run(ours, x, ids, w), run(alone, x, ids, w)), f"MoE layer {i}"


def test_layers_outlive_their_engine():
    engine = _C.LoraEngine(config_text=CFG_TEXT, experts=4, hidden=32, inter=64, layers=[2, 5], rank=4, alpha=8.0)
    layer = engine.layers[1]
    assert (layer.layer_index, layer.rank, layer.scaling) == (5, 4, 2.0)
    del engine
    W = [torch.randn(4, 64, 32).bfloat16(), torch.randn(4, 64, 32).bfloat16(), torch.randn(4, 32, 64).bfloat16()]
    layer.load(*[[t.data_ptr() for t in m] for m in W], "bfloat16")
    out = run(layer, torch.randn(3, 32), torch.tensor([[0, 1], [2, 3], [1, -1]]), torch.rand(3, 2))
    assert torch.isfinite(out).all()


def test_a_bad_tensor_is_named_before_anything_loads(tmp_path):
    from safetensors.torch import save_file

    E, H, I = 4, 32, 64
    tensors = {}
    for L in (0, 1):
        for e in range(E):
            tensors[f"model.layers.{L}.mlp.experts.{e}.gate_proj.weight"] = torch.randn(I, H).bfloat16()
            tensors[f"model.layers.{L}.mlp.experts.{e}.up_proj.weight"] = torch.randn(I, H).bfloat16()
            tensors[f"model.layers.{L}.mlp.experts.{e}.down_proj.weight"] = torch.randn(H, I).bfloat16()
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    ckpt = _C.Checkpoint(str(tmp_path / "model.safetensors"))
    engine = _C.LoraEngine(config_text=CFG_TEXT, experts=E, hidden=H, inter=I, layers=[0, 1])
    with pytest.raises(ValueError, match=r"has no tensor model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        engine.load_checkpoint(ckpt, _C.expert_naming(ckpt, 0))
    assert not engine.loaded and engine.packed_bytes == 0
