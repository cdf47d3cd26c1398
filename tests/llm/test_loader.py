"""Loading HF checkpoint directories: dtype conversion, fused projections, clear errors, config parsing."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from warpforge.llm.config import FULL, SLIDING, ModelConfig
from warpforge.llm.loader import load
from warpforge.llm.models import MODEL_REGISTRY, build_model
from warpforge.llm.testing import PagedDriver, tiny_checkpoint

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def _copy(src, tmp_path, name="ckpt"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _edit_weights(path, fn):
    f = path / "model.safetensors"
    state = safetensors_torch.load_file(str(f))
    fn(state)
    safetensors_torch.save_file(state, str(f))


def _edit_config(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def test_weights_land_in_fused_slots_with_dtype_conversion(llama_dir):
    model, tok, cfg = load(llama_dir, dtype=torch.bfloat16)
    state = safetensors_torch.load_file(str(llama_dir / "model.safetensors"))
    assert cfg.dtype == torch.bfloat16 and all(p.dtype == torch.bfloat16 for p in model.parameters())
    attn = model.model.layers[1].self_attn
    q, k, v = (state[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(attn.qkv_proj.weight, torch.cat([q, k, v]).to(torch.bfloat16))
    mlp = model.model.layers[0].mlp
    gate, up = state["model.layers.0.mlp.gate_proj.weight"], state["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate, up]).to(torch.bfloat16))
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"].to(torch.bfloat16))


def test_default_dtype_is_the_checkpoints(llama_dir):
    assert load(llama_dir).config.dtype == torch.float32  # config.json says "dtype": "float32"


def test_missing_tensor_is_named(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path)
    _edit_weights(path, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load(path)


def test_shape_mismatch_is_named(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path)
    _edit_weights(path, lambda s: s.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*\(16, 64\).*\(32, 64\)"):
        load(path)


def test_config_that_disagrees_with_weights_is_a_clear_error(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path)
    _edit_config(path, lambda c: c.update(intermediate_size=96))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape .* the model expects"):
        load(path)


def test_unexpected_tensor_is_named(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path)
    _edit_weights(path, lambda s: s.update({"model.layers.0.self_attn.extra.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.extra\.weight'"):
        load(path)


def test_unsupported_architecture_lists_the_supported(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path)
    _edit_config(path, lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load(path)


def test_bad_paths(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="directory or a .gguf"):
        load(tmp_path / "nope")
    path = _copy(llama_dir, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load(path)
    (path / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        load(path)


def test_sharded_checkpoint_reads_the_index_shards_only(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path)
    state = safetensors_torch.load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, keys in shards.items():
        safetensors_torch.save_file({k: state[k] for k in keys}, str(path / f))
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    safetensors_torch.save_file({"layers.0.attention.wq.weight": torch.ones(2)}, str(path / "consolidated.safetensors"))
    model = load(path).model
    assert torch.equal(model.model.norm.weight, state["model.norm.weight"])


def test_eos_ids_from_config_generation_config_and_tokenizer(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4]}))
    _, tok, cfg = load(path)
    assert cfg.eos_token_ids == [2, 4] and tok.eos_token_ids == [2, 4] and cfg.bos_token_id == 1


def test_transformers4_style_config_gives_the_same_model(tmp_path):
    """rope_theta + rope_scaling (transformers 4.x, most hub checkpoints) == rope_parameters (5.x)."""
    new = tiny_checkpoint("llama3", tmp_path / "new")
    old = _copy(new, tmp_path, "old")

    def to_v4(c):
        params = c.pop("rope_parameters")
        c["rope_theta"] = params.pop("rope_theta")
        c["rope_scaling"] = params
        c["torch_dtype"] = c.pop("dtype")

    _edit_config(old, to_v4)
    a, b = load(new), load(old)
    assert a.config == b.config and a.config.rope_scaling["rope_type"] == "llama3"
    ids = list(range(5, 45))
    assert torch.equal(PagedDriver(a.model).step([(0, ids)])[0], PagedDriver(b.model).step([(0, ids)])[0])


def _hf(**kw):
    base = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 100,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 7, "num_attention_heads": 4,
            "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 128}
    return {**base, **kw}


def test_gemma3_transformers4_config():
    c = ModelConfig.from_hf(_hf(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window=32, sliding_window_pattern=3,
                                rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=32))
    assert c.layer_types == (SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL, SLIDING)
    assert (c.rope_theta, c.rope_local_theta, c.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    assert c.window(0) == 31 and c.window(2) is None and c.attn_scale == 32 ** -0.5
    assert c.norm_weight_offset == 1.0 and c.embed_scale == 8.0 and c.qk_norm and c.tie_word_embeddings


def test_qwen2_window_only_with_use_sliding_window():
    base = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", sliding_window=8, max_window_layers=1,
                num_hidden_layers=3, head_dim=None)
    off = ModelConfig.from_hf(_hf(**base))
    on = ModelConfig.from_hf(_hf(**base, use_sliding_window=True))
    assert off.sliding_window is None and off.layer_types == (FULL,) * 3
    assert on.layer_types == (FULL, SLIDING, SLIDING) and on.qkv_bias and not on.o_bias
    assert on.head_dim == 16  # hidden / heads when head_dim is null


@pytest.mark.parametrize("bad, match", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "unsupported rope type 'yarn'"),
    ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"architectures": []}, "architectures"),
    ({"intermediate_size": None}, "missing intermediate_size"),
])
def test_bad_configs(bad, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(_hf(**{"architectures": ["LlamaForCausalLM"], "model_type": "llama", **bad}))


def test_registry_builds_every_architecture():
    for arch in MODEL_REGISTRY:
        cfg = ModelConfig(architecture=arch, vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                          num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=16)
        model = build_model(cfg, "meta")
        assert all(p.device.type == "meta" for p in model.parameters())
        assert set(model.weight_slots()) >= {"model.layers.0.self_attn.q_proj.weight", "model.norm.weight"}


@pytest.mark.gpu
def test_loads_straight_to_gpu_in_bf16(llama_dir):
    cpu = load(llama_dir, dtype=torch.float32)
    gpu = load(llama_dir, dtype=torch.bfloat16, device="cuda")
    assert all(p.device.type == "cuda" for p in gpu.model.parameters())
    ids = list(range(5, 45))
    ref = PagedDriver(cpu.model).step([(0, ids)])[0]
    out = PagedDriver(gpu.model).step([(0, ids)])[0].cpu()
    assert ((out - ref).norm() / ref.norm()).item() < 3e-2  # bf16 weights and activations through 2 layers
