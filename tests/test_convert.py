"""Hugging Face interop (gattn/interop/: convert.py, hf_config.py, weights.py): small random
transformers models, saved with save_pretrained, converted, and compared with gattn's forward pass
on the same tokens (float32).

The authors' release is not in transformers: `release_model` builds it from its documented layout
(their modeling_qwen3.py: q_proj widened per kv group, [queries of the group's heads | gates], the
sigmoid gate on the SDPA output before o_proj) by replacing each Qwen3 layer's attention forward.
"""

import json
import math
import types
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from gattn.data.tokenizer import read_tokenizer
from gattn.interop import convert, hf_config, weights
from gattn.train import rundir
from gattn.config import ConfigError
from gattn.interop.files import ConversionError

TOL = dict(rtol=2e-4, atol=2e-4)  # float32 logits of two implementations (values ~ 1-10)
DIMS = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6)
TOKENS = np.random.default_rng(0).integers(0, 320, size=(2, 24))


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A byte-level BPE tokenizer.json trained on a few lines (300 pieces, eos '<eos>')."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = ["def f(x):\n    return x + 1\n", "The attention gate is a sigmoid of the input.\n"] * 50
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


# Text the exported tokenizers must read as gattn's do: code, leading and repeated spaces, digits,
# Unicode beyond the training text (byte fallback), special tokens' text, nothing.
TEXTS = ["def f(x):\n    return x + 1\n", "  leading spaces", " x", "a  b   c\t\td", "12345 digits 3.14",
         "héllo wörld — ünïcode ✓ 日本語 🙂", "<s> and </s> as text", ""]


@pytest.fixture(scope="module")
def spm_file(tmp_path_factory):
    """A SentencePiece model trained as gattn trains its own (BPE, byte fallback; 300 pieces)."""
    import io

    from gattn.data import tokenizer

    lines = ["def f(x):", "    return x + 1", "The attention gate is a sigmoid of the input.", "  leading spaces",
             "12345 digits", "héllo wörld ünïcode"] * 40
    model = io.BytesIO()
    tokenizer._train_spm(iter(lines), model, 300)
    path = tmp_path_factory.mktemp("spm") / "spm.model"
    path.write_bytes(model.getvalue())
    return path


def assert_same_ids(out, gattn_tokenizer, bos=None):
    """AutoTokenizer loads folder `out` as it is and encodes (and decodes) TEXTS as `gattn_tokenizer` does."""
    tok = transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        ids = gattn_tokenizer.encode(text)
        assert tok(text, add_special_tokens=False)["input_ids"] == ids, text
        assert tok(text)["input_ids"] == ([] if bos is None else [bos]) + ids, text
        assert tok.decode(ids) == gattn_tokenizer.decode(ids), text
    return tok


def randomize(model, seed=0, norm_center=1.0):
    """Every weight random (norms around `norm_center`), so a misplaced tensor changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(norm_center + 0.2 * noise if "norm" in name else 0.1 * noise)
    return model.eval()


def save(model, path: Path, tokenizer_file, config_update=None):
    model.save_pretrained(path)
    (path / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    if config_update:
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(config_update)
        (path / "config.json").write_text(json.dumps(cfg))
    return path


def hf_logits(model, tokens=TOKENS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


def gattn_logits(workdir, tokens=TOKENS) -> np.ndarray:
    model = rundir.load(workdir).model
    return np.asarray(model(jnp.asarray(tokens)))


def release_forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
    """The authors' gated attention (eager), from their modeling_qwen3.py's documented layout."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb, repeat_kv

    b, s, _ = hidden_states.shape
    cfg, k = self.config, self.head_dim
    hk = cfg.num_key_value_heads
    groups = cfg.num_attention_heads // hk
    q = self.q_proj(hidden_states).view(b, s, hk, -1)
    q, gate = torch.split(q, [groups * k, q.shape[-1] - groups * k], dim=-1)
    gate = gate.reshape(b, s, hk * groups, -1)  # [.., heads, 1 (headwise) or head_dim]
    q = q.reshape(b, s, -1, k).transpose(1, 2)
    kk = self.k_proj(hidden_states).view(b, s, -1, k).transpose(1, 2)
    v = self.v_proj(hidden_states).view(b, s, -1, k).transpose(1, 2)
    if cfg.use_qk_norm:
        q, kk = self.q_norm(q), self.k_norm(kk)
    q, kk = apply_rotary_pos_emb(q, kk, *position_embeddings)
    kk, v = repeat_kv(kk, groups), repeat_kv(v, groups)
    scores = q @ kk.transpose(2, 3) / math.sqrt(k)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)
    if gate.shape[-1]:  # (the release's baseline has no gate rows)
        out = out * torch.sigmoid(gate)
    return self.o_proj(out.reshape(b, s, -1)), None


def release_model(gate: str, qk_norm=True, bias=False, tie=False):
    """A Qwen3 model re-laid out as the authors' release: (model, config.json additions)."""
    cfg = transformers.Qwen3Config(**DIMS, attention_bias=bias, tie_word_embeddings=tie, attn_implementation="eager")
    cfg.use_qk_norm = qk_norm
    model = transformers.Qwen3ForCausalLM(cfg)
    heads, k = DIMS["num_attention_heads"], DIMS["head_dim"]
    rows = heads * k + {"none": 0, "headwise": heads, "elementwise": heads * k}[gate]
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.q_proj = torch.nn.Linear(DIMS["hidden_size"], rows, bias=bias)
        if not qk_norm:
            del attn.q_norm, attn.k_norm
        attn.forward = types.MethodType(release_forward, attn)
    flags = {"model_type": "qwen2", "architectures": ["Qwen3ForCausalLM"], "use_qk_norm": qk_norm, "qkv_bias": bias,
             "headwise_attn_output_gate": gate == "headwise", "elementwise_attn_output_gate": gate == "elementwise"}
    return randomize(model), flags


def qwen3_next_model(partial=0.5, bias=False):
    cfg = transformers.Qwen3NextConfig(
        **DIMS, layer_types=["full_attention"] * 2, mlp_only_layers=[0, 1], num_experts=0, attention_bias=bias,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": partial},
        attn_implementation="eager")
    return randomize(transformers.Qwen3NextForCausalLM(cfg), norm_center=0.0)


@pytest.mark.parametrize("case", ["baseline", "headwise", "elementwise", "elementwise_bias_noqk"])
def test_release_layout_logits_match(case, tmp_path, tokenizer_file):
    gate = {"baseline": "none", "elementwise_bias_noqk": "elementwise"}.get(case, case)
    model, flags = release_model(gate, qk_norm=case != "elementwise_bias_noqk", bias=case == "elementwise_bias_noqk")
    src = save(model, tmp_path / "hf", tokenizer_file, flags)
    convert.from_hf(src, tmp_path / "run")
    np.testing.assert_allclose(gattn_logits(tmp_path / "run"), hf_logits(model), **TOL)
    run = json.loads((tmp_path / "run" / "config.json").read_text())
    assert run["variant"] == {"none": "baseline"}.get(gate, f"sdpa_{gate}")
    assert run["model"]["gate"] == (None if gate == "none" else {**run["model"]["gate"], "granularity": gate})


def test_release_pytorch_bin_files_convert(tmp_path, tokenizer_file):
    """The authors ship pytorch_model.bin: read with torch (weights_only)."""
    model, flags = release_model("headwise")
    src = save(model, tmp_path / "hf", tokenizer_file, flags)
    (src / "model.safetensors").unlink()
    torch.save(model.state_dict(), src / "pytorch_model.bin")
    convert.from_hf(src, tmp_path / "run")
    np.testing.assert_allclose(gattn_logits(tmp_path / "run"), hf_logits(model), **TOL)


@pytest.mark.parametrize("tie, yarn", [(False, False), (True, True)])
def test_qwen3_logits_match_and_export_back(tie, yarn, tmp_path, tokenizer_file):
    rope = {"rope_type": "default", "rope_theta": 1e6}
    if yarn:
        rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32}
    cfg = transformers.Qwen3Config(**DIMS, tie_word_embeddings=tie, rope_parameters=rope, attn_implementation="eager")
    model = randomize(transformers.Qwen3ForCausalLM(cfg))
    convert.from_hf(save(model, tmp_path / "hf", tokenizer_file), tmp_path / "run")
    run = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    assert run["rope_base"] == 1e6 and (run["yarn"] == {"factor": 4.0, "original_len": 32, "beta_fast": 32.0,
                                                        "beta_slow": 1.0, "attention_factor": None} if yarn
                                        else run["yarn"] is None)
    ours = gattn_logits(tmp_path / "run")
    np.testing.assert_allclose(ours, hf_logits(model), **TOL)
    # ...and back: transformers loads what to-hf writes and computes the same logits.
    convert.to_hf(tmp_path / "run", tmp_path / "back")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")
    np.testing.assert_allclose(hf_logits(again), ours, **TOL)
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == tokenizer_file.read_bytes()
    # The copied tokenizer loads as it is (not rebuilt as the model type's Qwen2Tokenizer), and its eos
    # is the model's.
    tok = read_tokenizer(tmp_path / "run" / "tokenizer" / "hf" / "tokenizer.json")
    assert_same_ids(tmp_path / "back", tok)
    assert again.generation_config.eos_token_id == again.config.eos_token_id == tok.eos_id() >= 0


def test_qwen3_next_logits_match_and_export_back(tmp_path, tokenizer_file):
    model = qwen3_next_model(partial=0.5)
    convert.from_hf(save(model, tmp_path / "hf", tokenizer_file), tmp_path / "run")
    run = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    assert run["rope_dim"] == 8 and run["qk_norm"] and run["gate"]["granularity"] == "elementwise"
    ours = gattn_logits(tmp_path / "run")
    np.testing.assert_allclose(ours, hf_logits(model), **TOL)
    convert.to_hf(tmp_path / "run", tmp_path / "back")  # auto: elementwise + QK-norm -> qwen3_next
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "qwen3_next"
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")
    np.testing.assert_allclose(hf_logits(again), ours, **TOL)


def test_llama_export_of_a_gattn_baseline_without_qk_norm(tmp_path, tokenizer_file):
    cfg = transformers.LlamaConfig(**DIMS, attention_bias=True, attn_implementation="eager")
    model = randomize(transformers.LlamaForCausalLM(cfg))
    convert.from_hf(save(model, tmp_path / "hf", tokenizer_file), tmp_path / "run")
    ours = gattn_logits(tmp_path / "run")
    np.testing.assert_allclose(ours, hf_logits(model), **TOL)
    convert.to_hf(tmp_path / "run", tmp_path / "back")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")
    np.testing.assert_allclose(hf_logits(again), ours, **TOL)


def _flat_params(workdir):
    from flax import nnx

    model = rundir.load(workdir).model
    return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("layout", ["release", "qwen3_next"])
def test_round_trip_gattn_hf_gattn_is_exact(layout, tmp_path, tokenizer_file):
    """A gattn run (elementwise gate, QK-norm, biases) -> HF (in shards) -> gattn: every parameter
    bitwise equal; through qwen3_next the norms come back as w = scale - 1 (model.zero_centered_norm),
    exact for scales in [0.5, 2]."""
    model, flags = release_model("elementwise", bias=layout == "release")
    convert.from_hf(save(model, tmp_path / "hf", tokenizer_file, flags), tmp_path / "a")
    convert.to_hf(tmp_path / "a", tmp_path / "hf2", layout=layout, max_shard_bytes=100_000)
    assert len(json.loads((tmp_path / "hf2" / "model.safetensors.index.json").read_text())["weight_map"]) > 10
    assert len(list((tmp_path / "hf2").glob("model-*.safetensors"))) > 1
    if layout == "qwen3_next":  # full rotary: partial_rotary_factor 1.0 is written (its default is 0.25)
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2", attn_implementation="eager")
        np.testing.assert_allclose(hf_logits(again), gattn_logits(tmp_path / "a"), **TOL)
    else:  # the release layout needs the authors' code: transformers' own Qwen3 must not take it
        with pytest.raises(ValueError, match="(?s)custom code.*trust_remote_code=True"):
            transformers.AutoConfig.from_pretrained(tmp_path / "hf2", trust_remote_code=False)
    convert.from_hf(tmp_path / "hf2", tmp_path / "b")
    a, b = _flat_params(tmp_path / "a"), _flat_params(tmp_path / "b")
    assert a.keys() == b.keys()
    for key in a:  # b reads Qwen3-Next's (1 + w) norms as model.zero_centered_norm: it stores w = scale - 1
        shift = 1.0 if layout == "qwen3_next" and ("norm" in str(key) or key[-1] == "scale") else 0.0
        np.testing.assert_array_equal(a[key] - np.float32(shift), b[key], err_msg=str(key))


def test_bad_folders_are_refused_and_nothing_is_written(tmp_path, tokenizer_file):
    model, flags = release_model("headwise")
    good = save(model, tmp_path / "hf", tokenizer_file, flags)
    convert.from_hf(good, tmp_path / "run")
    convert.to_hf(tmp_path / "run", tmp_path / "sharded", layout="release", max_shard_bytes=100_000)

    def refused(src, match, error=ConversionError):
        out = tmp_path / f"out_{len(list(tmp_path.iterdir()))}"
        with pytest.raises(error, match=match):
            convert.from_hf(src, out)
        assert not out.exists()

    # A missing shard names the shard and a tensor in it.
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]
    shard = sorted(set(index.values()))[-1]
    (tmp_path / "sharded" / shard).unlink()
    refused(tmp_path / "sharded", f"shard {shard} \\(holding tensor .*\\) is missing")
    # A mismatched shape names the tensor, its shape and the expected one.
    bad = tmp_path / "bad_shape"
    bad.mkdir()
    for f in good.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 80}))
    refused(bad, r"tensor model.layers.0.mlp.gate_proj.weight has shape \(96, 64\); config.json implies \(80, 64\)")
    # A gate flag that does not match q_proj: the widened q_proj has the wrong shape.
    (bad / "config.json").write_text(json.dumps({**cfg, "headwise_attn_output_gate": False,
                                                 "elementwise_attn_output_gate": True}))
    refused(bad, r"tensor model.layers.0.self_attn.q_proj.weight has shape \(68, 64\)")
    # An unknown architecture names the field and what is allowed.
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    refused(bad, "config.json architectures.*GPT2LMHeadModel.*Qwen3ForCausalLM", ConfigError)
    # Layers gattn does not have.
    nxt = json.loads(json.dumps({**cfg, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"}))
    for flag in hf_config.RELEASE_FLAGS:
        nxt.pop(flag)
    (bad / "config.json").write_text(json.dumps({**nxt, "layer_types": ["mamba", "full_attention"]}))
    refused(bad, "config.json layer_types' = 'mamba'", ConfigError)
    # A Gated DeltaNet layer that the tensors do not hold (an attention layer's tensors there).
    (bad / "config.json").write_text(json.dumps({**nxt, "layer_types": ["linear_attention", "full_attention"],
                                                 "num_experts": 0, "mlp_only_layers": [0, 1]}))
    refused(bad, r"tensor model.layers.0.self_attn.* is not part of the qwen3_next layout")
    (bad / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True}))
    refused(bad, "use_sliding_window", ConfigError)
    # An unexpected tensor (here: biases the config does not declare).
    biased, flags_b = release_model("headwise", bias=True)
    save(biased, tmp_path / "biased", tokenizer_file, {**flags_b, "qkv_bias": False})
    refused(tmp_path / "biased", r"tensor model.layers.0.self_attn.k_proj.bias is not part of the release layout")
    # No tokenizer.json; and an existing run is never overwritten.
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "tokenizer.json").unlink()
    refused(bad, "no tokenizer.json")
    with pytest.raises(ConversionError, match="is not empty"):
        convert.from_hf(good, tmp_path / "run")
    # to-hf: a tokenizer that is gone is found before any weight is written.
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    cfg["data"]["tokenizer"] = str(tmp_path / "gone.model")
    (tmp_path / "run" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="data.tokenizer"):
        convert.to_hf(tmp_path / "run", tmp_path / "export", layout="release")
    assert not (tmp_path / "export").exists() and not list(tmp_path.glob(".*partial"))


def test_export_refuses_what_no_layout_holds(tmp_path, tokenizer_file):
    from gattn.config import GateSpec, ModelConfig

    with pytest.raises(ConfigError, match="model.gate.*head-specific, input-dependent sigmoid"):
        hf_config.export_layout(ModelConfig(gate=GateSpec(position="value")))
    with pytest.raises(ConfigError, match="model.sandwich_norm"):
        hf_config.export_layout(ModelConfig(sandwich_norm=True))
    with pytest.raises(ConfigError, match="model.qk_norm.*qwen3_next"):
        hf_config.export_layout(ModelConfig(gate=GateSpec()), "qwen3_next")
    with pytest.raises(ConfigError, match="model.gate.*layout qwen3 holds no gate"):
        hf_config.export_layout(ModelConfig(gate=GateSpec(), qk_norm=True), "qwen3")
    assert hf_config.export_layout(ModelConfig(gate=GateSpec(granularity="headwise"), qk_norm=True),
                                   "release") == "release"
    assert hf_config.export_layout(ModelConfig(gate=GateSpec(), qk_norm=True)) == "qwen3_next"
    assert hf_config.export_layout(ModelConfig(qk_norm=False)) == "llama"


def test_eval_and_continued_training_on_a_converted_model(tmp_path, tokenizer_file):
    """eval.py measures a converted release model with its own tokenizer; train.py continues it
    (--config RUN/config.json --init-from RUN); resuming the converted directory itself is refused."""
    import subprocess
    import sys

    from gattn import cli
    from gattn.train import trainer

    model, flags = release_model("elementwise")
    src = save(model, tmp_path / "hf", tokenizer_file, flags)
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "gattn.convert", "from-hf", str(src), "--workdir", str(run)],
                         capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1])["layout"] == "release"
    again = subprocess.run([sys.executable, "-m", "gattn.convert", "from-hf", str(src), "--workdir", str(run)],
                           capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert again.returncode == 2 and "is not empty" in again.stderr
    small = ["--config.train.seq_len=64", "--config.data.eval_batches=1", "--config.data.eval_batch_size=2",
             "--config.data.code_max_bytes=200000"]
    out = subprocess.run([sys.executable, "eval.py", "--workdir", str(run), "--no-figures", *small],
                         capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads((run / "eval" / "results.json").read_text())
    assert res["variant"] == "sdpa_elementwise" and res["step"] == 0
    assert res["measured_on"]["rows"] > 0
    assert 0 < res["measurements"]["overall"]["gate_score"] < 1
    for domain, v in res["perplexity"].items():  # a random model: about uniform over 320 tokens
        assert 50 < v["ppl"] < 5000, (domain, v)

    cfg = cli.load(run / "config.json", [f"train.init_from={run}", "train.steps=2", "train.batch_size=2",
                                                "train.seq_len=64", "data.eval_batches=1", "data.eval_batch_size=2",
                                                "data.code_max_bytes=200000",
                                                "train.eval_every=2", "train.warmup_steps=1"])
    summary = trainer.train(cfg, tmp_path / "ft", progress=False)
    assert summary["completed"] and math.isfinite(summary["final_loss"])
    assert (tmp_path / "ft" / "tokenizer" / "hf" / "tokenizer.json").read_bytes() == tokenizer_file.read_bytes()
    with pytest.raises(ConfigError, match="converted from .*--init-from"):
        trainer.train(rundir.load_config(run, ["data.code_max_bytes=200000"]), run, progress=False)


def test_config_fields_are_read_as_transformers_5_reads_them():
    base = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
            "max_position_embeddings": 4096}
    cfg = hf_config.model_config(base, "qwen3")
    assert cfg.head_dim == 128 and cfg.rope_base == 10_000.0 and cfg.yarn is None  # Qwen3Config's defaults
    # v4's rope_scaling replaces rope_parameters whole (transformers: rope_scaling or rope_parameters).
    both = {**base, "rope_theta": 1e6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}}
    cfg = hf_config.model_config(both, "qwen3")
    assert cfg.rope_base == 1e6 and (cfg.yarn.factor, cfg.yarn.original_len) == (4.0, 1024)
    # A top-level original_max_position_embeddings wins; a missing factor is max / original.
    top = {**base, "original_max_position_embeddings": 512,
           "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "original_max_position_embeddings": 1024}}
    yarn = hf_config.model_config(top, "qwen3").yarn
    assert (yarn.original_len, yarn.factor) == (512, 8.0)
    # Parameters nested per layer type (full attention only).
    nested = {**base, "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e5}}}
    assert hf_config.model_config(nested, "qwen3").rope_base == 5e5
    # Qwen3-Next: head_dim 256 and a quarter of it rotating unless config.json says otherwise.
    nxt = {**base, "architectures": ["Qwen3NextForCausalLM"], "layer_types": ["full_attention"] * 2,
           "mlp_only_layers": [0, 1]}
    cfg = hf_config.model_config(nxt, "qwen3_next")
    assert (cfg.head_dim, cfg.rope_dim) == (256, 64)
    for field, value, match in [("rope_scaling", {"rope_type": "linear", "factor": 2.0}, "rope_type"),
                                ("hidden_act", "gelu", "hidden_act.*gelu_pytorch_tanh"),
                                ("mlp_bias", True, "mlp_bias")]:
        with pytest.raises(ConfigError, match=match):
            hf_config.model_config({**base, field: value}, "qwen3")


def _tied_config_untied_head(path, tokenizer_file):
    cfg = transformers.Qwen3Config(**DIMS, tie_word_embeddings=False, attn_implementation="eager")
    model = randomize(transformers.Qwen3ForCausalLM(cfg))
    return model, save(model, path, tokenizer_file, {"tie_word_embeddings": True})


def test_a_tied_config_with_a_different_stored_head_keeps_the_head(tmp_path, tokenizer_file, capsys):
    """config.json says tie_word_embeddings, but lm_head.weight differs from the embedding:
    transformers keeps the stored head, so gattn does too, naming the tensor."""
    model, src = _tied_config_untied_head(tmp_path / "hf", tokenizer_file)
    _, _, cfg, tensors = convert.read_hf(src)
    assert "tensor lm_head.weight differs from model.embed_tokens.weight" in capsys.readouterr().err
    assert cfg.tie_embeddings is False
    np.testing.assert_array_equal(tensors["lm_head.weight"], model.lm_head.weight.detach().numpy())
    assert ("lm_head",) in weights.to_gattn(tensors, cfg, "qwen3")


@pytest.mark.slow
def test_a_kept_untied_head_gives_transformers_logits(tmp_path, tokenizer_file, capsys):
    _, src = _tied_config_untied_head(tmp_path / "hf", tokenizer_file)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager")
    convert.from_hf(src, tmp_path / "run")
    assert "tensor lm_head.weight differs from model.embed_tokens.weight" in capsys.readouterr().err
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"]["tie_embeddings"] is False
    np.testing.assert_allclose(gattn_logits(tmp_path / "run"), hf_logits(theirs), **TOL)


@pytest.mark.parametrize("size", ["0", "-1", "nan"])
def test_a_shard_size_that_is_not_a_positive_size_is_one_line(tmp_path, capsys, size):
    """(Before: 0 and -1 wrote one safetensors file per tensor; nan raised a ValueError.) Refused
    before the run is read (this one does not exist)."""
    assert convert.main(["to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "out"), "--max-shard-gb", size]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'--max-shard-gb'" in err and "above 0" in err and not (tmp_path / "out").exists()


def test_bad_json_and_a_hugging_face_folder_given_to_to_hf_are_one_line(tmp_path, tokenizer_file, capsys):
    cfg = transformers.Qwen3Config(**DIMS, attn_implementation="eager")
    src = save(transformers.Qwen3ForCausalLM(cfg), tmp_path / "hf", tokenizer_file)
    capsys.readouterr()  # (save_pretrained's progress bar)
    assert convert.main(["to-hf", str(src), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a gattn run but a Hugging Face model folder" in err
    (src / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"],\n "vocab_size": 320,,}')
    assert convert.main(["from-hf", str(src), "--workdir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.json: not valid JSON (Expecting property name" in err
    assert "at line 2 column 20" in err and not (tmp_path / "run").exists()
    (src / "config.json").write_text("[1, 2]")
    with pytest.raises(ConversionError, match=r"config.json: expected a JSON object, not a list"):
        convert.read_hf(src)


def test_a_sentencepiece_run_exports_a_folder_transformers_loads_as_is(tmp_path, tokenizer_file, spm_file):
    """A run with gattn's own tokenizer (a SentencePiece model; data.bos) -> to-hf: AutoTokenizer and
    AutoModelForCausalLM load the folder as it is, read text as gattn does, compute gattn's logits and
    generate; config.json and generation_config.json name the tokenizer's special ids."""
    cfg = transformers.LlamaConfig(**DIMS, attn_implementation="eager")
    convert.from_hf(save(randomize(transformers.LlamaForCausalLM(cfg)), tmp_path / "hf", tokenizer_file),
                    tmp_path / "run")
    run = json.loads((tmp_path / "run" / "config.json").read_text())
    run["data"].update(tokenizer=str(spm_file), bos=True)
    (tmp_path / "run" / "config.json").write_text(json.dumps(run))
    out = convert.to_hf(tmp_path / "run", tmp_path / "out")
    assert {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "generation_config.json"} <= {
        p.name for p in out.iterdir()}
    sp = read_tokenizer(spm_file)
    tok = assert_same_ids(out, sp, bos=sp.bos_id())
    model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    special = (sp.bos_id(), sp.eos_id(), sp.pad_id())
    for c in (model.config, model.generation_config):
        assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == special
    prompt = torch.tensor([tok(text)["input_ids"][:6] for text in (TEXTS[0], TEXTS[5])])
    with torch.no_grad():  # to TOKENS' length: gattn's forward reuses what the other tests compiled
        generated = model.generate(prompt, max_new_tokens=TOKENS.shape[1] - 6, do_sample=False)
    assert generated.shape == TOKENS.shape
    ours = gattn_logits(tmp_path / "run", generated.numpy())
    np.testing.assert_allclose(hf_logits(model, generated), ours, **TOL)
    for row, greedy in zip(generated[:, 6:].numpy(), ours[:, 5:-1].argmax(-1)):  # gattn's picks, to EOS; then pad
        n = list(row).index(sp.eos_id()) + 1 if sp.eos_id() in row else len(row)
        np.testing.assert_array_equal(row[:n], greedy[:n])
        assert (row[n:] == sp.pad_id()).all()


def test_a_backcopy_run_exports_its_character_vocabulary():
    """The Bigram-Backcopy task's characters, each a token, with <s> opening every sequence."""
    import tempfile

    from gattn.config import Config, DataConfig
    from gattn.data import backcopy

    cfg = Config(data=DataConfig(source="bigram_backcopy"))
    ours = backcopy.Tokenizer(" etaoin\nsh<>/")  # (the task's are the docs' most frequent characters)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "backcopy.json").write_text(ours.to_json())
        files = convert.export_tokenizer(cfg, Path(d) / "backcopy.json", 64)
        for name, data in files.items():
            (Path(d) / name).write_bytes(data)
        (Path(d) / "config.json").write_text(json.dumps({"model_type": "llama"}))
        tok = transformers.AutoTokenizer.from_pretrained(d)
    text = "the <s> note\u2603 </s>"  # (a character it lacks is dropped)
    assert tok(text)["input_ids"] == [backcopy.START] + ours.encode(text)
    assert convert.special_token_ids(files)["bos_token_id"] == backcopy.START


def test_a_headwise_run_has_no_auto_layout_and_loads_as_qwen3_next(tmp_path, tokenizer_file, capsys):
    """auto never writes the release layout (transformers cannot load it without the release's
    code): it refuses in one line naming the explicit layouts. qwen3_next holds a headwise gate
    repeated over each head's dims, and transformers computes gattn's logits from it."""
    model, flags = release_model("headwise")
    convert.from_hf(save(model, tmp_path / "hf", tokenizer_file, flags), tmp_path / "run")
    capsys.readouterr()
    assert convert.main(["to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "auto")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'--layout' = 'auto'" in err and "headwise" in err
    assert "--layout qwen3_next writes it loadable as is" in err and "--layout release writes" in err
    assert not (tmp_path / "auto").exists()
    convert.to_hf(tmp_path / "run", tmp_path / "next", layout="qwen3_next")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "next", attn_implementation="eager")
    np.testing.assert_allclose(hf_logits(again), gattn_logits(tmp_path / "run"), **TOL)


def test_layout_refusals_name_the_field_and_a_layout_that_holds_the_run():
    from gattn.config import GateSpec, ModelConfig, SwitchHeadsSpec

    elementwise, headwise = GateSpec(), GateSpec(granularity="headwise")
    cases = [  # (model, --layout, what the one line says)
        (ModelConfig(gate=elementwise), "qwen3_next", r"'model.qk_norm' = False .*True for layout qwen3_next "
         r"\(Qwen3-Next normalises q and k\); --layout release writes .*own modeling code"),
        (ModelConfig(gate=elementwise), "auto", r"'--layout' = 'auto' .*qwen3_next needs model.qk_norm=True.*"
         r"--layout release writes"),
        (ModelConfig(gate=headwise), "auto", r"this run's is headwise\): --layout release writes"),
        (ModelConfig(), "qwen3", r"'model.qk_norm' = False .*Qwen3 normalises q and k\); --layout llama \(what auto"),
        (ModelConfig(qk_norm=True), "llama", r"'model.qk_norm' = True .*Llama has no QK-norm\); --layout qwen3 "),
        (ModelConfig(), "qwen3_next", r"'model.gate' = None .*layout qwen3_next holds a G1 gate.*--layout llama"),
        (ModelConfig(gate=elementwise, qk_norm=True), "llama", r"layout llama holds no gate; --layout qwen3_next"),
        (ModelConfig(rope_dim=16, qk_norm=True), "qwen3", r"'model.rope_dim' = 16 .*only qwen3_next"),
        (ModelConfig(switch_heads=SwitchHeadsSpec()), "auto",
         r"'model.switch_heads' .*no layout has switch-head attention")]
    for cfg, layout, match in cases:
        with pytest.raises(ConfigError, match=match):
            hf_config.export_layout(cfg, layout)


@pytest.mark.parametrize("renormalize", [False, True])
def test_qwen3_moe_logits_match_and_round_trip_exactly(renormalize, tmp_path, tokenizer_file):
    """Issue 31: Qwen3-MoE in and out. The router, the per-expert SwiGLUs and norm_topk_prob land on
    gattn's MoE (dropless, softmax top-k) with transformers' logits; to-hf writes the per-expert
    tensors back, and every parameter survives gattn -> HF -> gattn bitwise."""
    dims = {**DIMS, "intermediate_size": 96}
    cfg = transformers.Qwen3MoeConfig(**dims, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                      norm_topk_prob=renormalize, attn_implementation="eager")
    model = randomize(transformers.Qwen3MoeForCausalLM(cfg))
    convert.from_hf(save(model, tmp_path / "hf", tokenizer_file), tmp_path / "run")
    moe = json.loads((tmp_path / "run" / "config.json").read_text())["model"]["moe"]
    assert (moe["num_experts"], moe["top_k"], moe["expert_width"], moe["renormalize"]) == (4, 2, 24, renormalize)
    assert moe["capacity_factor"] is None  # dropless, as transformers computes it
    ours = gattn_logits(tmp_path / "run")
    np.testing.assert_allclose(ours, hf_logits(model), **TOL)
    convert.to_hf(tmp_path / "run", tmp_path / "back")  # auto: an ungated MoE with QK-norm -> qwen3_moe
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "qwen3_moe"
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")
    np.testing.assert_allclose(hf_logits(again), ours, **TOL)
    convert.from_hf(tmp_path / "back", tmp_path / "run2")
    a, b = _flat_params(tmp_path / "run"), _flat_params(tmp_path / "run2")
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=str(key))


def test_moe_layouts_refuse_what_they_cannot_hold():
    from gattn.config import GateSpec, ModelConfig, MoESpec

    moe = MoESpec(num_experts=4, top_k=2, expert_width=8)
    assert hf_config.export_layout(ModelConfig(moe=moe, qk_norm=True)) == "qwen3_moe"
    with pytest.raises(ConfigError) as e:  # the paper's gated MoE: no layout has both
        hf_config.export_layout(ModelConfig(moe=moe, qk_norm=True, gate=GateSpec()))
    assert e.value.field == "--layout" and "shared expert" in e.value.allowed
    with pytest.raises(ConfigError, match="model.moe.*None for layout qwen3"):
        hf_config.export_layout(ModelConfig(moe=moe, qk_norm=True), "qwen3")
    with pytest.raises(ConfigError, match="model.moe.*an MoE for layout qwen3_moe"):
        hf_config.export_layout(ModelConfig(qk_norm=True), "qwen3_moe")
    hf = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
          "num_hidden_layers": 4, "vocab_size": 320, "intermediate_size": 96, "moe_intermediate_size": 24,
          "num_experts": 4, "num_experts_per_tok": 2}
    with pytest.raises(ConfigError, match="mlp_only_layers.*every"):
        hf_config.model_config({**hf, "mlp_only_layers": [0]}, "qwen3_moe")
    with pytest.raises(ConfigError, match="decoder_sparse_step"):
        hf_config.model_config({**hf, "decoder_sparse_step": 2}, "qwen3_moe")
    assert hf_config.model_config(hf, "qwen3_moe").moe.renormalize is False  # transformers' default
