"""The tensors every Hugging Face family shares, both ways: the decoder as Llama and Qwen3 name it
(model.embed_tokens, model.layers.{i}.self_attn.{q,k,v,o}_proj with q_norm / k_norm,
input_layernorm / post_attention_layernorm, mlp.{gate,up,down}_proj or a routed MoE's mlp.gate and
mlp.experts.{j}.*, model.norm, lm_head) <-> gattn's parameters of the unscanned model. What a
family stores differently is its `Packing` (where its gate sits in q_proj, (1 + w) norms); the
tensors only a family has (Gated DeltaNet layers, a shared expert) it maps itself, beside these.
Every Linear weight is [out, in] and gattn stores [in, out], so each is transposed; gattn's GQA
grouping and rotate-half RoPE are Hugging Face's, so no head is permuted."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from gattn.config import ModelConfig
from gattn.interop.files import ConversionError

# gattn's SwiGLU weights <-> the projections of a Hugging Face MLP (transposed); an MoE holds them per
# expert, stacked [E, ...] in gattn and one tensor per expert here
FFN_PROJ = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))


@dataclasses.dataclass(frozen=True)
class Packing:
    """How a family stores what the plain decoder lacks. split_q: (q_proj rows [out, ...], cfg) ->
    (query rows, gate rows), and join_q its inverse; None for a family without a gate.
    one_plus_w: its RMSNorms scale by (1 + w) and store w."""

    name: str
    split_q: Callable | None = None
    join_q: Callable | None = None
    one_plus_w: bool = False

    def norm_offset(self, cfg: ModelConfig) -> float:
        """What to add to a stored norm weight to get gattn's: gattn stores w too when
        model.zero_centered_norm (then the tensors are copied bit for bit), else the factor itself."""
        return float(self.one_plus_w) - float(cfg.zero_centered_norm)

    def split(self, w: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray | None]:
        if cfg.gate is None:
            return w, None
        if self.split_q is None:
            raise ConversionError(f"layout {self.name} has no attention gate (model.gate = {cfg.gate})")
        return self.split_q(w, cfg)

    def join(self, q: np.ndarray, gate: np.ndarray | None, cfg: ModelConfig) -> np.ndarray:
        if gate is None:
            return q
        if self.join_q is None:
            raise ConversionError(f"layout {self.name} has no attention gate (model.gate = {cfg.gate})")
        return self.join_q(q, gate, cfg)

    # The tensor side of the family protocol (gattn/interop/families.py) for a family whose
    # checkpoints are the plain decoder's (Qwen3 / Llama, Qwen3-MoE, the release): its module binds
    # them, `hf_shapes, to_gattn, from_gattn, read_files = PACKING.family_tensors()`.
    def family_tensors(self):
        def shapes(cfg: ModelConfig, layout: str) -> dict[str, tuple[int, ...]]:
            return hf_shapes(cfg)

        def to_params(tensors, cfg: ModelConfig, layout: str):
            return to_gattn(tensors, cfg, self)

        def to_tensors(params, cfg: ModelConfig, layout: str):
            return from_gattn(params, cfg, self)

        def read_files(files, hf: dict, cfg: ModelConfig) -> None:
            """Nothing to set up: the tensors are stored under their own names."""
        return shapes, to_params, to_tensors, read_files


def q_rows(cfg: ModelConfig) -> int:
    """q_proj's rows: the queries, then the gate's (a widened q_proj)."""
    heads, width = cfg.gate.shape(cfg) if cfg.gate is not None else (0, 0)
    return cfg.q_heads * cfg.head_dim + heads * width


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every shared tensor name of `cfg` and its shape (a linear-attention layer's mixer and a
    shared expert are the family's)."""
    d, f, v = cfg.d_model, cfg.ffn_width, cfg.vocab_size
    kv = cfg.kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (v, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        if cfg.layer_type(i) == "full_attention":
            attn = {"q_proj": (q_rows(cfg), d), "k_proj": (kv, d), "v_proj": (kv, d),
                    "o_proj": (d, cfg.q_heads * cfg.head_dim)}
            for name, shape in attn.items():
                out[f"{p}self_attn.{name}.weight"] = shape
                if cfg.attention_bias:
                    out[f"{p}self_attn.{name}.bias"] = shape[:1]
            if cfg.qk_norm:
                out[f"{p}self_attn.q_norm.weight"] = out[f"{p}self_attn.k_norm.weight"] = (cfg.head_dim,)
        out.update({f"{p}input_layernorm.weight": (d,), f"{p}post_attention_layernorm.weight": (d,)})
        if cfg.moe is None:
            out.update({f"{p}mlp.gate_proj.weight": (f, d), f"{p}mlp.up_proj.weight": (f, d),
                        f"{p}mlp.down_proj.weight": (d, f)})
            continue
        e, fe = cfg.moe.num_experts, cfg.moe.expert_width  # a router, then one SwiGLU per expert
        out[f"{p}mlp.gate.weight"] = (e, d)
        for j in range(e):
            out.update({f"{p}mlp.experts.{j}.gate_proj.weight": (fe, d), f"{p}mlp.experts.{j}.up_proj.weight": (fe, d),
                        f"{p}mlp.experts.{j}.down_proj.weight": (d, fe)})
    return out


def by_layer(t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`t` with each layer's tensors together, layer by layer, after the others (the order in which
    to-hf fills its shards), each group in the order it had."""
    def layer(name: str) -> int:
        return int(name.split(".")[2]) if name.startswith("model.layers.") else -1

    return dict(sorted(t.items(), key=lambda item: layer(item[0])))


def _norm_names(cfg: ModelConfig) -> list[str]:
    """The RMSNorms that model.zero_centered_norm concerns (not the Gated DeltaNet's own norm)."""
    names = ["model.norm.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"]
        if cfg.qk_norm and cfg.layer_type(i) == "full_attention":
            names += [f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"]
    return names


def recentre(t: dict[str, np.ndarray], names, offset: float) -> dict[str, np.ndarray]:
    """`t` with `offset` added to the norm weights `names` (a copy; float32)."""
    t = dict(t)
    for name in names:
        t[name] = (t[name].astype(np.float32) + np.float32(offset)).astype(np.float32)
    return t


def to_gattn(tensors: dict[str, np.ndarray], cfg: ModelConfig, packing: Packing) -> dict[tuple, np.ndarray]:
    """The shared tensors -> gattn parameters {path: array} (others in `tensors` are ignored)."""
    offset = packing.norm_offset(cfg)
    t = recentre(tensors, _norm_names(cfg), offset) if offset else tensors
    out = {("embed",): t["model.embed_tokens.weight"], ("final_norm", "scale"): t["model.norm.weight"]}
    if not cfg.tie_embeddings:
        out[("lm_head",)] = t["lm_head.weight"].T
    for i in range(cfg.num_layers):
        p, b = f"model.layers.{i}.", ("blocks", i)
        out.update({b + ("attn_norm", "scale"): t[p + "input_layernorm.weight"],
                    b + ("ffn_norm", "scale"): t[p + "post_attention_layernorm.weight"]})
        if cfg.moe is None:
            out.update({b + ("ffn", ours): t[f"{p}mlp.{theirs}.weight"].T for ours, theirs in FFN_PROJ})
        else:
            out[b + ("ffn", "router")] = t[p + "mlp.gate.weight"].T
            out.update({b + ("ffn", ours): np.stack([t[f"{p}mlp.experts.{j}.{theirs}.weight"].T
                                                     for j in range(cfg.moe.num_experts)])
                        for ours, theirs in FFN_PROJ})
        if cfg.layer_type(i) != "full_attention":
            continue
        a = p + "self_attn."
        q, gate = packing.split(t[a + "q_proj.weight"], cfg)
        out.update({b + ("attn", "wq"): q.T, b + ("attn", "wk"): t[a + "k_proj.weight"].T,
                    b + ("attn", "wv"): t[a + "v_proj.weight"].T, b + ("attn", "wo"): t[a + "o_proj.weight"].T})
        if gate is not None:
            out[b + ("attn", "gate", "w")] = gate.T
        if cfg.attention_bias:
            qb, gb = packing.split(t[a + "q_proj.bias"], cfg)
            out.update({b + ("attn", "bq"): qb, b + ("attn", "bk"): t[a + "k_proj.bias"],
                        b + ("attn", "bv"): t[a + "v_proj.bias"], b + ("attn", "bo"): t[a + "o_proj.bias"]})
            if gb is not None:
                out[b + ("attn", "gate", "b")] = gb
        if cfg.qk_norm:
            out[b + ("attn", "q_norm")] = t[a + "q_norm.weight"]
            out[b + ("attn", "k_norm")] = t[a + "k_norm.weight"]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def from_gattn(params: dict[tuple, np.ndarray], cfg: ModelConfig, packing: Packing) -> dict[str, np.ndarray]:
    """gattn parameters {path: array} -> the shared tensors (other parameters are ignored)."""
    P = params
    out = {"model.embed_tokens.weight": P[("embed",)], "model.norm.weight": P[("final_norm", "scale")]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = P[("lm_head",)].T
    for i in range(cfg.num_layers):
        p, b = f"model.layers.{i}.", ("blocks", i)
        out.update({p + "input_layernorm.weight": P[b + ("attn_norm", "scale")],
                    p + "post_attention_layernorm.weight": P[b + ("ffn_norm", "scale")]})
        if cfg.moe is None:
            out.update({f"{p}mlp.{theirs}.weight": P[b + ("ffn", ours)].T for ours, theirs in FFN_PROJ})
        else:
            out[p + "mlp.gate.weight"] = P[b + ("ffn", "router")].T
            for ours, theirs in FFN_PROJ:
                out.update({f"{p}mlp.experts.{j}.{theirs}.weight": w.T for j, w in enumerate(P[b + ("ffn", ours)])})
        if cfg.layer_type(i) != "full_attention":
            continue
        a = p + "self_attn."
        gate = P[b + ("attn", "gate", "w")].T if cfg.gate is not None else None
        out.update({a + "q_proj.weight": packing.join(P[b + ("attn", "wq")].T, gate, cfg),
                    a + "k_proj.weight": P[b + ("attn", "wk")].T, a + "v_proj.weight": P[b + ("attn", "wv")].T,
                    a + "o_proj.weight": P[b + ("attn", "wo")].T})
        if cfg.attention_bias:
            gb = P[b + ("attn", "gate", "b")] if cfg.gate is not None else None
            out.update({a + "q_proj.bias": packing.join(P[b + ("attn", "bq")], gb, cfg),
                        a + "k_proj.bias": P[b + ("attn", "bk")], a + "v_proj.bias": P[b + ("attn", "bv")],
                        a + "o_proj.bias": P[b + ("attn", "bo")]})
        if cfg.qk_norm:
            out[a + "q_norm.weight"] = P[b + ("attn", "q_norm")]
            out[a + "k_norm.weight"] = P[b + ("attn", "k_norm")]
    offset = packing.norm_offset(cfg)
    if offset:
        out = recentre(out, _norm_names(cfg), -offset)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}
