"""The multi-token-prediction layer (gattn/model/mtp.py): its forward pass, the MTP loss and its
masking, training with it, self-speculative decoding (gattn/eval/speculative.py) and the mapping
of the Hugging Face mtp.* tensors (gattn/interop/mtp.py). docs/mtp.md."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_model
from gattn.config import (BackcopySpec, Config, ConfigError, DataConfig, ExecConfig, GateSpec, LinearAttentionSpec,
                          MoESpec, TrainConfig, hybrid_layer_types)
from gattn.eval import decode, speculative
from gattn.interop import mtp as hf_mtp
from gattn.interop.files import ConversionError
from gattn.model.transformer import Transformer, head_logits, relayout
from gattn.train import trainer
from gattn.train.loss import lm_and_mtp_loss, mtp_target_weights

# Qwen3-Next's kind in miniature: gated attention, QK-norm, (1 + w) norms, partial RoPE
NEXT = dict(gate=GateSpec(), qk_norm=True, zero_centered_norm=True, rope_dim=4, mtp_layers=1)
HYBRID_MOE = dict(NEXT, num_layers=4, layer_types=hybrid_layer_types(4, 4), linear_attention=LinearAttentionSpec(2, 4, 8, 8, 4),
                  moe=MoESpec(num_experts=4, top_k=2, expert_width=16, shared_expert_width=16))


def perturbed(model: Transformer, seed: int = 0) -> Transformer:
    """Every norm scale random (so a norm applied twice, or a swapped one, shows)."""
    rng = np.random.default_rng(seed)
    for _, p in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if p.role == "scale":
            p[...] = p[...] + jnp.asarray(rng.normal(0, 0.3, p.shape), p.dtype)
    return model


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * (1 + w)


@pytest.fixture(scope="module")
def next_model():
    """The perturbed tiny Qwen3-Next kind (NEXT) the first tests read (none changes it)."""
    return perturbed(Transformer(tiny_model(vocab_size=64, **NEXT), rngs=nnx.Rngs(0)))


# The model's methods as one compiled program each (run op by op, the two tests below compiled
# ~350 small programs, one per operation and shape).
_mtp_hidden = nnx.jit(lambda model, *a: model.mtp_hidden(*a))


def test_the_mtp_layer_computes_norm_fc_concat_block_norm_and_shares_the_head(next_model):
    model = next_model
    cfg = model.cfg
    b, s, d = 2, 12, cfg.d_model
    rng = np.random.default_rng(1)
    h_NxD = rng.normal(size=(b * s, d)).astype(np.float32)
    next_BxS = rng.integers(0, 64, (b, s))
    seg_BxS = np.array([[1] * 5 + [2] * 7, [1] * 12])
    pos_BxS = np.array([list(range(5)) + list(range(7)), list(range(12))])
    y_NxD, _ = _mtp_hidden(model, jnp.asarray(h_NxD), jnp.asarray(next_BxS), jnp.asarray(pos_BxS), jnp.asarray(seg_BxS))

    m, eps = model.mtp, cfg.norm_eps
    e_NxD = np.asarray(model.embed[...])[next_BxS.reshape(-1)]
    x_Nx2D = np.concatenate([rms(e_NxD, np.asarray(m.pre_fc_norm_embedding.scale[...]), eps),
                             rms(h_NxD, np.asarray(m.pre_fc_norm_hidden.scale[...]), eps)], -1)  # embedding first
    block = nnx.jit(lambda blk, *a: blk(*a, (b, s)))
    z_NxD, _ = block(m.block, jnp.asarray(x_Nx2D @ np.asarray(m.fc[...])), jnp.asarray(pos_BxS.reshape(-1)),
                     jnp.asarray(seg_BxS))  # the model's own block (tests/test_model.py)
    want = rms(np.asarray(z_NxD), np.asarray(m.norm.scale[...]), eps)
    np.testing.assert_allclose(np.asarray(y_NxD), want, rtol=1e-5, atol=1e-5)

    # causal and per document: changing row 0's second document leaves its first unchanged
    h2 = h_NxD.copy()
    h2[7] += 1.0
    y2, _ = _mtp_hidden(model, jnp.asarray(h2), jnp.asarray(next_BxS), jnp.asarray(pos_BxS), jnp.asarray(seg_BxS))
    np.testing.assert_array_equal(np.asarray(y2)[:7], np.asarray(y_NxD)[:7])
    assert not np.allclose(np.asarray(y2)[7], np.asarray(y_NxD)[7])

    # the cached path (speculative decoding) computes what the training path does
    decode_mtp = nnx.jit(lambda model, *a: model.mtp_decode(*a, model.init_mtp_cache(1, 16)))
    logits_1xSxV, _ = decode_mtp(model, jnp.asarray(h_NxD[s:]), jnp.asarray(next_BxS[1:]), jnp.asarray(pos_BxS[1:]))
    want_logits = np.asarray(y_NxD)[s:] @ np.asarray(model.head_weight())
    np.testing.assert_allclose(np.asarray(logits_1xSxV[0]), want_logits, rtol=1e-4, atol=1e-5)


@nnx.jit
def _by_hand(model, tokens, pos, seg):
    """(log-probabilities [2, 8, V], y_NxD): the MTP layer on the main model's hidden states."""
    x_NxD, _ = model.hidden(tokens[:, :-1], pos[:, :-1], seg[:, :-1])
    y_NxD, _ = model.mtp_hidden(x_NxD, tokens[:, 1:], pos[:, :-1], seg[:, :-1])
    return jax.nn.log_softmax(head_logits(y_NxD, model.head_weight(), jnp.float32).reshape(2, 8, -1)), y_NxD


def test_the_mtp_loss_predicts_token_t_plus_2_within_each_document(next_model):
    seg = jnp.asarray([[1, 1, 1, 1, 2, 2, 2, 0, 0], [3, 3, 3, 3, 3, 3, 3, 3, 3]])
    want = [[1, 1, 0, 0, 1, 0, 0, 0, 0][:8], [1, 1, 1, 1, 1, 1, 1, 0][:8]]
    np.testing.assert_array_equal(np.asarray(jax.jit(mtp_target_weights)(seg)), np.asarray(want, bool))

    model = next_model
    tokens_np = np.random.default_rng(2).integers(0, 64, seg.shape)
    tokens = jnp.asarray(tokens_np)
    pos = jnp.asarray([[0, 1, 2, 3, 0, 1, 2, 0, 0], list(range(9))])
    _, mtp, _ = nnx.jit(lm_and_mtp_loss)(model, tokens, seg, pos)
    # by hand: the MTP layer on the main model's hidden states, token t+2 at position t, the mask above
    logp, y_NxD = _by_hand(model, tokens, pos, seg)
    targets = np.pad(tokens_np[:, 2:], ((0, 0), (0, 1)))
    nll = -np.take_along_axis(np.asarray(logp), targets[..., None], -1)[..., 0]
    w = np.asarray(want, np.float32)
    np.testing.assert_allclose(float(mtp), (nll * w).sum() / w.sum(), rtol=1e-6)

    # the next document's first token reaches only the MTP output whose target is cut (t = 3)
    changed = tokens_np.copy()
    changed[0, 4] = (changed[0, 4] + 1) % 64
    y_a = np.asarray(y_NxD).reshape(2, 8, -1)
    y_b = np.asarray(_by_hand(model, jnp.asarray(changed), pos, seg)[1]).reshape(2, 8, -1)
    np.testing.assert_array_equal(y_a[0, :3], y_b[0, :3])
    assert not np.allclose(y_a[0, 3], y_b[0, 3]) and not w[0, 3]


_INITIAL: dict = {}  # (model, exec, seed) -> the initial parameters
# The test's own gradient programs compiled without LLVM's optimisation passes (XLA's CPU backend
# at -O0): the same operations, a third less compile time for programs run once on 4 rows.
UNOPTIMIZED = {"xla_backend_optimization_level": 0}


def _initial_params(cfg: Config):
    """The parameters trainer.init_state(cfg) starts from (the model built from train.seed), made
    once per model, exec config and seed, all they depend on (init_state compiles the
    initialisation and the optimizer's state anew at every call)."""
    key = (cfg.model, cfg.exec, cfg.train.seed)
    if key not in _INITIAL:
        _INITIAL[key] = nnx.state(Transformer(cfg.model, cfg.exec, rngs=nnx.Rngs(cfg.train.seed)), nnx.Param)
    return _INITIAL[key]


def _grads(cfg: Config, batch, params_of: Config | None = None):
    """(loss, aux, flat grads) of one step at cfg's initial parameters, or at those of `params_of`
    (a config of the same model whose initialisation differs, a scanned stack's: laid out as cfg's)."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg.model, cfg.exec, rngs=nnx.Rngs(cfg.train.seed)))
    graphdef, like = nnx.split(abstract, nnx.Param)  # (as trainer.init_state splits it)
    params = _initial_params(cfg) if params_of is None else relayout(_initial_params(params_of), like)
    step = jax.jit(lambda p, b: trainer.loss_and_grads(cfg, graphdef, p, b), compiler_options=UNOPTIMIZED)
    (loss, aux), grads = step(params, batch)
    return float(loss), aux, dict(nnx.to_flat_state(grads))


def test_training_with_the_mtp_loss_reaches_its_parameters_and_a_zero_weight_changes_nothing():
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 64, (4, 16)).astype(np.int32)
    seg = np.repeat([[1] * 9 + [2] * 5 + [0] * 2], 4, 0).astype(np.int32)
    pos = np.repeat([list(range(9)) + list(range(5)) + [0, 0]], 4, 0).astype(np.int32)
    batch = {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(seg), "positions": jnp.asarray(pos)}
    model = tiny_model(vocab_size=64, **NEXT)
    train = TrainConfig(batch_size=4, seq_len=16, steps=4, warmup_steps=1)

    # weight 0: the model without the MTP layer's loss and gradients, exactly; the MTP's get none
    plain = _grads(Config(model=dataclasses.replace(model, mtp_layers=0), train=train), batch)
    idle = _grads(Config(model=model, train=train), batch)
    assert plain[0] == idle[0] and "mtp_loss" not in idle[1]
    for path, g in idle[2].items():
        if path[0] == "mtp":
            assert not np.any(np.asarray(g[...])), path
        else:
            np.testing.assert_array_equal(np.asarray(g[...]), np.asarray(plain[2][path][...]), err_msg=str(path))

    # weight 0.5: the reported CE is the same, the MTP loss is reported, every MTP parameter learns
    weighted = Config(model=model, train=dataclasses.replace(train, mtp_loss_weight=0.5))
    loss, aux, grads = _grads(weighted, batch)
    assert loss == pytest.approx(plain[0], rel=1e-6) and 3.0 < float(aux["mtp_loss"]) < 6.0
    assert all(np.any(np.asarray(g[...])) for p, g in grads.items() if p[0] == "mtp")
    assert not np.allclose(np.asarray(grads[("embed",)][...]), np.asarray(plain[2][("embed",)][...]))

    # microbatches, a scanned stack, remat and the chunked loss give the same numbers
    other = dataclasses.replace(weighted, train=dataclasses.replace(weighted.train, microbatches=2),
                                exec=ExecConfig(scan_layers=True, remat="full", loss_chunk=5))
    loss2, aux2, grads2 = _grads(other, batch, params_of=weighted)  # (a scanned init draws other numbers)
    assert loss2 == pytest.approx(loss, rel=1e-5)
    assert float(aux2["mtp_loss"]) == pytest.approx(float(aux["mtp_loss"]), rel=1e-5)
    for path in [p for p in grads if p[0] == "mtp"] + [("embed",)]:
        np.testing.assert_allclose(np.asarray(grads2[path][...]), np.asarray(grads[path][...]), rtol=2e-4, atol=1e-6)


def test_a_run_with_the_mtp_loss_logs_it(mtp_run):
    """The saved run below (trained with the MTP loss, every step logged): each step logs it."""
    rows = [json.loads(line) for line in (mtp_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 21)) and all(r["mtp/loss"] > 0 for r in rows)


def bigram_drafter(model: Transformer, main_scale: float) -> Transformer:
    """An MTP layer that drafts the main model's prediction from the token alone (fc reads the
    embedding, the block adds nothing), beside a main model whose blocks are scaled by
    `main_scale`: the larger, the more the context matters and the more drafts are rejected."""
    d, m = model.cfg.d_model, model.mtp
    m.fc[...] = jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))])
    m.block.attn.wo[...] = 0 * m.block.attn.wo[...]
    for ffn in (m.block.ffn, getattr(m.block.ffn, "shared_expert", None)):
        if ffn is not None:
            ffn.w2[...] = 0 * ffn.w2[...]
    for blk in model.blocks:
        mixer = getattr(blk, "linear_attn", None) or blk.attn
        mixer.wo[...] = main_scale * mixer.wo[...]
        blk.ffn.w2[...] = main_scale * blk.ffn.w2[...]
    return model


@pytest.mark.parametrize("kind", [dict(NEXT), HYBRID_MOE], ids=["gated_attention", "hybrid_moe"])
def test_speculative_decoding_gives_greedy_tokens_exactly(kind):
    cfg = tiny_model(vocab_size=64, **{**kind, "zero_centered_norm": False})
    model = bigram_drafter(Transformer(cfg, rngs=nnx.Rngs(1)), 2.0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, n).tolist() for n in (5, 9, 17)]
    greedy = decode.generate(model, prompts, max_new_tokens=24)
    out, stats = speculative.generate(model, prompts, max_new_tokens=24, with_stats=True)
    assert out == greedy
    assert 0.2 < stats.acceptance < 0.9, stats  # drafts both accepted and rejected
    assert stats.steps < 23 and stats.tokens == 72
    eos = greedy[1][6]  # stopping mid-way, at a token an accepted pair may hold
    assert speculative.generate(model, prompts, max_new_tokens=24, eos_id=eos) == \
        decode.generate(model, prompts, max_new_tokens=24, eos_id=eos)
    # a random MTP layer drafts badly, and the tokens are still greedy's (the calls above's shapes:
    # their compiled programs)
    rand = Transformer(cfg, rngs=nnx.Rngs(2))
    assert speculative.generate(rand, prompts, max_new_tokens=24) == decode.generate(rand, prompts, max_new_tokens=24)


def test_the_mtp_tensors_map_to_gattn_and_back_bit_for_bit():
    for layout, kind in (("qwen3_next", HYBRID_MOE), ("qwen3_5", dict(NEXT, attention_bias=False))):
        cfg = tiny_model(vocab_size=64, **kind)
        model = perturbed(Transformer(cfg, rngs=nnx.Rngs(0)))
        params = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
        mine = {p: v for p, v in params.items() if p[0] == "mtp"}
        tensors = hf_mtp.from_gattn(params, cfg, layout)
        assert {n: t.shape for n, t in tensors.items()} == hf_mtp.hf_shapes(cfg, layout)
        assert tensors["mtp.fc.weight"].shape == (cfg.d_model, 2 * cfg.d_model)
        assert "mtp.layers.0.self_attn.q_proj.weight" in tensors and "mtp.pre_fc_norm_hidden.weight" in tensors
        back = hf_mtp.to_gattn(tensors, cfg, layout)
        assert set(back) == set(mine)  # every parameter, nothing else
        for p in mine:
            np.testing.assert_array_equal(back[p], mine[p], err_msg=str(p))
        again = hf_mtp.from_gattn(back, cfg, layout)
        assert set(again) == set(tensors)
        for n in tensors:
            np.testing.assert_array_equal(again[n], tensors[n], err_msg=n)
    assert "mtp.layers.0.mlp.shared_expert_gate.weight" in hf_mtp.hf_shapes(tiny_model(**HYBRID_MOE))
    assert hf_mtp.hf_config_fields(cfg, "qwen3_5") == {"mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False}
    assert hf_mtp.mtp_layers({}, ["model.norm.weight"]) == 0 and hf_mtp.mtp_layers({}, list(tensors)) == 1


def test_mtp_refusals_name_the_field():
    with pytest.raises(ConfigError, match="'mtp_layers' = 2 .*0 .*or 1"):
        tiny_model(mtp_layers=2)
    with pytest.raises(ConfigError, match="'mtp_layers' = True"):
        tiny_model(mtp_layers=True)
    with pytest.raises(ConfigError, match="'train.mtp_loss_weight' = 0.5 .*model.mtp_layers = 1"):
        Config(model=tiny_model(), train=TrainConfig(mtp_loss_weight=0.5))
    with pytest.raises(ConfigError, match="'mtp_loss_weight' = -1"):
        TrainConfig(mtp_loss_weight=-1)
    with pytest.raises(ConfigError, match="'model.mtp_layers' = 0"):
        speculative.generate(Transformer(tiny_model(), rngs=nnx.Rngs(0)), [[1, 2]], max_new_tokens=2)
    with pytest.raises(ConversionError, match="mtp.embed_tokens"):
        hf_mtp.mtp_layers({}, ["mtp.fc.weight", "mtp.embed_tokens.weight"])
    with pytest.raises(ConversionError, match="num_nextn_predict_layers = 2"):
        hf_mtp.mtp_layers({"num_nextn_predict_layers": 2}, ["mtp.fc.weight"])
    cfg = tiny_model(**NEXT)
    with pytest.raises(ConversionError, match="tensor mtp.fc.weight is missing"):
        hf_mtp.to_gattn({"mtp.norm.weight": np.zeros(32)}, cfg, "qwen3_next")
    from gattn import generate
    with pytest.raises(ConfigError, match="'--speculative' = 'mtp' .*greedy only"):
        generate.main(["--workdir", "nowhere", "x", "--speculative", "mtp", "--temperature", "0.5"])
    with pytest.raises(ConfigError, match="'--compare-greedy' = True .*only with --speculative mtp"):
        generate.main(["--workdir", "nowhere", "x", "--compare-greedy"])


@pytest.fixture(scope="module")
def mtp_run(tmp_path_factory):
    """A tiny saved run with an MTP layer trained by the MTP loss: 20 steps on Bigram-Backcopy
    (a character tokenizer: nothing to train or read but the run itself), each logged."""
    kind = {k: NEXT[k] for k in ("gate", "qk_norm", "rope_dim")}
    cfg = Config(model=tiny_model(vocab_size=21, mtp_layers=1, **kind),
                 train=TrainConfig(batch_size=4, seq_len=32, steps=20, warmup_steps=2, learning_rate=1e-2,
                                   log_every=1, eval_every=100, checkpoint_every=100, mtp_loss_weight=0.5),
                 data=DataConfig(source="bigram_backcopy", backcopy=BackcopySpec(chars=20, triggers="0|1,2",
                                                                                 offsets="1,3"),
                                 eval_batches=1, eval_batch_size=4))
    run = tmp_path_factory.mktemp("mtp") / "run"
    trainer.train(cfg, run, progress=False)
    return run


def test_generate_speculative_gives_greedy_text_and_reports_acceptance_and_speedup(mtp_run, capsys, monkeypatch):
    """`python -m gattn.generate --speculative mtp` on a saved run: the text of plain greedy
    decoding, the acceptance line on stderr; --compare-greedy adds the speed-up and the check."""
    from gattn import generate

    argv = ["--workdir", str(mtp_run), "--max-tokens", "20", "tea", "a sin ", "lo"]
    assert generate.main(argv) == 0
    plain = capsys.readouterr()
    assert plain.out.count("==> ") == 3 and "speculative" not in plain.err
    assert generate.main([*argv, "--speculative", "mtp"]) == 0
    spec = capsys.readouterr()
    assert spec.out == plain.out
    line = re.search(r"speculative \(mtp\): (\d+) of (\d+) drafts accepted \(([\d.]+)%\), 60 tokens in (\d+) main "
                     r"steps, [\d.]+ tokens/s \(compilation included; the speed-up .*--compare-greedy", spec.err)
    assert line, spec.err
    accepted, drafts, steps = int(line[1]), int(line[2]), int(line[4])
    # each row: one token from the prompt's pass, then one or two a main step (the last may be cut)
    assert drafts <= 3 * steps and 3 + drafts <= 60 <= 3 + drafts + accepted
    assert 0 < accepted < drafts, spec.err  # the trained layer drafts both accepted and rejected tokens
    from gattn.eval import decode

    plain_slots, real = [], decode.generate
    monkeypatch.setattr(decode, "generate", lambda *a, **k: plain_slots.append(k.get("max_len")) or real(*a, **k))
    assert generate.main([*argv, "--speculative", "mtp", "--compare-greedy"]) == 0
    both = capsys.readouterr()
    # plain greedy timed on its own cache (16 prompt slots + 20 new tokens, rounded: 48), not the
    # speculative decoder's 64 (before: the speed-up was inflated by plain greedy's extra slots)
    assert plain_slots == [48] * 4, plain_slots
    assert both.out == plain.out
    assert re.search(r"60 tokens in \d+ main steps, [\d.]+ tokens/s against plain greedy decoding's [\d.]+ tokens/s "
                     r"\(compiled first, medians of 3 calls each\): speed-up [\d.]+x, the same tokens$",
                     both.err.strip()), both.err


def test_bench_decode_speculative_reports_the_speedup_and_acceptance(mtp_run):
    """bench/decode.py --mode speculative on a saved run with data prompts: its JSON. (The shapes of
    the --compare-greedy call above: 3 rows of at most 16 tokens, 20 new ones, a cache of 64 slots,
    so the programs it compiled are read from the session's compilation cache.)"""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "bench" / "decode.py"), "--mode", "speculative", "--workdir",
                           str(mtp_run), "--prompts-from-data", "--batch", "3", "--prompt-len", "12", "--new-tokens",
                           "20", "--repeats", "1"], capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["same_tokens"] is True and out["prompts"] == "data"
    for key in ("speedup", "acceptance_rate", "plain_tokens_per_s", "speculative_tokens_per_s", "tokens_per_main_step"):
        assert isinstance(out[key], (int, float)) and out[key] >= 0, key
    assert 0 <= out["acceptance_rate"] <= 1 and 1 <= out["tokens_per_main_step"] <= 2
