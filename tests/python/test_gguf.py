"""GGUF models through load_model (issue 19): a qwen3moe GGUF file, its routed experts packed
in place from their blocks (Q4_0 copied into int4 groups of 32; Q8_0 / Q4_1 decoded exactly
and quantized into cpu.format), every other tensor dequantized into torch.

The files are written here with the ``gguf`` package (llama.cpp's own writer and quantizers),
in the layout llama.cpp's converter gives a Qwen3-MoE model (metadata keys, tensor names
``blk.N.*``, experts as ``ffn_{gate,up,down}_exps`` [experts, rows, k], norms F32). The
reference is transformers running the values the file holds (the gguf package's dequantize)
in fp32: what a GGUF model means.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import tandem

from hf_models import VOCAB, build, clean_tokens, max_rel, record_routing

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# model name suffix -> GGUF name (llama.cpp's names for Qwen3-MoE; {L} the layer)
NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "blk.{L}.attn_norm.weight",
    "post_attention_layernorm.weight": "blk.{L}.ffn_norm.weight",
    "self_attn.q_proj.weight": "blk.{L}.attn_q.weight",
    "self_attn.k_proj.weight": "blk.{L}.attn_k.weight",
    "self_attn.v_proj.weight": "blk.{L}.attn_v.weight",
    "self_attn.o_proj.weight": "blk.{L}.attn_output.weight",
    "self_attn.q_norm.weight": "blk.{L}.attn_q_norm.weight",
    "self_attn.k_norm.weight": "blk.{L}.attn_k_norm.weight",
    "mlp.gate.weight": "blk.{L}.ffn_gate_inp.weight",
}


def gguf_name(name: str) -> str:
    if name in NAMES:
        return NAMES[name]
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    return NAMES[rest].format(L=layer)


def write_gguf(model, path, experts: Q, others: Q = Q.F32, arch: str = "qwen3moe",
               drop: str | None = None) -> dict[str, torch.Tensor]:
    """Writes `model` (a transformers Qwen3-MoE) as a GGUF file; returns the fp32 state dict of
    the values the file holds (transformers' names, experts fused as the model keeps them)."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny qwen3moe")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_vocab_size(c.vocab_size)
    held: dict[str, torch.Tensor] = {}

    def add(name: str, t: torch.Tensor, kind: Q) -> torch.Tensor:
        a = t.detach().float().numpy()
        if t.dim() == 1:
            kind = Q.F32  # as llama.cpp's converter: norms stay F32
        if kind in (Q.F32, Q.F16):
            data = a.astype(np.float32 if kind == Q.F32 else np.float16)
            w.add_tensor(name, data)
            return torch.from_numpy(data.astype(np.float32))
        data = gguf.quants.quantize(a, kind)
        w.add_tensor(name, data, raw_dtype=kind)
        return torch.from_numpy(gguf.quants.dequantize(data, kind).astype(np.float32)).reshape(t.shape)

    if c.model_type == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2MOE, c.num_hidden_layers)

        def to_gguf(name: str) -> str:
            stem, suffix = name.rsplit(".", 1)
            return names.get_name(stem) + "." + suffix
    else:
        to_gguf = gguf_name
    for name, t in model.state_dict().items():
        if name.endswith("shared_expert_gate.weight"):
            t = t.reshape(-1)  # [1, H] in the model, [H] in llama.cpp's files
        if name.endswith("mlp.experts.gate_up_proj"):
            L = name.split(".")[2]
            i = t.shape[1] // 2
            g = t[:, :i].float()
            if drop != f"blk.{L}.ffn_gate_exps.weight":
                g = add(f"blk.{L}.ffn_gate_exps.weight", t[:, :i], experts)
            u = add(f"blk.{L}.ffn_up_exps.weight", t[:, i:], experts)
            held[name] = torch.cat([g, u], 1)
        elif name.endswith("mlp.experts.down_proj"):
            L = name.split(".")[2]
            held[name] = add(f"blk.{L}.ffn_down_exps.weight", t, experts)
        elif to_gguf(name) != drop:
            held[name] = add(to_gguf(name), t, others).reshape(model.state_dict()[name].shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The fp32 transformers model the GGUF files are written from."""
    root = tmp_path_factory.mktemp("gguf-src")
    return build("qwen3_moe", 1, torch.float32, root)


@pytest.fixture(scope="module")
def gguf_model(source, tmp_path_factory):
    """(experts type, others type) -> (GGUF file, the reference model holding its values)."""
    cache = {}

    def get(experts: Q, others: Q = Q.F32):
        if (experts, others) not in cache:
            import copy

            path = tmp_path_factory.mktemp("gguf") / f"tiny-{experts.name}-{others.name}.gguf"
            held = write_gguf(source, path, experts, others)
            ref = copy.deepcopy(source)
            ref.load_state_dict(held, strict=True)
            cache[experts, others] = path, ref.eval()
        return cache[experts, others]

    return get


def cfg(fmt: str) -> dict:
    cpu = {"threads": 2, "format": fmt}
    if fmt == "int4":
        cpu.update(group_size=32)
    return {"version": 1, "cpu": cpu, "gpu": {"device": "none"}}


# Bounds on the max relative logit error over tokens routed alike, as in test_gptq.py: Q4_0 as
# int4 g32 holds the file's values exactly (error from int8 activations); bf16 rounds them;
# int8 and int4 from Q8_0 / Q4_1 quantize the file's values again (plus int8 activations).
@pytest.mark.parametrize("experts,fmt,bound", [(Q.Q4_0, "int4", 6e-2), (Q.Q4_0, "bf16", 1.5e-2),
                                               (Q.Q8_0, "int8", 6e-2), (Q.Q8_0, "bf16", 1.5e-2),
                                               (Q.Q4_1, "int8", 6e-2), (Q.F16, "bf16", 1.5e-2)])
def test_a_gguf_model_computes_the_values_its_file_holds(gguf_model, experts, fmt, bound, seed):
    path, ref = gguf_model(experts, Q.Q8_0)
    ours = tandem.load_model(path, cfg(fmt), dtype=torch.float32, progress=False)
    assert ours.config.moe_intermediate_size == ref.config.moe_intermediate_size  # (transformers' mapping misses it)
    assert ours.config.norm_topk_prob is True
    ids = torch.randint(0, VOCAB, (8, 8), generator=torch.Generator().manual_seed(seed))
    ra, rb = record_routing(ref), record_routing(ours)
    with torch.no_grad():
        want, got = ref(input_ids=ids).logits, ours(input_ids=ids).logits
    clean = clean_tokens(ra, rb, *ids.shape)
    assert clean.float().mean() >= 0.25, f"routing differs for most tokens ({(~clean).sum().item()})"
    err = max_rel(got, want, clean)
    print(f"{experts.name} experts as {fmt}: clean {clean.sum().item()}/{clean.numel()}, max rel err {err:.2e}")
    assert err <= bound
    # The other weights are the file's values (Q8_0 here), dequantized exactly.
    assert torch.equal(ours.model.layers[1].self_attn.q_proj.weight, ref.model.layers[1].self_attn.q_proj.weight)


def test_q4_0_experts_keep_their_values_as_int4(gguf_model):
    path, ref = gguf_model(Q.Q4_0)
    ours = tandem.load_model(path, cfg("int4"), dtype=torch.float32, progress=False)
    engine = ours.tandem_engine
    for i, layer in enumerate(ref.model.layers):
        gate_up, down = layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj
        inter = down.shape[2]
        for e in (0, gate_up.shape[0] - 1):
            g, u, d = (torch.from_numpy(a) for a in engine.expert_weights(i, e))
            assert torch.equal(g, gate_up[e, :inter]) and torch.equal(u, gate_up[e, inter:]) and torch.equal(d, down[e])


def test_a_gguf_store_holds_the_same_packs(gguf_model, tmp_path, seed):
    path, _ = gguf_model(Q.Q4_0)
    c = cfg("int4")
    r = tandem.convert(path, c, out=tmp_path / "s", progress=False)
    assert r["layers_written"] == 3
    direct = tandem.load_model(path, c, progress=False)
    stored = tandem.load_model(path, c, store=tmp_path / "s", progress=False)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        assert torch.equal(direct(input_ids=ids).logits, stored(input_ids=ids).logits)


def test_a_split_gguf_model_loads_from_any_of_its_files(gguf_model, tmp_path, seed):
    """Two files as llama.cpp's gguf-split writes them: the metadata and some tensors in the
    first, the rest in the second, split.count in both."""
    path, ref = gguf_model(Q.Q4_0)
    r = gguf.GGUFReader(str(path))
    names = [t.name for t in r.tensors]
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:])):
        w = gguf.GGUFWriter(str(tmp_path / f"m-{i + 1:05d}-of-00002.gguf"), "qwen3moe")
        if i == 0:
            for f in r.fields.values():
                if f.name.startswith(("qwen3moe.", "general.name")):
                    w.add_key_value(f.name, f.contents(), f.types[0])
        w.add_uint16("split.no", i)
        w.add_uint16("split.count", 2)
        w.add_int32("split.tensors.count", len(names))
        for t in r.tensors:
            if t.name in part:
                w.add_tensor(t.name, t.data, raw_shape=list(reversed([int(d) for d in t.shape])) if
                             t.tensor_type in (Q.F32, Q.F16) else None,
                             raw_dtype=None if t.tensor_type in (Q.F32, Q.F16) else t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))
    whole = tandem.load_model(path, cfg("int4"), progress=False)
    with torch.no_grad():
        want = whole(input_ids=ids).logits
    for f in ("m-00001-of-00002.gguf", "m-00002-of-00002.gguf"):
        split = tandem.load_model(tmp_path / f, cfg("int4"), progress=False)
        with torch.no_grad():
            assert torch.equal(split(input_ids=ids).logits, want)
    (tmp_path / "m-00002-of-00002.gguf").unlink()
    with pytest.raises(ValueError, match=r"m-00001-of-00002\.gguf: part of a model split into 2 files, but "
                                         r"m-00002-of-00002\.gguf is missing"):
        tandem.load_model(tmp_path / "m-00001-of-00002.gguf", cfg("int4"), progress=False)


def test_what_cannot_be_read_is_refused(source, gguf_model, tmp_path):
    # Experts of a type the packers do not read: named with the tensor.
    bad = tmp_path / "q5.gguf"
    write_gguf(source, bad, Q.Q5_0)
    with pytest.raises(ValueError, match=r"q5\.gguf: routed-expert tensor 'blk\.\d\.ffn_(gate|up|down)_exps\.weight' is "
                                         r"GGUF type Q5_0; tandem packs experts from F32, F16, BF16, Q4_0, Q4_1, Q8_0"):
        tandem.load_model(bad, cfg("int8"), progress=False)
    # An architecture whose tensors transformers reorders (llama's q / k rows): refused by name.
    other = tmp_path / "llama.gguf"
    write_gguf(source, other, Q.Q8_0, arch="llama")
    with pytest.raises(ValueError, match=r"GGUF architecture 'llama' is not supported \(tandem reads qwen2moe, qwen3moe"):
        tandem.load_model(other, cfg("int8"), progress=False)
    # A file cut short: the tensor that runs past its end is named.
    good, _ = gguf_model(Q.Q4_0)
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match=r"cut\.gguf"):
        tandem.load_model(cut, cfg("int4"), progress=False)
    # A tensor missing: named.
    missing = tmp_path / "missing.gguf"
    write_gguf(source, missing, Q.Q4_0, drop="blk.1.attn_k.weight")
    with pytest.raises(ValueError, match=r"k_proj"):
        tandem.load_model(missing, cfg("int4"), progress=False)
    gone = tmp_path / "gone.gguf"
    write_gguf(source, gone, Q.Q4_0, drop="blk.2.ffn_gate_exps.weight")
    with pytest.raises(ValueError, match=r"gone\.gguf: model layer 2 is a MoE layer, but the GGUF model has no "
                                         r"'blk\.2\.ffn_gate_exps\.weight'"):
        tandem.load_model(gone, cfg("int4"), progress=False)
    # A big-endian file (the C++ side reads the experts' bytes as they are) and a split name that
    # cannot be.
    big = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(big), "qwen3moe", endianess=gguf.GGUFEndian.BIG)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"big\.gguf: a big-endian GGUF file"):
        tandem.load_model(big, cfg("int4"), progress=False)
    odd = tmp_path / "m-00003-of-00002.gguf"
    odd.write_bytes(good.read_bytes())
    with pytest.raises(ValueError, match=r"m-00003-of-00002\.gguf: a split GGUF file's name says part 3 of 2"):
        tandem.load_model(odd, cfg("int4"), progress=False)
    # Training and adapters need the safetensors checkpoint.
    with pytest.raises(ValueError, match=r"a GGUF model loads for inference only"):
        tandem.load_model(good, cfg("int4"), train=True, progress=False)


def test_packing_experts_far_larger_than_the_file_is_warned(gguf_model, recwarn):
    path, _ = gguf_model(Q.Q4_0)
    with pytest.warns(UserWarning, match=r"its experts are Q4_0 \(4\.5 bits a weight\) and cpu\.format bf16 packs them "
                                         r"at 16 bits \(3\.6x the memory\); cpu\.format int4 with group_size 32 keeps their values exactly"):
        tandem.load_model(path, cfg("bf16"), progress=False)
    recwarn.clear()
    tandem.load_model(path, cfg("int4"), progress=False)
    assert not [w for w in recwarn if "cpu.format" in str(w.message)]


def test_a_qwen2_moe_gguf_with_shared_experts_and_biases(tmp_path, seed):
    """qwen2moe: attention biases, a shared expert and its sigmoid gate ([H] in the file, [1, H]
    in the model), its width read from expert_shared_feed_forward_length."""
    import copy

    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfgm = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                          shared_expert_intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, initializer_range=0.08,
                          max_position_embeddings=512)
    torch.manual_seed(seed)
    src = Qwen2MoeForCausalLM(cfgm).eval()
    with torch.no_grad():
        for n, p in src.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0, 0.05)
    path = tmp_path / "qwen2moe.gguf"
    held = write_gguf(src, path, Q.Q4_0, Q.Q8_0, arch="qwen2moe")
    ref = copy.deepcopy(src)
    ref.load_state_dict(held, strict=True)
    ours = tandem.load_model(path, cfg("int4"), dtype=torch.float32, progress=False)
    assert ours.config.shared_expert_intermediate_size == 96 and ours.config.moe_intermediate_size == 64
    assert ours.config.norm_topk_prob is False  # llama.cpp's qwen2moe graph (and qwen3moe's True, below)
    ids = torch.randint(0, VOCAB, (8, 8), generator=torch.Generator().manual_seed(seed))
    ra, rb = record_routing(ref), record_routing(ours)
    with torch.no_grad():
        want, got = ref(input_ids=ids).logits, ours(input_ids=ids).logits
    clean = clean_tokens(ra, rb, *ids.shape)
    assert clean.float().mean() >= 0.25
    err = max_rel(got, want, clean)
    print(f"qwen2moe Q4_0 as int4: clean {clean.sum().item()}/{clean.numel()}, max rel err {err:.2e}")
    assert err <= 6e-2
    assert torch.equal(ours.model.layers[1].mlp.shared_expert_gate.weight, ref.model.layers[1].mlp.shared_expert_gate.weight)


def test_the_cli_takes_a_gguf_file(gguf_model, tmp_path, capsys):
    """tandem convert writes the store beside the file; tandem run refuses a file without a
    tokenizer before loading the model, naming the file."""
    import shutil

    from tandem import cli

    src, _ = gguf_model(Q.Q4_0)
    path = tmp_path / "m.gguf"
    shutil.copy(src, path)
    assert cli.main(["convert", "--no-progress", "--model", str(path), "--format", "int4", "--group-size", "32"]) == 0
    assert (tmp_path / "m.tandem-int4-g32" / "manifest.json").is_file()
    capsys.readouterr()
    assert cli.main(["run", "--no-progress", "--model", str(path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"tandem: error: {path}: transformers cannot build a tokenizer from the GGUF file's vocabulary" in err, err
