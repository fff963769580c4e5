"""Issue 59 (part 3): every Hugging Face family of gattn/interop/ (llama: Qwen3 and Llama, qwen3_moe,
qwen3_next, qwen3_5, release) reads config.json as strictly as the others: each field mapped, known
to change nothing gattn computes, or refused in one line naming it. No model is built: the configs
are small dicts and transformers' own defaults (what save_pretrained writes)."""

import json

import pytest

from gattn.config import ConfigError
from gattn.interop import convert, hf_config

SMALL = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128}
GDN = {"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2, "linear_num_value_heads": 4,
       "linear_key_head_dim": 16, "linear_value_head_dim": 8}
# One valid config.json per family (and per way a family is stored), as small as it reads.
FAMILIES = {
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **SMALL},
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SMALL},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **SMALL, "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "qwen3_next": {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", **SMALL, **GDN,
                   "mlp_only_layers": [0, 1], "num_experts": 0},
    "qwen3_5": {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", **SMALL, **GDN},
    "qwen3_5 multimodal": {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                           "text_config": {"model_type": "qwen3_5_text", **SMALL, **GDN}, "vision_config": {}},
    "release": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen2", **SMALL, "use_qk_norm": False,
                "qkv_bias": False, "headwise_attn_output_gate": True, "elementwise_attn_output_gate": False},
}
# How a family's unknown-field refusal names it.
NAMES = {"qwen3": "Qwen3's", "llama": "Llama's", "qwen3_moe": "Qwen3-MoE's", "qwen3_next": "Qwen3-Next's",
         "qwen3_5": "Qwen3.5's", "qwen3_5 multimodal": "Qwen3.5's multimodal", "release": "release's"}
QUANTIZED = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}


@pytest.mark.parametrize("extra, refused", [({"foo": 1}, "'config.json foo' = 1 is not allowed: absent"),
                                            ({"quantization_config": QUANTIZED},
                                             "'config.json quantization_config' = 'fp8' is not allowed: absent")])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_refuses_an_unknown_field_and_a_quantized_checkpoint_in_one_line(
        family, extra, refused, tmp_path, capsys):
    """`from-hf` of a folder whose config.json adds an unknown field, or a quantization_config
    (gattn reads float weights only), stops with exit 2 and one line naming the field, before any
    tensor is looked for; without the addition the same config.json reads."""
    hf = FAMILIES[family]
    assert hf_config.model_config(hf, hf_config.detect_layout(hf)).num_layers == 2
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({**hf, **extra}))
    capsys.readouterr()
    assert convert.main(["from-hf", str(src), "--workdir", str(tmp_path / "run")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: config field {refused}"), lines
    assert ("dequantize" if "quantization_config" in extra else NAMES[family]) in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("config_class, layout", [
    ("Qwen3Config", "qwen3"), ("LlamaConfig", "llama"), ("Qwen3MoeConfig", "qwen3_moe"),
    ("Qwen3NextConfig", "qwen3_next"), ("Qwen3_5TextConfig", "qwen3_5"), ("Qwen3_5MoeTextConfig", "qwen3_5"),
    ("Qwen3_5Config", "qwen3_5"), ("Qwen3_5MoeConfig", "qwen3_5")])
def test_every_field_transformers_writes_is_mapped_or_known(config_class, layout):
    """Each field of transformers' own config (its defaults, as save_pretrained writes them) is one
    a family maps or knows to change nothing: strictness refuses only what gattn cannot read."""
    transformers = pytest.importorskip("transformers")
    hf = getattr(transformers, config_class)().to_dict()
    assert hf_config.detect_layout(hf) == layout
    cfg = hf_config.model_config(hf, layout)
    text = hf.get("text_config") or hf
    assert (cfg.d_model, cfg.num_layers) == (text["hidden_size"], text["num_hidden_layers"])


@pytest.mark.parametrize("family, change, refused", [
    ("qwen3", {"use_sliding_window": True}, "'config.json use_sliding_window' = True .*no sliding-window attention"),
    ("qwen3", {"layer_types": ["sliding_attention", "full_attention"]},
     "'config.json layer_types' = 'sliding_attention' .*'full_attention' per layer"),
    ("llama", {"mlp_bias": True}, "'config.json mlp_bias' = True .*no biases"),
    ("llama", {"rope_parameters": {"rope_type": "default", "foo": 2}}, "'config.json rope_parameters.foo' = 2"),
    ("qwen3_moe", {"mlp_only_layers": [0]}, "'config.json mlp_only_layers' = \\[0\\] .*MoE FFN in every layer"),
    ("qwen3_next", {"attention_dropout": 0.1}, "'config.json attention_dropout' = 0.1 .*no attention dropout"),
    ("release", {"attention_dropout": 0.1}, "'config.json attention_dropout' = 0.1 .*no attention dropout"),
])
def test_a_field_with_one_readable_value_is_refused_with_another(family, change, refused):
    hf = FAMILIES[family]
    with pytest.raises(ConfigError, match=refused):
        hf_config.model_config({**hf, **change}, hf_config.detect_layout(hf))


@pytest.mark.parametrize("variant", ["sdpa_elementwise", "sdpa_headwise"])
def test_the_tiny_presets_gated_runs_are_told_what_to_pass_to_export_loadable(variant):
    """Issue 62 item 5: the tiny preset has no QK-norm, and Qwen3-Next's attention (transformers'
    one layout with a G1 gate) always normalises q and k, so `--layout auto` refuses its gated runs.
    The line names the override that gives a run auto exports loadable as is, and the release
    layout; a run trained with that override is exported (headwise: by --layout qwen3_next)."""
    from gattn import cli

    cfg = cli.load("tiny", variant=variant).model
    assert cfg.gate is not None and not cfg.qk_norm
    with pytest.raises(ConfigError, match=r"'--layout' = 'auto' .*--layout release writes .*; or for a folder "
                                          r"transformers loads as is, train the run with --config.model.qk_norm=true "
                                          r".* and export that run with --layout qwen3_next$") as refused:
        hf_config.export_layout(cfg)
    assert "\n" not in str(refused.value)
    with_qk = cli.load("tiny", ["--config.model.qk_norm=true"], variant=variant).model
    layout = "auto" if variant == "sdpa_elementwise" else "qwen3_next"
    assert hf_config.export_layout(with_qk, layout) == "qwen3_next"


@pytest.mark.parametrize("layout", ("auto",) + hf_config.LAYOUTS)
def test_biases_on_q_k_and_v_alone_are_refused_at_export_in_one_line(layout, tmp_path, capsys):
    """model.qkv_bias (Qwen2.5's biases on W_Q, W_K, W_V, none on W_O) has no Hugging Face layout
    here: every layout's attention biases are on q, k, v and o (model.attention_bias), so to-hf
    refuses it before anything is written instead of dropping the biases; the same run without
    them is written as llama."""
    from gattn import cli
    from gattn.train import rundir

    cfg = cli.load("tiny", ["--config.model.qkv_bias=true"])
    with pytest.raises(ConfigError, match=r"^config field 'model.qkv_bias' = True is not allowed: False to export "
                                          r"[^\n]*q, k and v alone") as refused:
        hf_config.export_layout(cfg.model, layout)
    assert "\n" not in str(refused.value)
    assert hf_config.export_layout(cli.load("tiny").model) == "llama"
    (tmp_path / "run").mkdir()
    rundir.write_config(tmp_path / "run", cfg)
    capsys.readouterr()
    assert convert.main(["to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--layout", layout]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: config field 'model.qkv_bias' = True"), lines
    assert not (tmp_path / "hf").exists()
