"""Issue 31: the Qwen3-Next hybrid as a gattn model (model.layer_types, model.linear_attention,
the shared expert, zero-centred norms), checked against transformers' Qwen3NextForCausalLM built
here with a random tiny config: 3 Gated DeltaNet layers : 1 gated attention layer, an MoE with a
shared expert in every layer, partial RoPE. The GDN layer alone is tests/test_gdn.py."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from gattn.config import (Config, ConfigError, ExecConfig, GateSpec, LinearAttentionSpec, ModelConfig, MoESpec,
                          hybrid_layer_types)
from gattn.eval import decode
from gattn.interop import convert, hf_config
from gattn.model.transformer import Transformer
from gattn.train import rundir
from test_convert import _flat_params, randomize, save, tokenizer_file  # noqa: F401 (a fixture)

TOL = dict(rtol=1e-4, atol=1e-4)
# The test's own programs compiled without LLVM's optimisation passes (XLA's CPU backend at -O0):
# the same operations, a third to two fifths less compile time for programs run once on a few tokens.
UNOPTIMIZED = {"xla_backend_optimization_level": 0}
# 80 tokens: GDN's chunk (64 in transformers and here) is crossed, so the carried state is checked.
TOKENS = np.random.default_rng(1).integers(0, 320, size=(2, 80))


def hybrid_hf_model(seed=0):
    cfg = transformers.Qwen3NextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
        layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=32, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], attn_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25})
    model = randomize(transformers.Qwen3NextForCausalLM(cfg), seed=seed, norm_center=0.0)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers[:3]:
            gdn = layer.linear_attn
            # decay rates A from 0.02 to 4: some heads remember across the chunk boundary
            gdn.A_log.copy_(torch.log(0.02 + 4 * torch.rand(gdn.A_log.shape, generator=g)))
            gdn.norm.weight.copy_(1.0 + 0.2 * torch.randn(gdn.norm.weight.shape, generator=g))  # not (1 + w)
    return model


def hf_logits(model, tokens=TOKENS):
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tokenizer_file):  # noqa: F811
    tmp = tmp_path_factory.mktemp("hybrid")
    model = hybrid_hf_model()
    convert.from_hf(save(model, tmp / "hf", tokenizer_file), tmp / "run")
    return model, tmp


@pytest.fixture(scope="module")
def loaded(converted):
    """The converted run as gattn loads it (rundir.load, ~2 s: once for the tests that only read it)."""
    return rundir.load(converted[1] / "run").model


@pytest.fixture(scope="module")
def run_params(loaded):
    """The converted run's parameters, {path: array} (test_convert._flat_params of the run)."""
    return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(loaded, nnx.Param))}


def test_qwen3_next_hybrid_logits_match_transformers(converted, loaded):
    model, tmp = converted
    run = json.loads((tmp / "run" / "config.json").read_text())["model"]
    assert run["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert run["linear_attention"] == {"num_k_heads": 2, "num_v_heads": 4, "head_k_dim": 16, "head_v_dim": 8,
                                       "conv_kernel": 4}
    assert run["moe"]["shared_expert_width"] == 32 and run["moe"]["renormalize"] and run["zero_centered_norm"]
    assert run["rope_dim"] == 4 and run["gate"]["granularity"] == "elementwise"
    graphdef, state = nnx.split(loaded)
    ours = np.asarray(jax.jit(lambda st, t: nnx.merge(graphdef, st)(t), compiler_options=UNOPTIMIZED)(
        state, jnp.asarray(TOKENS)))
    theirs = hf_logits(model)
    assert np.abs(theirs).max() > 0.5  # (logits that carry signal)
    np.testing.assert_allclose(ours, theirs, **TOL)


def test_qwen3_next_hybrid_round_trip_is_bit_identical(converted, run_params, tmp_path):
    """HF -> gattn -> HF gives the same tensors bit for bit (the (1 + w) norms are stored as w), and
    transformers loads the export with the same logits; gattn -> HF -> gattn too."""
    from safetensors.numpy import load_file

    model, tmp = converted
    convert.to_hf(tmp / "run", tmp_path / "back")  # auto: GDN layers and a shared expert -> qwen3_next
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "qwen3_next"
    original = {k: v.numpy() for k, v in model.state_dict().items()}
    back = load_file(tmp_path / "back" / "model.safetensors")
    # transformers keeps the experts fused in memory (gate_up_proj) and saves them per expert: compare files
    saved = load_file(tmp / "hf" / "model.safetensors")
    assert saved.keys() == back.keys() and len(saved) > 60
    for name in saved:
        np.testing.assert_array_equal(saved[name], back[name], err_msg=name)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")
    np.testing.assert_array_equal(hf_logits(again), hf_logits(model))
    assert any("linear_attn" in k for k in original)
    convert.from_hf(tmp_path / "back", tmp_path / "run2")
    a, b = run_params, _flat_params(tmp_path / "run2")
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=str(key))


def test_cached_greedy_decoding_gives_transformers_tokens(converted, loaded):
    """Two prompts in one batch (left padding), prefilled 16 tokens at a time (the short prompt's
    first chunks are all padding: its state must stay empty), then recurrent steps: each row
    decodes what transformers' generate decodes for it alone."""
    model, tmp = converted
    prompts = [TOKENS[0, :70].tolist(), TOKENS[1, :9].tolist()]  # the long one crosses the 64-token chunk
    theirs = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.as_tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
        theirs.append(out[0, len(prompt):].tolist())
    ours = decode.generate(loaded, prompts, max_new_tokens=10, prefill_chunk=16,
                           max_len=96)  # (room for 5 whole pieces of 16: one prefill compile)
    assert ours == theirs
    # The same checkpoint loaded with scanned layers (stacked groups of the 3:1 pattern) decodes
    # layer by layer from its sliced groups, to the same tokens.
    scanned = rundir.load(tmp / "run", overrides=["exec.scan_layers=true"]).model
    assert scanned.grouped and scanned.blocks.layers[0].linear_attn.a_log.shape[0] == 1
    assert decode.generate(scanned, prompts, max_new_tokens=10, prefill_chunk=16, max_len=96) == theirs


def tiny_hybrid(**kw) -> ModelConfig:
    fields = dict(vocab_size=64, d_model=32, num_layers=4, q_heads=4, kv_heads=2, head_dim=8, d_ff=64, qk_norm=True,
                  zero_centered_norm=True, gate=GateSpec(), layer_types=hybrid_layer_types(4),
                  linear_attention=LinearAttentionSpec(2, 4, 8, 8, 4))
    return ModelConfig(**{**fields, **kw})


def test_a_packed_row_equals_its_documents_run_separately():
    """Segment ids reset the GDN state and conv at each document start, and attention is per
    document: a packed row computes what its documents compute alone. One batch (one compile):
    the packed row, each document alone (padding after it), and the packed row without
    document boundaries (the documents leak)."""
    model = Transformer(tiny_hybrid(moe=MoESpec(num_experts=4, top_k=2, expert_width=16, shared_expert_width=8)),
                        ExecConfig(gdn_chunk=8), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    lengths, s = (11, 5, 14), 32  # 30 tokens and 2 of padding; chunks of 8 cut every document
    docs = [rng.integers(0, 64, n) for n in lengths]
    tokens, segments, positions = (np.zeros((5, s), np.int32) for _ in range(3))
    tokens[0, :30] = tokens[4, :30] = np.concatenate(docs)
    segments[0, :30] = np.repeat([1, 2, 3], lengths)
    segments[4, :30] = 1
    positions[0, :30] = positions[4, :30] = np.concatenate([np.arange(n) for n in lengths])
    for row, d in enumerate(docs, start=1):
        tokens[row, :len(d)], segments[row, :len(d)], positions[row, :len(d)] = d, 1, np.arange(len(d))
    graphdef, state = nnx.split(model)
    logits = np.asarray(jax.jit(lambda st, *a: nnx.merge(graphdef, st)(*a), compiler_options=UNOPTIMIZED)(
        state, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments)))
    start = 0
    for row, n in enumerate(lengths, start=1):
        np.testing.assert_allclose(logits[0, start:start + n], logits[row, :n], rtol=1e-6, atol=1e-6)
        start += n
    assert np.abs(logits[4, 11:16] - logits[0, 11:16]).max() > 1e-3


def test_a_scanned_hybrid_runs_its_layer_pattern_as_one_scan_over_groups():
    """exec.scan_layers on a hybrid stacks the layers in groups of the repeating pattern
    (3 Gated DeltaNet + 1 attention: 8 layers are 2 groups of 4) and scans over the groups: the
    logits, the MoE's per-layer aux values and every gradient are the layer loop's, remat or not;
    the layouts convert both ways bit for bit, and the jaxpr holds one scan over 2 groups."""
    from gattn.model.transformer import relayout, unscanned, with_exec  # noqa: PLC0415

    cfg = tiny_hybrid(num_layers=8, layer_types=hybrid_layer_types(8),
                      moe=MoESpec(num_experts=4, top_k=2, expert_width=16, shared_expert_width=8))
    assert cfg.layer_period == 4 and tiny_hybrid(layer_types=("linear_attention",) * 4).layer_period == 1
    loop = Transformer(cfg, ExecConfig(gdn_chunk=8, remat="full"), rngs=nnx.Rngs(3))
    scan = with_exec(loop, ExecConfig(gdn_chunk=8, remat="full", scan_layers=True))
    shapes = {p: v.shape for p, v in nnx.to_flat_state(nnx.state(scan.blocks))}
    assert shapes[("layers", 0, "linear_attn", "a_log")][0] == 2 and ("layers", 3, "attn", "wq") in shapes
    assert not any(p[:2] == ("layers", 3) and "linear_attn" in p for p in shapes)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 24)))

    def loss(model):
        logits, aux = model.forward(tokens)
        return jnp.mean(jax.nn.logsumexp(logits, -1)) + jnp.sum(aux["lbl"]), (logits, aux)

    # (jitted: run op by op, the two models' gradients took ~45 s of dispatching and small compiles;
    # UNOPTIMIZED: ~20 s of compiling the two programs -> ~13 s on 2 cores)
    step = jax.jit(lambda m: nnx.value_and_grad(loss, has_aux=True)(m), compiler_options=UNOPTIMIZED)
    (l_loop, (logits_loop, aux_loop)), g_loop = step(loop)
    (l_scan, (logits_scan, aux_scan)), g_scan = step(scan)
    np.testing.assert_allclose(logits_scan, logits_loop, atol=1e-5)
    assert aux_scan["lbl"].shape == (8,)
    np.testing.assert_allclose(aux_scan["lbl"], aux_loop["lbl"], rtol=1e-5)
    g_back = relayout(nnx.state(g_scan, nnx.Param), nnx.state(g_loop, nnx.Param))
    flat_loop = dict(nnx.to_flat_state(nnx.state(g_loop, nnx.Param)))
    for path, v in nnx.to_flat_state(g_back):
        np.testing.assert_allclose(v[...], flat_loop[path][...], atol=2e-5, err_msg=str(path))
    back = unscanned(scan)
    for (p, a), (q, b) in zip(nnx.to_flat_state(nnx.state(loop)), nnx.to_flat_state(nnx.state(back)), strict=True):
        assert p == q and np.array_equal(a[...], b[...])
    jaxpr = str(jax.make_jaxpr(lambda m: m(tokens))(scan))
    assert "length=2" in jaxpr and "length=8" not in jaxpr


def test_hybrid_configs_are_checked():
    with pytest.raises(ConfigError, match="'layer_types'.*num_layers \\(4\\)"):
        ModelConfig(num_layers=4, layer_types=hybrid_layer_types(3), linear_attention=LinearAttentionSpec())
    with pytest.raises(ConfigError, match="'layer_types' = 'mamba'"):
        ModelConfig(num_layers=2, layer_types=("mamba", "full_attention"))
    with pytest.raises(ConfigError, match="'linear_attention' = None.*LinearAttentionSpec"):
        ModelConfig(num_layers=4, layer_types=hybrid_layer_types(4))
    with pytest.raises(ConfigError, match="'num_v_heads' = 3"):
        LinearAttentionSpec(num_k_heads=2, num_v_heads=3)
    assert hybrid_layer_types(8) == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 \
        + ("full_attention",)
    assert tiny_hybrid().full_attention_layers == (3,)


def test_hybrid_export_refusals_name_the_field():
    shared = MoESpec(num_experts=4, top_k=2, expert_width=8, shared_expert_width=8)
    assert hf_config.export_layout(tiny_hybrid(moe=shared)) == "qwen3_next"
    with pytest.raises(ConfigError, match="'model.layer_types'.*only qwen3_next"):
        hf_config.export_layout(tiny_hybrid(), "qwen3")
    with pytest.raises(ConfigError, match="'--layout' = 'auto'.*Gated DeltaNet layers.*elementwise G1 gate"):
        hf_config.export_layout(tiny_hybrid(gate=None))
    with pytest.raises(ConfigError, match="'model.moe.shared_expert_width' = 0.*qwen3_next"):
        hf_config.export_layout(tiny_hybrid(moe=MoESpec(num_experts=4, top_k=2, expert_width=8)), "qwen3_next")
    with pytest.raises(ConfigError, match="'model.moe.shared_expert_width' = 8.*only qwen3_next"):
        hf_config.export_layout(ModelConfig(qk_norm=True, moe=shared), "qwen3_moe")
    hf = hf_config.hf_config(tiny_hybrid(moe=shared), "qwen3_next", 128)
    assert hf_config.model_config(hf, "qwen3_next") == tiny_hybrid(moe=shared)


def test_the_tiny_hybrid_trains_and_resumes_bit_identically(tmp_path):
    """configs/hybrid_tiny.py trains with the trainer like any config; resumed from its step-2
    checkpoint, it logs again what the uninterrupted run logged after it."""
    import shutil

    from gattn import cli
    from gattn.train import trainer

    small = ["train.steps=4", "train.batch_size=4", "train.seq_len=64", "train.log_every=1", "train.warmup_steps=1",
             "train.eval_every=4", "train.checkpoint_every=2", "data.eval_batches=1", "data.eval_batch_size=2",
             "data.code_max_bytes=200000", "model.vocab_size=512"]
    cfg = cli.load("hybrid_tiny", small)
    assert cfg.model.hybrid and cfg.model.moe.shared_expert_width
    full = trainer.train(cfg, tmp_path / "full", progress=False)
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    resumed = trainer.train(cfg, tmp_path / "cut", progress=False, resume_step=2)

    def rows(workdir):
        lines = (workdir / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k != "tokens_per_sec"} for line in lines]

    assert [r["step"] for r in rows(tmp_path / "full")] == [1, 2, 3, 4]
    assert rows(tmp_path / "cut") == rows(tmp_path / "full")  # steps 3 and 4 trained again, bit for bit
    assert [json.loads(line)["step"] for line in (tmp_path / "cut" / "metrics.set_aside.jsonl").read_text().splitlines()] \
        == [3, 4]
    assert resumed["step"] == full["step"] == 4
    # The same run resumed with its layers scanned (stacked groups of the pattern): the
    # checkpoint's parameters and AdamW moments are restacked, and training goes on as before.
    shutil.copytree(tmp_path / "full", tmp_path / "scanned")
    trainer.train(cli.load("hybrid_tiny", small + ["exec.scan_layers=true"]), tmp_path / "scanned",
                  progress=False, resume_step=2)
    again = rows(tmp_path / "scanned")
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    for ours, theirs in zip(again[2:], rows(tmp_path / "full")[2:]):
        np.testing.assert_allclose(ours["loss"], theirs["loss"], rtol=1e-5)


def test_measurements_on_a_hybrid_cover_attention_layers_and_m_act_everywhere(tmp_path):
    """eval.py's measurements: the attention measures (F-Attn, gate score, mean |Y|, sparsity)
    on the full-attention layers only, None on the Gated DeltaNet layers, which say why; M-Act and
    the FFN activations on every layer; attention maps refused on a GDN layer."""
    from gattn.eval import analysis, plots

    cfg = tiny_hybrid(layer_types=hybrid_layer_types(4, 2))  # GDN, attention, GDN, attention
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, 64, (2, 24))
    out = analysis.summarize(model, tokens)
    rows = out["per_layer"]
    assert [r["mixer"] for r in rows] == list(cfg.layer_types) and cfg.full_attention_layers == (1, 3)
    for r in rows:
        assert r["m_act"] > 0 and r["ffn_act"] > 0
        attention = r["mixer"] == "full_attention"
        for key in ("f_attn", "gate_score", "mean_abs_y", "sparsity", "sink_head_share"):
            assert (r[key] is not None) == attention, (r["layer"], key)
    assert out["overall"]["f_attn"] == pytest.approx(np.mean([rows[1]["f_attn"], rows[3]["f_attn"]]))
    assert out["overall"]["gate_score"] == pytest.approx(np.mean([rows[1]["gate_score"], rows[3]["gate_score"]]))
    assert out["overall"]["m_act"] == pytest.approx(np.mean([r["m_act"] for r in rows]))
    assert out["overall"]["attention_layers"] == [1, 3] and "Gated DeltaNet" in out["overall"]["not_measured"]
    assert set(out["attn_maps"]) == {"1", "3"}
    with pytest.raises(ConfigError, match="'map_layers' = 2 .*Gated DeltaNet layer"):
        analysis.Measurements(cfg, analysis.Options(map_layers=(2,)))
    from gattn.eval.evaluate import report  # eval.py's results.md: the GDN rows say what they are

    text = report({"variant": "v", "step": 1, "workdir": "w", "perplexity": {}, "measurements": out})
    assert text.count("| - (Gated DeltaNet) |") == 2 and "attention layers [1, 3]" in text
    # the sink lab's measures (eval.py's "sinks"): Sink_1^eps and alpha_1 on the attention layers
    from gattn.eval import sinks

    batch = {"tokens": np.random.default_rng(1).integers(0, 64, (2, 25)), "segment_ids": np.ones((2, 25), int),
             "positions": np.broadcast_to(np.arange(25), (2, 25))}
    sink = sinks.measure(model, Config(model=cfg), [batch])
    assert [r["layer"] for r in sink["per_layer"]] == [1, 3] and sink["overall"]["attention_layers"] == [1, 3]
    assert "Gated DeltaNet" in sink["overall"]["not_measured"]
    # the figures draw the GDN layers as gaps
    assert plots.per_layer({"hybrid": out}, tmp_path / "p.png").is_file()
    assert plots.f_attn_heads(out, tmp_path / "f.png").is_file()
    assert plots.sparsity(out, tmp_path / "s.png").is_file()


def test_the_multi_token_prediction_layer_is_kept_both_ways_and_an_incomplete_one_refused(converted, run_params,
                                                                                           tmp_path):
    """Qwen3-Next's mtp.* tensors (the released names; transformers skips them) become the MTP
    layer (model.mtp_layers = 1) beside the same main parameters, and to-hf writes every one back
    bit for bit; a folder holding only some of them is refused naming a missing one."""
    import dataclasses
    import shutil

    from safetensors.numpy import load_file, save_file

    from gattn.interop import mtp as hf_mtp
    from gattn.interop.files import ConversionError

    _, tmp = converted
    src = tmp_path / "hf_mtp"
    shutil.copytree(tmp / "hf", src)
    tensors = load_file(src / "model.safetensors")
    cfg = dataclasses.replace(rundir.read_config(tmp / "run").model, mtp_layers=1)
    rng = np.random.default_rng(4)
    mtp = {n: rng.normal(0, 0.2, shape).astype(np.float32) for n, shape in hf_mtp.hf_shapes(cfg, "qwen3_next").items()}
    assert len(mtp) > 10 and "mtp.layers.0.self_attn.q_proj.weight" in mtp
    save_file({**tensors, **mtp}, src / "model.safetensors", metadata={"format": "pt"})
    convert.from_hf(src, tmp_path / "run")
    assert rundir.read_config(tmp_path / "run").model.mtp_layers == 1
    a, b = run_params, _flat_params(tmp_path / "run")
    assert all(np.array_equal(a[k], b[k]) for k in a) and {k for k in b if k[0] == "mtp"} == set(b) - set(a)
    convert.to_hf(tmp_path / "run", tmp_path / "back")
    back = {n: t for n, t in load_file(tmp_path / "back" / "model.safetensors").items() if n.startswith("mtp.")}
    assert back.keys() == mtp.keys() and all(np.array_equal(back[n], mtp[n]) for n in mtp)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1

    partial = {"mtp.fc.weight": mtp["mtp.fc.weight"], "mtp.norm.weight": mtp["mtp.norm.weight"]}
    save_file({**tensors, **partial}, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"tensor mtp\..* is missing"):
        convert.from_hf(src, tmp_path / "run2")
