"""Issue 45: Qwen3.5 in and out (gattn/interop/qwen3_5.py). Tiny random transformers 5.24 models
built here: Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM and Qwen3_5ForConditionalGeneration and
Qwen3_5MoeForConditionalGeneration folders (a vision tower beside the language model), each 3 Gated
DeltaNet layers and 1 gated attention layer, head_dim 64, partial RoPE 0.25, checked on 80 tokens
so the GDN chunk of 64 is crossed."""

import contextlib
import dataclasses
import functools
import io
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from gattn.config import ConfigError, Config, GateSpec, ModelConfig, MoESpec, TrainConfig
from gattn.eval import decode
from gattn.interop import convert, hf_config, qwen3_5
from gattn.interop.files import ConversionError
from gattn.train import rundir
from test_convert import _flat_params, randomize, save, tokenizer_file  # noqa: F401 (a fixture)
from test_hybrid import tiny_hybrid

TOL = dict(rtol=1e-4, atol=1e-4)
TOKENS = np.random.default_rng(1).integers(0, 320, size=(2, 80))
TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-6,
            layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [3, 3, 2], "mrope_interleaved": True})
MOE = {**{k: v for k, v in TEXT.items() if k != "intermediate_size"}, "num_experts": 4, "num_experts_per_tok": 2,
       "moe_intermediate_size": 24, "shared_expert_intermediate_size": 32}
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16)
KINDS = ("dense", "moe", "vl", "vl_moe")  # vl: the multimodal folders


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """transformers' side on one thread: these tiny models gain nothing from a second, and on a
    busy 2-core machine waiting for it made a 10 ms forward pass take 1-2 s."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def qwen35_model(kind: str, seed=0):
    """A random tiny Qwen3.5 of `kind`: every weight random, norms around 0 (they scale by 1 + w),
    the GDN decay rates A from 0.02 to 4 so some heads remember across the chunk boundary."""
    model = {"dense": lambda: transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**TEXT)),
             "moe": lambda: transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**MOE)),
             "vl": lambda: transformers.Qwen3_5ForConditionalGeneration(
                 transformers.Qwen3_5Config(text_config=TEXT, vision_config=VISION)),
             "vl_moe": lambda: transformers.Qwen3_5MoeForConditionalGeneration(
                 transformers.Qwen3_5MoeConfig(text_config=MOE, vision_config=VISION))}[kind]()
    model = randomize(model, seed=seed, norm_center=0.0)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("linear_attn"):
                module.A_log.copy_(torch.log(0.02 + 4 * torch.rand(module.A_log.shape, generator=g)))
                module.norm.weight.copy_(1.0 + 0.2 * torch.randn(module.norm.weight.shape, generator=g))  # not 1 + w
    return model


def hf_logits(model, tokens=TOKENS):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens)).logits.float().numpy()


@functools.cache
def source_logits(model):
    """hf_logits(model) on TOKENS, once per source model (the tests only read the model)."""
    return hf_logits(model)


@functools.cache
def loaded(run):
    """rundir.load(run).model, once per converted run: the tests only read it, and each load builds
    the model anew (over a second)."""
    return rundir.load(run).model


def params_of(run):
    """The run's parameters as flat numpy arrays (test_convert._flat_params of the loaded model)."""
    return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(loaded(run), nnx.Param))}


_forward = jax.jit(lambda graphdef, state, tokens: nnx.merge(graphdef, state)(tokens), static_argnums=0)


def gattn_logits(workdir, tokens=TOKENS):
    graphdef, state = nnx.split(loaded(workdir))  # (dense and vl, moe and vl_moe share one compile)
    return np.asarray(_forward(graphdef, state, jnp.asarray(tokens)))


@pytest.fixture(scope="module", params=KINDS)
def converted(request, tmp_path_factory, tokenizer_file):  # noqa: F811
    """(kind, transformers model, folder, its converted run, what from-hf printed)."""
    tmp = tmp_path_factory.mktemp(request.param)
    model = qwen35_model(request.param)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        convert.from_hf(save(model, tmp / "hf", tokenizer_file), tmp / "run")
    return request.param, model, tmp / "hf", tmp / "run", err.getvalue()


def test_logits_match_transformers(converted):
    kind, model, _, run, printed = converted
    cfg = rundir.read_config(run).model
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) and cfg.zero_centered_norm
    assert (cfg.head_dim, cfg.rope_dim, cfg.gate, cfg.qk_norm) == (64, 16, GateSpec(granularity="elementwise"), True)
    assert (cfg.linear_attention.num_k_heads, cfg.linear_attention.num_v_heads) == (2, 4)
    assert cfg.moe == (MoESpec(num_experts=4, top_k=2, expert_width=24, renormalize=True, shared_expert_width=32)
                       if "moe" in kind else None)
    assert json.loads((run / "converted.json").read_text())["layout"] == "qwen3_5"
    vision = [line for line in printed.splitlines() if "vision tower" in line]
    assert len(vision) == kind.startswith("vl")
    if kind.startswith("vl"):  # one line naming the tower and its tensors
        n = sum(name.startswith("model.visual.") for name in model.state_dict())
        assert vision[0] == (f"note: skipping the vision tower of {type(model).__name__} (model.visual.*, "
                             f"{n} tensors): gattn converts the language model only") and n > 5
    ours, theirs = gattn_logits(run), source_logits(model)
    assert np.abs(theirs).max() > 1  # (logits that carry signal)
    print(f"{kind}: max |logit difference| {np.abs(ours - theirs).max():.2g} (logits up to {np.abs(theirs).max():.2g})")
    np.testing.assert_allclose(ours, theirs, **TOL)


def test_round_trip_is_bit_identical_and_loads_back_in_transformers(converted, tmp_path):
    """from-hf then to-hf writes every language-model tensor back bit for bit (the vision tower
    left out), as a text model transformers loads with the same logits; and from-hf of the export
    gives the run's parameters bit for bit."""
    from safetensors.numpy import load_file

    kind, model, hf_dir, run, _ = converted
    convert.to_hf(run, tmp_path / "back")  # auto: a run converted from Qwen3.5 goes back to Qwen3.5
    arch = json.loads((tmp_path / "back" / "config.json").read_text())["architectures"]
    assert arch == ["Qwen3_5MoeForCausalLM" if "moe" in kind else "Qwen3_5ForCausalLM"]
    saved = {name.replace("model.language_model.", "model."): t for name, t in
             load_file(hf_dir / "model.safetensors").items() if not name.startswith("model.visual.")}
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert saved.keys() == back.keys() and any("in_proj_qkv" in name for name in back)
    for name in saved:
        np.testing.assert_array_equal(saved[name], back[name], err_msg=name)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert type(again).__name__ == arch[0]
    np.testing.assert_array_equal(hf_logits(again), source_logits(model))
    convert.from_hf(tmp_path / "back", tmp_path / "run2")
    a, b = params_of(run), _flat_params(tmp_path / "run2")
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=str(key))


def test_greedy_decoding_gives_transformers_generate_tokens(converted):
    """Two prompts in one left-padded batch, prefilled 16 tokens at a time (the long one crosses
    the 64-token chunk), then recurrent steps: each row decodes what transformers' generate
    decodes for it alone."""
    _, model, _, run, _ = converted
    prompts = [TOKENS[0, :70].tolist(), TOKENS[1, :9].tolist()]
    theirs = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(input_ids=torch.as_tensor([prompt]), max_new_tokens=8, min_new_tokens=8,
                                 do_sample=False)
        theirs.append(out[0, len(prompt):].tolist())
    ours = decode.generate(loaded(run), prompts, max_new_tokens=8, prefill_chunk=16, max_len=96)
    assert ours == theirs


@pytest.mark.parametrize("converted", ["moe"], indirect=True)
def test_released_fused_experts_read_as_the_saved_ones(converted, tmp_path):
    """Qwen3.5-MoE's released files store each layer's experts fused (gate_up_proj [E, 2F, D],
    down_proj [E, D, F]): the same parameters as the per-expert tensors save_pretrained writes. A
    fused tensor of the wrong shape is named. (With an MTP layer: the test below.)"""
    from safetensors.numpy import load_file, save_file

    _, _, hf_dir, run, _ = converted
    tensors = load_file(hf_dir / "model.safetensors")
    fused = {k: v for k, v in tensors.items() if ".experts." not in k}
    for i in range(4):
        p = f"model.layers.{i}.mlp.experts."
        fused[p + "gate_up_proj"] = np.stack([np.concatenate([tensors[f"{p}{j}.gate_proj.weight"],
                                                              tensors[f"{p}{j}.up_proj.weight"]]) for j in range(4)])
        fused[p + "down_proj"] = np.stack([tensors[f"{p}{j}.down_proj.weight"] for j in range(4)])
    src = tmp_path / "released"
    shutil.copytree(hf_dir, src)
    save_file(fused, src / "model.safetensors", metadata={"format": "pt"})
    convert.from_hf(src, tmp_path / "run")
    a, b = params_of(run), _flat_params(tmp_path / "run")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    fused["model.layers.2.mlp.experts.down_proj"] = fused["model.layers.2.mlp.experts.down_proj"][:, :, :20]
    save_file(fused, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"tensor model.layers.2.mlp.experts.down_proj has shape "
                                              r"\(4, 64, 20\); config.json implies \(4, 64, 24\)"):
        convert.from_hf(src, tmp_path / "run3")


def hf_inside(model, tokens):
    """transformers' own intermediates of `model` on `tokens`, run with its eager attention (which
    returns the attention weights): each decoder layer's output hidden state [B, S, D], the
    attention layer's (layer 3's) probabilities [B, H, S, S] and gate scores sigmoid(gate)
    [B, S, H, K] (q_proj's output is [query | gate] per head), and the logits."""
    inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
    attn = inner.layers[3].self_attn
    seen = {"out": []}

    def keep(key):
        return lambda module, args, out: seen.__setitem__(key, out)

    def block_out(module, args, out):
        seen["out"].append(out[0] if isinstance(out, tuple) else out)

    hooks = [layer.register_forward_hook(block_out) for layer in inner.layers]
    hooks += [attn.register_forward_hook(keep("attn")), attn.q_proj.register_forward_hook(keep("q"))]
    was = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        logits = hf_logits(model, tokens)
    finally:
        model.set_attn_implementation(was)
        for hook in hooks:
            hook.remove()
    b, s = np.shape(tokens)
    q = seen["q"].view(b, s, -1, 2 * attn.head_dim)
    assert len(seen["out"]) == 4 and seen["attn"][1] is not None  # (eager: the weights are returned)
    return dict(block_out=[o.float().numpy() for o in seen["out"]], probs=seen["attn"][1].float().numpy(),
                gate=torch.sigmoid(q[..., attn.head_dim:]).float().numpy(), logits=logits)


def mean_nll(logits_BxSxV, targets_BxS):
    logp = torch.log_softmax(torch.as_tensor(logits_BxSxV, dtype=torch.float64), -1)
    return float(-logp.gather(-1, torch.as_tensor(targets_BxS)[..., None]).mean())


@pytest.mark.parametrize("converted", KINDS, indirect=True)
def test_the_papers_measurements_on_a_converted_qwen3_5_are_transformers_own(converted):
    """eval.py's measurements on the converted run, against the same quantities read from
    transformers' forward pass of the source model (80 tokens, crossing the GDN chunk):
    analysis.summarize's M-Act on every layer, and on the attention layer its gate score (mean
    sigmoid of q_proj's gate half), F-Attn per head (attention on token 0, queries 1..79) and the
    F-Attn sink-head share; the sink lab's sinks.measure (eval.py's "sinks") on 64-token windows:
    Gu et al.'s alpha_1 per head (the first 64 queries, A[0, 0] = 1 included), the Sink_1^0.3
    share, the gate score per head, and the first-token ablation's losses (plain: transformers'
    next-token loss; hidden: transformers' loss on the row without its first token)."""
    from gattn.eval import analysis, sinks

    _, model, _, run, _ = converted
    ref = hf_inside(model, TOKENS)
    b, h = TOKENS.shape[0], model.config.get_text_config().num_attention_heads
    gattn_model = loaded(run)
    out = analysis.summarize(gattn_model, TOKENS)
    rows = out["per_layer"]
    assert [r["mixer"] for r in rows] == ["linear_attention"] * 3 + ["full_attention"]
    assert out["overall"]["attention_layers"] == [3] and "Gated DeltaNet" in out["overall"]["not_measured"]
    m_act = [np.abs(o).max() for o in ref["block_out"]]
    np.testing.assert_allclose([r["m_act"] for r in rows], m_act, rtol=1e-4)
    assert all(x > 0 for x in m_act)
    assert [r["gate_score"] is None and r["f_attn"] is None and r["sink_head_share"] is None for r in rows] == \
        [True] * 3 + [False]
    attention = rows[3]
    assert 0 < attention["gate_score"] < 1 and out["overall"]["gate_score"] == attention["gate_score"]
    np.testing.assert_allclose(attention["gate_score"], ref["gate"].mean(), rtol=0, atol=1e-5)
    f_head = ref["probs"][:, :, 1:, 0].mean(axis=(0, 2))  # [H]: each head's attention on token 0, query 0 left out
    assert len(attention["f_attn_per_head"]) == h and 0 < attention["f_attn"] < 1
    np.testing.assert_allclose(attention["f_attn_per_head"], f_head, rtol=0, atol=1e-5)
    assert attention["f_attn"] == pytest.approx(f_head.mean(), abs=1e-5) == out["overall"]["f_attn"]
    assert attention["sink_head_share"] == np.mean(f_head > 0.3) == out["overall"]["sink_head_share"]
    # (a random model has no sink head at 0.3: a threshold between its two heads makes one of them one)
    assert abs(f_head[0] - f_head[1]) > 1e-4
    between = analysis.summarize(gattn_model, TOKENS, options=analysis.Options(sink_threshold=float(f_head.mean())))
    assert between["per_layer"][3]["sink_head_share"] == between["overall"]["sink_head_share"] == 0.5

    cfg = rundir.read_config(run)
    batch = {"tokens": TOKENS, "segment_ids": np.ones_like(TOKENS),
             "positions": np.broadcast_to(np.arange(80), (b, 80))}
    sink = sinks.measure(gattn_model, cfg, [batch])  # rows of 80 = 79 inputs + a target; windows of their first 64
    o, (row,) = sink["overall"], sink["per_layer"]
    assert (row["layer"], o["attention_layers"], o["window"], o["windows"]) == (3, [3], 64, b)
    assert "Gated DeltaNet" in o["not_measured"]
    alpha = ref["probs"][:, :, :64, 0].mean(axis=(0, 2))  # [H]
    assert np.all((alpha > 0) & (alpha < 1))
    np.testing.assert_allclose(row["alpha_1_per_head"], alpha, rtol=0, atol=1e-5)
    assert row["sink_share"] == o["sink_share"] == np.mean(alpha > 0.3)
    assert abs(alpha[0] - alpha[1]) > 1e-4  # (and at an eps between the two heads, one is a sink head)
    assert sinks.measure(gattn_model, cfg, [batch], eps=float(alpha.mean()))["overall"]["sink_share"] == 0.5
    assert o["alpha_1_mean"] == pytest.approx(alpha.mean(), abs=1e-5)
    assert o["uniform_alpha_1"] == sinks.uniform_level(64)
    np.testing.assert_allclose(row["gate_score_per_head"], ref["gate"][:, :64].mean(axis=(0, 1, 3)), rtol=0, atol=1e-5)
    plain = mean_nll(ref["logits"][:, 1:79], TOKENS[:, 2:80])  # queries 1..78 of the 79 inputs (0 starts the document)
    # token 0 hidden: the rest of the row alone (at positions 0.. here, 1.. in gattn: RoPE is relative)
    hidden = mean_nll(hf_logits(model, TOKENS[:, 1:79]), TOKENS[:, 2:80])
    ab = sink["ablation"]
    assert ab["targets"] == b * 78 and ab["loss_plain"] == pytest.approx(plain, abs=1e-4)
    assert ab["loss_hidden"] == pytest.approx(hidden, abs=1e-4) and abs(hidden - plain) > 1e-3
    assert o["ablation_cost"] == ab["cost"] == pytest.approx(hidden - plain, abs=2e-4)


@pytest.fixture(scope="module")
def lm_eval_tasks(tmp_path_factory):
    """tests/test_lm_eval.py's local multiple-choice task (ARC-Easy's schema, 3 questions) and its
    rolling-loglikelihood task over a local file."""
    from test_lm_eval import fixture_data, task_folder

    root = tmp_path_factory.mktemp("lm_eval_tasks")
    return task_folder(fixture_data(root / "data"), root / "tasks")


def transformers_loglikelihood(model, ctx, cont):
    """(sum of transformers' log-softmax of `cont` after `ctx`, whether its argmax gives each token)."""
    logits = hf_logits(model, [list(ctx) + list(cont)])[0][len(ctx) - 1:-1]
    logp = torch.log_softmax(torch.as_tensor(logits, dtype=torch.float64), -1).numpy()
    return float(logp[np.arange(len(cont)), cont].sum()), bool((logits.argmax(-1) == np.asarray(cont)).all())


@pytest.mark.parametrize("converted", ["vl", "vl_moe"], indirect=True)
def test_lm_eval_scores_a_qwen3_5_folder_as_transformers_does(converted, lm_eval_tasks):
    """lm-eval's own entry (lm_eval.simple_evaluate, as tests/test_lm_eval.py runs it: local tasks,
    one few-shot example) with gattn's model class loading the Hugging Face folder itself
    (converted in memory; the multimodal folders, as Qwen3.5 is released, dense and MoE): each
    multiple-choice request's log-likelihood is transformers' log-softmax sum to 1e-4 and its
    is_greedy transformers' argmax, each question's acc is whether transformers' scores pick the
    gold answer, and each rolling request's log-likelihood is transformers' over lm-eval's own
    rolling windows."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
    from test_lm_eval import _evaluate

    from gattn.interop import harness

    _, model, hf_dir, _, _ = converted
    lm = harness.GattnLM(workdir=str(hf_dir), batch_size=2)
    res = _evaluate(lm, lm_eval_tasks, tasks=["local_arc_easy", "rolling"])
    questions = sorted(res["samples"]["local_arc_easy"], key=lambda x: x["doc_id"])
    assert len(questions) == 3
    for q in questions:
        pairs = [tuple(a) for a in q["arguments"]]
        assert len(pairs) == 4 and all(ctx for ctx, _ in pairs)
        ours = [tuple(r[0]) for r in q["resps"]]
        theirs = [transformers_loglikelihood(model, *lm._encode_pair(ctx, cont)) for ctx, cont in pairs]
        np.testing.assert_allclose([x for x, _ in ours], [x for x, _ in theirs], rtol=0, atol=1e-4)
        assert [g for _, g in ours] == [g for _, g in theirs]
        assert all(x < 0 for x, _ in ours)
        assert q["acc"] == float(np.argmax([x for x, _ in theirs]) == q["target"])
    assert res["results"]["local_arc_easy"]["acc,none"] == pytest.approx(np.mean([q["acc"] for q in questions]))
    rolling = res["samples"]["rolling"]
    assert len(rolling) == 2
    for r in rolling:
        (text,) = r["arguments"][0]
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
            token_list=lm.tok_encode(text), prefix_token=lm.prefix_token_id, max_seq_len=lm.max_length, context_len=1)]
        theirs = sum(transformers_loglikelihood(model, ctx, cont)[0] for ctx, cont in windows)
        assert r["resps"][0][0] == pytest.approx(theirs, rel=1e-6, abs=1e-4) and theirs < 0  # (a sum of ~30)


# --------------------------------------------------------------------------- no model needed


def test_the_multimodal_rope_on_text_positions_is_plain_rope():
    """transformers' Qwen3.5 RoPE with the shipped config (head_dim 256, a quarter rotating,
    mrope_section [11, 11, 10], base 1e7; and with YaRN) on text positions (temporal = height =
    width) equals gattn's plain partial RoPE; on image positions it does not."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding, apply_rotary_pos_emb

    from gattn.model.layers import apply_rope

    shipped = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
               "mrope_interleaved": True}
    yarn = {**shipped, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    assert qwen3_5.mrope_section(64) == shipped["mrope_section"] and qwen3_5.mrope_section(16) == [3, 3, 2]
    rng = np.random.default_rng(0)
    positions = np.sort(rng.choice(4096, size=48, replace=False))
    x = rng.standard_normal((48, 2, 256)).astype(np.float32)  # [tokens, heads, head_dim]
    for rope in (shipped, yarn):
        hf = {**TEXT, "head_dim": 256, "max_position_embeddings": 4096, "rope_parameters": rope}
        cfg = hf_config.model_config({**hf, "architectures": ["Qwen3_5ForCausalLM"]}, "qwen3_5")
        assert cfg.rope_dim == 64 and (cfg.yarn is None) == (rope is shipped)
        embed = Qwen3_5TextRotaryEmbedding(transformers.Qwen3_5TextConfig(**hf))
        xt = torch.as_tensor(x).transpose(0, 1)[None]  # [1, heads, tokens, head_dim]

        def theirs(pos_3xS):
            cos, sin = embed(xt, torch.as_tensor(pos_3xS)[:, None, :])
            return apply_rotary_pos_emb(xt, xt, cos, sin)[0][0].transpose(0, 1).numpy()

        ours = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), cfg.rope_base, cfg.yarn, cfg.rope_dim))
        # (to fp32 angle rounding: at positions near 4096 one ulp of the angle is 4.9e-4 rad, and the
        # two sides round their frequencies differently; an image's positions differ by > 0.1 below)
        np.testing.assert_allclose(theirs(np.stack([positions] * 3)), ours, rtol=0, atol=2e-3)
        near = positions < 256
        np.testing.assert_allclose(theirs(np.stack([positions] * 3))[near], ours[near], rtol=0, atol=1e-4)
        image = np.stack([positions, positions // 7, positions % 7])  # (an image's grid: height, width differ)
        assert np.abs(theirs(image) - ours).max() > 0.1


QWEN35_27B = {  # Qwen3.5-27B's config.json, as released (vision_config shortened: it is skipped)
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "image_token_id": 248056,
    "video_token_id": 248057, "vision_start_token_id": 248053, "vision_end_token_id": 248054,
    "language_model_only": False, "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0",
    "vision_config": {"depth": 27, "hidden_size": 1152, "model_type": "qwen3_5"},
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "bos_token_id": 248044,
        "dtype": "bfloat16", "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256,
        "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 17408,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
        "linear_value_head_dim": 128, "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144,
        "model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 24, "num_hidden_layers": 64, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
        "use_cache": True, "vocab_size": 248320,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                            "rope_theta": 10_000_000, "partial_rotary_factor": 0.25}}}


def test_every_config_field_is_mapped_or_refused_in_one_line():
    text = QWEN35_27B["text_config"]
    assert hf_config.detect_layout(QWEN35_27B) == "qwen3_5"
    cfg = hf_config.model_config(QWEN35_27B, "qwen3_5")
    assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.q_heads, cfg.kv_heads, cfg.head_dim, cfg.d_ff) == \
        (248320, 5120, 64, 24, 4, 256, 17408)
    assert (cfg.rope_base, cfg.rope_dim, cfg.tie_embeddings, cfg.moe, cfg.layer_types) == \
        (1e7, 64, False, None, tuple(text["layer_types"]))
    la = cfg.linear_attention
    assert (la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim, la.conv_kernel) == (16, 48, 128, 128, 4)
    moe_text = {**{k: v for k, v in text.items() if k != "intermediate_size"}, "model_type": "qwen3_5_moe_text",
                "hidden_size": 2048, "num_hidden_layers": 4, "layer_types": text["layer_types"][:4],
                "num_key_value_heads": 2, "num_experts": 256, "num_experts_per_tok": 8,
                "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "router_aux_loss_coef": 0.001}
    moe = hf_config.model_config({**moe_text, "architectures": ["Qwen3_5MoeForCausalLM"]}, "qwen3_5").moe
    assert moe == MoESpec(num_experts=256, top_k=8, expert_width=512, renormalize=True, shared_expert_width=512)
    # transformers' ConditionalGeneration model ties its head as the outer field says, whatever text_config says.
    for outer_tie in (False, True):
        mixed = {**QWEN35_27B, "tie_word_embeddings": outer_tie,
                 "text_config": {**QWEN35_27B["text_config"], "tie_word_embeddings": not outer_tie}}
        assert hf_config.model_config(mixed, "qwen3_5").tie_embeddings == outer_tie
    outer, inner = "config.json ", "config.json text_config."
    refused = [  # (where, field, value, what the line must say)
        (inner, "attn_output_gate", False, "always gates"), (inner, "hidden_act", "gelu", "'silu' or absent"),
        (inner, "attention_dropout", 0.1, "no attention dropout"), (inner, "mlp_only_layers", [1], r"\[\] or absent"),
        (inner, "norm_topk_prob", False, "always renormalises"), (inner, "num_experts", 8, "not one of the fields"),
        (inner, "quantization_config", {"bits": 4}, "float weights .* only; dequantize"),
        (inner, "layer_types", ["mamba"] * 64, "one of full_attention, linear_attention"),
        (outer, "quantization_config", {"bits": 4}, "float weights .* only; dequantize"),
        (outer, "text_config", None, "the language model's config")]
    for where, field, value, match in refused:
        bad = json.loads(json.dumps(QWEN35_27B))
        (bad if where == outer else bad["text_config"])[field] = value
        with pytest.raises(ConfigError, match=f"'{where}{field}' = .* is not allowed: .*{match}"):
            hf_config.model_config(bad, "qwen3_5")
    for key, value, match in [("mrope_interleaved", False, "interleaves"), ("mrope_section", [11, 21], "3 integers"),
                              ("rope_type", "linear", "'default' or 'yarn'"), ("scaling", 2.0, "one of rope_type")]:
        bad = json.loads(json.dumps(QWEN35_27B))
        bad["text_config"]["rope_parameters"][key] = value
        with pytest.raises(ConfigError, match=match):
            hf_config.model_config(bad, "qwen3_5")


def test_export_writes_qwen3_5_for_a_converted_qwen3_5_and_refuses_what_it_cannot_hold(tmp_path):
    """auto gives Qwen3.5 back to a run converted from one, or continuing one (train.init_from),
    and qwen3_next otherwise; Qwen3.5's config.json reads back as the same gattn model; an MoE that
    does not renormalise or has no shared expert is refused naming the field."""
    shared = MoESpec(num_experts=4, top_k=2, expert_width=8, shared_expert_width=8)
    for model in (tiny_hybrid(rope_dim=4), tiny_hybrid(moe=shared)):
        assert hf_config.export_layout(model) == "qwen3_next"
        assert hf_config.export_layout(model, source="qwen3_5") == "qwen3_5"
        hf = hf_config.hf_config(model, "qwen3_5", 128)
        assert hf["rope_parameters"]["mrope_section"] == qwen3_5.mrope_section(model.rope_dim or model.head_dim)
        unused = {"d_ff": model.moe.expert_width} if model.moe else {}  # (d_ff is not written beside an MoE)
        assert hf_config.model_config(hf, "qwen3_5") == dataclasses.replace(model, **unused)
    unnormalised = tiny_hybrid(moe=MoESpec(num_experts=4, top_k=2, expert_width=8, shared_expert_width=8,
                                           renormalize=False))
    assert hf_config.export_layout(unnormalised, source="qwen3_5") == "qwen3_next"
    with pytest.raises(ConfigError, match="'model.moe.renormalize' = False .*--layout qwen3_next"):
        hf_config.export_layout(unnormalised, "qwen3_5")
    with pytest.raises(ConfigError, match="'model.moe.shared_expert_width' = 0 .*layout qwen3_5"):
        hf_config.export_layout(tiny_hybrid(moe=MoESpec(num_experts=4, top_k=2, expert_width=8)), "qwen3_5")
    with pytest.raises(ConfigError, match="'model.gate' = None .*layout qwen3_5 holds a G1 gate"):
        hf_config.export_layout(ModelConfig(qk_norm=True), "qwen3_5")
    source = tmp_path / "converted"
    source.mkdir()
    (source / "converted.json").write_text(json.dumps({"layout": "qwen3_5"}))
    continued = Config(model=tiny_hybrid(), train=TrainConfig(init_from=str(source)))
    assert convert.converted_layout(tmp_path, continued) == "qwen3_5"
    assert convert.converted_layout(tmp_path, Config(model=tiny_hybrid())) is None


# --------------------------------------------------------------------------- the MTP layer in a folder


class TorchMTP(torch.nn.Module):
    """Qwen3.5's MTP layer built from transformers' own modules, as the released checkpoints name
    its tensors (mtp.*) and vLLM / SGLang run it (transformers skips it on load): y = norm(layer(fc(
    [pre_fc_norm_embedding(embed(x_{t+1})) | pre_fc_norm_hidden(h_t)]))), logits = lm_head(y), h_t
    the main model's final hidden state. A plain module, so its MoE experts are stored fused
    (mlp.experts.gate_up_proj / down_proj), as in the released Qwen3.5-MoE files."""

    def __init__(self, model):
        super().__init__()
        text = model.config.get_text_config()
        mod = transformers.models.qwen3_5_moe.modeling_qwen3_5_moe if "Moe" in type(model).__name__ else \
            transformers.models.qwen3_5.modeling_qwen3_5
        prefix = "Qwen3_5Moe" if "Moe" in type(model).__name__ else "Qwen3_5"
        norm, layer = getattr(mod, prefix + "RMSNorm"), getattr(mod, prefix + "DecoderLayer")
        d = text.hidden_size
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = norm(d, eps=text.rms_norm_eps), norm(d, eps=text.rms_norm_eps)
        self.fc = torch.nn.Linear(2 * d, d, bias=False)
        self.layers = torch.nn.ModuleList([layer(text, text.layer_types.index("full_attention"))])
        self.norm = norm(d, eps=text.rms_norm_eps)
        self.main = [model]  # (not a submodule: its tensors are not the MTP layer's)

    def logits(self, tokens):
        """MTP logits [1, S-1, V] (position t predicts token t+2) of one row of tokens [1, S]."""
        main = self.main[0]
        inner = main.model.language_model if hasattr(main.model, "language_model") else main.model
        with torch.no_grad():
            ids = torch.as_tensor(tokens)
            h = inner(input_ids=ids).last_hidden_state[:, :-1]
            e = inner.embed_tokens(ids[:, 1:])
            x = self.fc(torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(h)], -1))
            s = x.shape[1]
            pos = torch.arange(s).view(1, 1, -1).expand(3, 1, -1)
            mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
            x = self.layers[0](x, position_embeddings=inner.rotary_emb(x, pos), attention_mask=mask)
            return main.lm_head(self.norm(x)).float().numpy()


@pytest.mark.parametrize("converted", ["dense", "moe"], indirect=True)
def test_the_mtp_layer_converts_both_ways_and_gives_the_reference_mtp_logits(converted, tmp_path,
                                                                            tokenizer_file):  # noqa: F811
    """A Qwen3.5 folder with its MTP layer (mtp.*, as released: the MoE's experts fused): from-hf
    sets model.mtp_layers = 1 and gattn's MTP logits equal the reference built from transformers'
    modules; to-hf writes every mtp.* tensor back (bit for bit; the MoE's experts per expert) and
    mtp_num_hidden_layers 1; transformers loads the export with the same logits."""
    from safetensors.numpy import load_file, save_file

    from gattn.model.transformer import head_logits

    kind, model = converted[:2]  # (the source model, read only: its folder here is saved anew, with the MTP layer)
    mtp = randomize(TorchMTP(model), seed=5, norm_center=0.0)
    hf_dir = save(model, tmp_path / "hf", tokenizer_file, {"mtp_num_hidden_layers": 1,
                                                            "mtp_use_dedicated_embeddings": False})
    tensors = load_file(hf_dir / "model.safetensors")
    released = {"mtp." + n: t.detach().numpy().copy() for n, t in mtp.state_dict().items()}
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in released) == (kind == "moe")
    save_file({**tensors, **released}, hf_dir / "model.safetensors", metadata={"format": "pt"})

    convert.from_hf(hf_dir, tmp_path / "run")
    ours_model = rundir.load(tmp_path / "run").model
    assert ours_model.cfg.mtp_layers == 1
    tokens = TOKENS[:1, :40]

    @nnx.jit  # (one compiled program, not one per op)
    def mtp_logits(model, tokens):
        x_NxD, _ = model.hidden(tokens)
        h_NxD = x_NxD.reshape(1, 40, -1)[:, :-1].reshape(39, -1)
        y_NxD, _ = model.mtp_hidden(h_NxD, tokens[:, 1:])
        return head_logits(y_NxD, model.head_weight(), model.dtype).reshape(1, 39, -1)

    ours = np.asarray(mtp_logits(ours_model, jnp.asarray(tokens)))
    theirs = mtp.logits(tokens)
    assert np.abs(theirs).max() > 1
    np.testing.assert_allclose(ours, theirs, **TOL)

    convert.to_hf(tmp_path / "run", tmp_path / "back")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    written = {n: t for n, t in back.items() if n.startswith("mtp.")}
    if kind == "moe":  # (written per expert, as save_pretrained writes the main layers')
        p, e = "mtp.layers.0.mlp.experts.", 4
        written[p + "gate_up_proj"] = np.stack([np.concatenate([written.pop(f"{p}{j}.gate_proj.weight"),
                                                                written.pop(f"{p}{j}.up_proj.weight")]) for j in range(e)])
        written[p + "down_proj"] = np.stack([written.pop(f"{p}{j}.down_proj.weight") for j in range(e)])
    assert written.keys() == released.keys()
    for name in released:
        np.testing.assert_array_equal(written[name], released[name], err_msg=name)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    np.testing.assert_array_equal(hf_logits(again), source_logits(model))


def test_the_continued_pretraining_preset_is_the_converted_qwen3_5_2b():
    """configs/qwen3_5_2b.py is the model from-hf reads from Qwen3.5-2B's released config.json
    (its text_config's fields, as published; the vision tower's left out) with its MTP layer, so
    `train.py --init-from` accepts the converted run (gattn/train/init_from.py compares them)."""
    from gattn import cli
    from gattn.train import init_from

    released = json.loads(json.dumps(QWEN35_27B))
    released["text_config"].update(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
        linear_num_value_heads=16, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
        tie_word_embeddings=True)
    released["tie_word_embeddings"] = True
    converted = dataclasses.replace(hf_config.model_config(released, "qwen3_5"), mtp_layers=1)
    preset = cli.load("qwen3_5_2b", [])
    assert preset.model == converted
    rundir.check_same(preset, Config(model=converted), ("model",), may_change=init_from.MAY_DIFFER, what="the source",
                  fix="(the check --init-from makes)")
    assert preset.train.mtp_loss_weight > 0 and preset.model.mtp_layers == 1
