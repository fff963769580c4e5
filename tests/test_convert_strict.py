"""Issue 57 (items 3 and 9): what from-hf and to-hf refuse, keep and say. Qwen3-Next's config.json
is read as strictly as Qwen3.5's (every field mapped, known to change nothing on text, or refused in
one line); a Gated DeltaNet whose conv transformers runs with another activation than gattn's SiLU
is refused both ways; a tied multimodal Qwen3.5 converts tied; a round trip keeps the fields the
model does not determine; a declared MTP layer without its tensors is said; a broken tokenizer.json
is named. Tiny random transformers 5.24 models, built here."""

import contextlib
import io
import json
import shutil

import numpy as np
import pytest
import torch
import transformers

from gattn.config import Config, ConfigError, GateSpec, ModelConfig
from gattn.interop import convert, fields, hf_config, qwen3_5
from gattn.train import rundir
from test_convert import DIMS, gattn_logits, hf_logits, randomize, save, tokenizer_file  # noqa: F401 (a fixture)
from test_convert_qwen35 import TEXT, VISION
from test_hybrid import tiny_hybrid

TOL = dict(rtol=2e-4, atol=2e-4)
ACTS = ["relu", "gelu_pytorch_tanh"]


def qwen3_next_model(hidden_act: str, layer_types: list[str]):
    """A tiny dense Qwen3-Next (no MoE) of `layer_types` whose config says `hidden_act`."""
    cfg = transformers.Qwen3NextConfig(
        **DIMS, layer_types=layer_types, mlp_only_layers=list(range(2)), num_experts=0, hidden_act=hidden_act,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
        attn_implementation="eager")
    return randomize(transformers.Qwen3NextForCausalLM(cfg), norm_center=0.0)


def with_remembering_gdn(model, seed=1):
    """`model` with GDN decay rates A from 0.02 to 4 and its gated norms around 1 (they scale by w,
    not 1 + w), as test_convert_qwen35.qwen35_model sets them, so the GDN layers carry signal."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("linear_attn"):
                module.A_log.copy_(torch.log(0.02 + 4 * torch.rand(module.A_log.shape, generator=g)))
                module.norm.weight.copy_(1.0 + 0.2 * torch.randn(module.norm.weight.shape, generator=g))
    return model


def one_line_error(argv, capsys) -> str:
    """What `python -m gattn.convert ARGV` prints when it refuses: exit 2 and one error line (after
    any warning or note lines), no traceback."""
    capsys.readouterr()
    assert convert.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: ") and all(line.startswith(("warning: ", "note: ")) for line in lines[:-1])
    return lines[-1]


# --------------------------------------------------------------------------- item 3: the GDN conv's activation


@pytest.mark.parametrize("act", ACTS)
def test_a_gated_deltanet_with_another_hidden_act_is_refused(act, tmp_path, tokenizer_file, capsys):  # noqa: F811
    """transformers runs the GDN's causal conv with hidden_act; gattn's conv is SiLU: refused in
    one line naming the field, and nothing is written."""
    src = save(qwen3_next_model(act, ["linear_attention", "full_attention"]), tmp_path / "hf", tokenizer_file)
    err = one_line_error(["from-hf", str(src), "--workdir", str(tmp_path / "run")], capsys)
    assert f"'config.json hidden_act' = '{act}' is not allowed: 'silu'" in err and "causal conv" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("act", ACTS)
def test_without_gated_deltanet_layers_hidden_act_is_the_mlps_and_converts(act, tmp_path, tokenizer_file):  # noqa: F811
    """The refusal is the GDN's: a Qwen3-Next of attention layers only applies hidden_act in its
    MLP alone, which gattn computes (relu, and gelu as the tanh approximation)."""
    model = qwen3_next_model(act, ["full_attention"] * 2)
    convert.from_hf(save(model, tmp_path / "hf", tokenizer_file), tmp_path / "run")
    assert rundir.read_config(tmp_path / "run").model.ffn_activation == fields.ACTIVATIONS[act]
    np.testing.assert_allclose(gattn_logits(tmp_path / "run"), hf_logits(model), **TOL)


def test_to_hf_refuses_a_gated_deltanet_model_whose_ffn_is_not_silu(tmp_path, capsys):
    """The export cannot say 'relu MLP, SiLU conv' either: Qwen3-Next's and Qwen3.5's hidden_act is
    both. A model without GDN layers keeps its activation in qwen3_next (Qwen3.5's from-hf reads
    hidden_act 'silu' only, so qwen3_5 refuses it too)."""
    relu = tiny_hybrid(ffn_activation="relu")
    for layout in ("auto", "qwen3_next", "qwen3_5"):
        with pytest.raises(ConfigError, match="'model.ffn_activation' = 'relu' is not allowed: 'silu' .*causal conv"):
            hf_config.export_layout(relu, layout)
    attention_only = ModelConfig(gate=GateSpec(), qk_norm=True, ffn_activation="relu")
    assert hf_config.export_layout(attention_only) == "qwen3_next"
    with pytest.raises(ConfigError, match="'model.ffn_activation' = 'relu' .*layout qwen3_5"):
        hf_config.export_layout(attention_only, "qwen3_5")
    (tmp_path / "run").mkdir()
    rundir.write_config(tmp_path / "run", Config(model=relu))  # refused before any checkpoint is read
    err = one_line_error(["to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "out")], capsys)
    assert "model.ffn_activation" in err and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- item 3: as strict as Qwen3.5

NEXT = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 320, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "mlp_only_layers": [0, 1, 2, 3], "num_experts": 0, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        "attention_dropout": 0.0, "hidden_act": "silu", "transformers_version": "5.24.0", "dtype": "float32",
        "full_attention_interval": 4, "num_nextn_predict_layers": 1}


@pytest.mark.parametrize("change, match", [
    ({"quantization_config": {"bits": 4}}, "'config.json quantization_config' = .*float weights .* only; dequantize"),
    ({"foo": 1}, "'config.json foo' = 1 .*not one of the fields of Qwen3-Next"),
    ({"rope_parameters": {**NEXT["rope_parameters"], "foo": 2}}, "'config.json rope_parameters.foo' = 2"),
    ({"rope_parameters": {**NEXT["rope_parameters"], "mrope_section": [1, 1, 2]}}, "rope_parameters.mrope_section"),
    ({"attention_dropout": 0.1}, "'config.json attention_dropout' = 0.1 .*no attention dropout"),
    ({"hidden_act": "relu"}, "'config.json hidden_act' = 'relu' .*'silu'"),
    ({"hidden_act": "gelu"}, "'config.json hidden_act' = 'gelu'"),
    ({"full_attention_interval": 0}, "'config.json full_attention_interval' = 0 .*an integer >= 1"),
])
def test_qwen3_next_config_is_read_as_strictly_as_qwen3_5s(change, match):
    assert hf_config.model_config(NEXT, "qwen3_next").layer_types == ("linear_attention",) * 3 + ("full_attention",)
    with pytest.raises(ConfigError, match=match):
        hf_config.model_config({**NEXT, **change}, "qwen3_next")


def test_full_attention_interval_zero_is_one_line_for_qwen3_5_too():
    text = {k: v for k, v in TEXT.items() if k != "layer_types"}
    assert hf_config.model_config({**text, "model_type": "qwen3_5_text"}, "qwen3_5").layer_types is not None
    for interval in (0, -4, 1.5):
        with pytest.raises(ConfigError, match=f"'config.json full_attention_interval' = {interval} .*integer >= 1"):
            hf_config.model_config({**text, "model_type": "qwen3_5_text", "full_attention_interval": interval},
                                   "qwen3_5")


# --------------------------------------------------------------------------- item 9 (a): a tied multimodal folder


def test_a_tied_multimodal_qwen3_5_converts_tied_with_transformers_logits(tmp_path, tokenizer_file):  # noqa: F811
    """save_pretrained of a tied Qwen3_5ForConditionalGeneration writes tie_word_embeddings true
    outside and false in text_config (the text config's default); transformers follows the outer
    one, and so does gattn."""
    model = with_remembering_gdn(randomize(transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=TEXT, vision_config=VISION, tie_word_embeddings=True)),
        norm_center=0.0))
    src = save(model, tmp_path / "hf", tokenizer_file)
    written = json.loads((src / "config.json").read_text())
    assert (written["tie_word_embeddings"], written["text_config"]["tie_word_embeddings"]) == (True, False)
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    convert.from_hf(src, tmp_path / "run")
    assert rundir.read_config(tmp_path / "run").model.tie_embeddings
    np.testing.assert_allclose(gattn_logits(tmp_path / "run"), hf_logits(model), **TOL)


# --------------------------------------------------------------------------- item 9 (b, c, e): one converted folder


@pytest.fixture(scope="module")
def released_like(tmp_path_factory, tokenizer_file):  # noqa: F811
    """A dense Qwen3.5 folder as transformers saves a released one: max_position_embeddings
    262,144, its own mrope_section, an MTP layer declared but no mtp.* tensors (transformers
    neither loads nor saves them). (folder, run, what from-hf printed)."""
    tmp = tmp_path_factory.mktemp("released")
    text = {**TEXT, "max_position_embeddings": 262_144,
            "rope_parameters": {**TEXT["rope_parameters"], "mrope_section": [4, 2, 2]}}
    model = randomize(transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text)), norm_center=0.0)
    src = save(model, tmp / "hf", tokenizer_file, {"mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False})
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        convert.from_hf(src, tmp / "run")
    return src, tmp / "run", err.getvalue()


def test_a_round_trip_keeps_max_position_embeddings_and_mrope_section(released_like, tmp_path):
    src, run, _ = released_like
    convert.to_hf(run, tmp_path / "back")
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["max_position_embeddings"] == 262_144
    assert back["rope_parameters"]["mrope_section"] == [4, 2, 2]
    # A gattn-native run: the length it was trained at, and the multimodal section split in thirds.
    native = hf_config.hf_config(tiny_hybrid(rope_dim=4), "qwen3_5", 2048)
    assert native["max_position_embeddings"] == 2048 and native["rope_parameters"]["mrope_section"] == [1, 1, 0]
    assert qwen3_5.mrope_section(64) == [11, 11, 10]


def test_a_declared_mtp_layer_without_its_tensors_is_said_in_one_line(released_like):
    src, run, printed = released_like
    lines = [line for line in printed.splitlines() if "mtp" in line.lower()]
    assert lines == [f"warning: {src / 'config.json'} declares an MTP layer (mtp_num_hidden_layers = 1) but the "
                     "folder holds no mtp.* tensors (transformers neither loads nor saves them): the run has no MTP "
                     "layer (model.mtp_layers = 0); the main model converts exactly, and MTP training or "
                     "speculative decoding need a folder with the released mtp.* tensors"]
    assert rundir.read_config(run).model.mtp_layers == 0


@pytest.mark.parametrize("broken", ['{"version": "1.0", "model": {"type": "BPE"}}', "not json at all"])
def test_a_broken_tokenizer_json_is_refused_naming_the_file(broken, released_like, tmp_path, capsys):
    src, run, _ = released_like
    bad = tmp_path / "hf"
    shutil.copytree(src, bad)
    (bad / "tokenizer.json").write_text(broken)
    err = one_line_error(["from-hf", str(bad), "--workdir", str(tmp_path / "run")], capsys)
    assert err.startswith(f"error: {bad / 'tokenizer.json'}: the tokenizers library cannot load it")
    assert not (tmp_path / "run").exists()
    # to-hf reads the run's tokenizer the same way, before it writes anything.
    copy = tmp_path / "run_copy"
    shutil.copytree(run, copy)
    tok = copy / "tokenizer" / "hf" / "tokenizer.json"
    tok.write_text(broken)
    err = one_line_error(["to-hf", str(copy), "--out", str(tmp_path / "out")], capsys)
    assert err.startswith(f"error: {tok}: the tokenizers library cannot load it")
    assert not (tmp_path / "out").exists()
