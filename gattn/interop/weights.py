"""Hugging Face tensors <-> gattn parameters, both ways: the files a model folder keeps them in
(safetensors or pytorch_model.bin), every tensor name and shape of a layout, and the mapping
(transposes, the gate packed into q_proj, Qwen3-Next's and Qwen3.5's 1 + w norms). The layouts are described
in gattn/interop/convert.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from gattn.config import ModelConfig
from gattn.interop.hf_config import NEXT_FAMILY  # (q_proj rows [query | gate] per head, (1 + w) norms)

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some exports carry


# Here, in the lowest module that raises it; convert.py imports it (and read_json) from here.
class ConversionError(ValueError):
    """A Hugging Face folder or a gattn run that cannot be converted; names the file, tensor or field."""


def read_json(path: Path, text: str | bytes | None = None) -> dict:
    """The JSON object in file `path` (or in `text`, read from it): anything else is one line
    naming the file and where the JSON breaks."""
    try:
        data = json.loads(path.read_bytes() if text is None else text)
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise ConversionError(f"{path}: not valid JSON (not UTF-8 at byte offset {e.start})") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: expected a JSON object, not a {type(data).__name__}")
    return data


# --------------------------------------------------------------------------- tensors on disk


class TensorFiles:
    """The tensors of a model folder: safetensors (one file or an index of shards) or
    pytorch_model.bin files (read with torch, if installed). Nothing is read until `get`."""

    def __init__(self, src: Path):
        self.src, self.where = src, {}
        index = next((src / n for n in ("model.safetensors.index.json", "pytorch_model.bin.index.json")
                      if (src / n).is_file()), None)
        if index is not None:
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConversionError(f"{index}: no 'weight_map' object (tensor name -> shard file)")
        else:
            single = next((n for n in ("model.safetensors", "pytorch_model.bin") if (src / n).is_file()), None)
            if single is None:
                raise ConversionError(f"{src}: no model.safetensors, pytorch_model.bin or index of shards")
            weight_map = {name: single for name in self._names(src / single)}
        for name, shard in weight_map.items():
            if not (src / shard).is_file():
                raise ConversionError(f"shard {shard} (holding tensor {name}) is missing from {src}")
        self.where = weight_map
        self._open, self._stored, self._derived, self._fused = {}, {}, {}, {}

    @staticmethod
    def _names(path: Path) -> list[str]:
        if path.suffix == ".safetensors":
            from safetensors import safe_open  # noqa: PLC0415

            with safe_open(path, framework="flax") as f:
                return list(f.keys())
        return list(_torch_load(path))

    def _file(self, shard: str):
        if shard not in self._open:
            path = self.src / shard
            if path.suffix == ".safetensors":
                from safetensors import safe_open  # noqa: PLC0415

                self._open[shard] = safe_open(path, framework="flax")
            else:
                self._open[shard] = _torch_load(path)
        return self._open[shard]

    def names(self) -> list[str]:
        return list(self.where)

    def drop(self, prefix: str) -> list[str]:
        """Leaves out the tensors whose names start with `prefix` (a vision tower); returns their names."""
        dropped = [n for n in self.where if n.startswith(prefix)]
        for name in dropped:
            del self.where[name]
        return dropped

    def rename(self, old: str, new: str) -> None:
        """Reads the tensors stored as `old` + rest under the names `new` + rest (a multimodal
        checkpoint's language model, under its own prefix beside a vision tower)."""
        self._stored = {new + n[len(old):]: n for n in self.where if n.startswith(old)}
        self.where = {(new + n[len(old):] if n.startswith(old) else n): shard for n, shard in self.where.items()}

    def unfuse_experts(self, num_experts: int, width: int, d_model: int) -> None:
        """Reads each layer's experts stored fused, as Qwen3.5-MoE's released files store them
        (`mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj` [E, D, F]), under the
        per-expert names transformers' save_pretrained writes (`mlp.experts.{j}.gate_proj.weight`, ...)."""
        for fused in [n for n in self.where if n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]:
            shard, base = self.where.pop(fused), fused.rsplit(".", 1)[0]
            up = fused.endswith("gate_up_proj")
            shape = (num_experts, 2 * width, d_model) if up else (num_experts, d_model, width)
            parts = (("gate_proj", slice(0, width)), ("up_proj", slice(width, None))) if up else (("down_proj", slice(None)),)
            for j in range(num_experts):
                for name, rows in parts:
                    self.where[f"{base}.{j}.{name}.weight"] = shard
                    self._derived[f"{base}.{j}.{name}.weight"] = (fused, shard, shape, j, rows)

    def get(self, name: str) -> np.ndarray:
        """The tensor in float32 (bf16 and fp16 widen exactly)."""
        if name in self._derived:
            fused, shard, shape, j, rows = self._derived[name]
            return self._read_fused(fused, shard, shape)[j, rows]
        return self._read(self._stored.get(name, name), self.where[name])

    def _read(self, stored: str, shard: str) -> np.ndarray:
        f = self._file(shard)
        if isinstance(f, dict):
            return f[stored].float().numpy()
        return np.asarray(f.get_tensor(stored), dtype=np.float32)

    def _read_fused(self, fused: str, shard: str, shape: tuple[int, ...]) -> np.ndarray:
        """A fused expert tensor, checked, and kept while its slices are read (the layer's two)."""
        if fused not in self._fused:
            if len(self._fused) >= 2:
                self._fused.pop(next(iter(self._fused)))
            self._fused[fused] = self._read(self._stored.get(fused, fused), shard)
            if self._fused[fused].shape != shape:
                raise ConversionError(f"tensor {self._stored.get(fused, fused)} has shape "
                                      f"{self._fused[fused].shape}; config.json implies {shape}")
        return self._fused[fused]


def _torch_load(path: Path) -> dict:
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        raise ConversionError(f"{path} is a PyTorch pickle: install torch to read it, or save the model "
                              "with safetensors (save_pretrained(..., safe_serialization=True))") from None
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


# --------------------------------------------------------------------------- tensor layouts


def _split_q(w: np.ndarray, cfg: ModelConfig, layout: str) -> tuple[np.ndarray, np.ndarray | None]:
    """q_proj rows ([out] + rest) -> (W_Q rows [H*K, ...], gate rows [H*width, ...] or None)."""
    g, hq, hk, k = cfg.gate, cfg.q_heads, cfg.kv_heads, cfg.head_dim
    if g is None:
        return w, None
    rest = w.shape[1:]
    if layout in NEXT_FAMILY:
        per_head = w.reshape(hq, 2 * k, *rest)
        return per_head[:, :k].reshape(hq * k, *rest), per_head[:, k:].reshape(hq * k, *rest)
    per_group = w.reshape(hk, -1, *rest)  # release: [queries of the G heads | their gates]
    q_rows = cfg.group_size * k
    return per_group[:, :q_rows].reshape(hq * k, *rest), per_group[:, q_rows:].reshape(-1, *rest)


def _join_q(q: np.ndarray, gate: np.ndarray | None, cfg: ModelConfig, layout: str) -> np.ndarray:
    """The inverse of `_split_q`. In qwen3_next and qwen3_5 a headwise gate is written
    elementwise, each head's row repeated over its head_dim rows: the same gate values, so the
    same logits."""
    hq, hk, k = cfg.q_heads, cfg.kv_heads, cfg.head_dim
    if gate is None:
        return q
    rest = q.shape[1:]
    if layout in NEXT_FAMILY:
        per_head = gate.reshape(hq, -1, *rest)
        per_head = np.repeat(per_head, k // per_head.shape[1], axis=1)
        both = np.concatenate([q.reshape(hq, k, *rest), per_head], axis=1)
    else:
        both = np.concatenate([q.reshape(hk, -1, *rest), gate.reshape(hk, -1, *rest)], axis=1)
    return both.reshape(-1, *rest)


def _q_rows(cfg: ModelConfig) -> int:
    heads, width = cfg.gate.shape(cfg) if cfg.gate is not None else (0, 0)
    return cfg.q_heads * cfg.head_dim + heads * width


def hf_shapes(cfg: ModelConfig, layout: str = "qwen3_next") -> dict[str, tuple[int, ...]]:
    """Every tensor name of the Hugging Face model in `layout` and its shape (the layout names
    only the GDN layers' packing: qwen3_5's, or Qwen3-Next's for every other)."""
    d, f, v = cfg.d_model, cfg.ffn_width, cfg.vocab_size
    kv = cfg.kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (v, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        if cfg.layer_type(i) == "linear_attention":
            out.update({f"{p}linear_attn.{name}": shape for name, shape in _gdn_shapes(cfg, layout).items()})
        else:
            attn = {"q_proj": (_q_rows(cfg), d), "k_proj": (kv, d), "v_proj": (kv, d),
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
        e, fe = cfg.moe.num_experts, cfg.moe.expert_width  # Qwen3-MoE: a router, then one SwiGLU per expert
        out[f"{p}mlp.gate.weight"] = (e, d)
        for j in range(e):
            out.update({f"{p}mlp.experts.{j}.gate_proj.weight": (fe, d), f"{p}mlp.experts.{j}.up_proj.weight": (fe, d),
                        f"{p}mlp.experts.{j}.down_proj.weight": (d, fe)})
        if fs := cfg.moe.shared_expert_width:  # Qwen3-Next: and a shared SwiGLU, scaled by a sigmoid gate
            out.update({f"{p}mlp.shared_expert.gate_proj.weight": (fs, d), f"{p}mlp.shared_expert.up_proj.weight": (fs, d),
                        f"{p}mlp.shared_expert.down_proj.weight": (d, fs), f"{p}mlp.shared_expert_gate.weight": (1, d)})
    return out


def _gdn_shapes(cfg: ModelConfig, layout: str) -> dict[str, tuple[int, ...]]:
    """The tensors of one Gated DeltaNet layer in `layout` and their shapes."""
    from gattn.model import gdn  # noqa: PLC0415 (jax; this module stays numpy-only to import)
    return gdn.hf_shapes(gdn.GDNSpec.of(cfg), _packing(layout))


def _packing(layout: str) -> str:
    """How the GDN layers' projections are packed in `layout` (gattn/model/gdn.py)."""
    return "qwen3_5" if layout == "qwen3_5" else "qwen3_next"


# gattn's SwiGLU weights <-> the projections of a Hugging Face MLP (transposed); an MoE holds them per
# expert, stacked [E, ...] in gattn and one tensor per expert in Qwen3-MoE
_FFN_PROJ = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))


def _norm_names(cfg: ModelConfig) -> list[str]:
    """The RMSNorms that model.zero_centered_norm concerns (not the Gated DeltaNet's own norm)."""
    names = ["model.norm.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"]
        if cfg.qk_norm and cfg.layer_type(i) == "full_attention":
            names += [f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"]
    return names


def _recentre(t: dict[str, np.ndarray], cfg: ModelConfig, offset: float) -> dict[str, np.ndarray]:
    """`t` with `offset` added to every norm weight of `_norm_names` (a copy; float32)."""
    t = dict(t)
    for name in _norm_names(cfg):
        t[name] = (t[name].astype(np.float32) + np.float32(offset)).astype(np.float32)
    return t


def _norm_offset(cfg: ModelConfig, layout: str) -> float:
    """What to add to a Hugging Face norm weight to get gattn's: qwen3_next and qwen3_5 store w
    of a (1 + w) norm; gattn stores w too when model.zero_centered_norm (then the tensors are
    copied bit for bit), else the factor itself."""
    return float(layout in NEXT_FAMILY) - float(cfg.zero_centered_norm)


def to_gattn(tensors: dict[str, np.ndarray], cfg: ModelConfig, layout: str) -> dict[tuple, np.ndarray]:
    """Hugging Face tensors -> gattn parameters {path: array} of the unscanned model."""
    t = _recentre(tensors, cfg, _norm_offset(cfg, layout)) if _norm_offset(cfg, layout) else dict(tensors)
    out = {("embed",): t["model.embed_tokens.weight"], ("final_norm", "scale"): t["model.norm.weight"]}
    if not cfg.tie_embeddings:
        out[("lm_head",)] = t["lm_head.weight"].T
    for i in range(cfg.num_layers):
        p, b = f"model.layers.{i}.", ("blocks", i)
        out.update({b + ("attn_norm", "scale"): t[p + "input_layernorm.weight"],
                    b + ("ffn_norm", "scale"): t[p + "post_attention_layernorm.weight"]})
        if cfg.moe is None:
            out.update({b + ("ffn", ours): t[f"{p}mlp.{theirs}.weight"].T for ours, theirs in _FFN_PROJ})
        else:
            out[b + ("ffn", "router")] = t[p + "mlp.gate.weight"].T
            out.update({b + ("ffn", ours): np.stack([t[f"{p}mlp.experts.{j}.{theirs}.weight"].T
                                                     for j in range(cfg.moe.num_experts)])
                        for ours, theirs in _FFN_PROJ})
            if cfg.moe.shared_expert_width:
                out.update({b + ("ffn", "shared_expert", ours): t[f"{p}mlp.shared_expert.{theirs}.weight"].T
                            for ours, theirs in _FFN_PROJ})
                out[b + ("ffn", "shared_gate")] = t[p + "mlp.shared_expert_gate.weight"].T
        if cfg.layer_type(i) == "linear_attention":
            from gattn.model import gdn  # noqa: PLC0415
            layer = gdn.from_hf(t, p + "linear_attn.", gdn.GDNSpec.of(cfg), _packing(layout))
            out.update({b + ("linear_attn",) + path: value for path, value in layer.items()})
            continue
        a = p + "self_attn."
        q, gate = _split_q(t[a + "q_proj.weight"], cfg, layout)
        out.update({b + ("attn", "wq"): q.T, b + ("attn", "wk"): t[a + "k_proj.weight"].T,
                    b + ("attn", "wv"): t[a + "v_proj.weight"].T, b + ("attn", "wo"): t[a + "o_proj.weight"].T})
        if gate is not None:
            out[b + ("attn", "gate", "w")] = gate.T
        if cfg.attention_bias:
            qb, gb = _split_q(t[a + "q_proj.bias"], cfg, layout)
            out.update({b + ("attn", "bq"): qb, b + ("attn", "bk"): t[a + "k_proj.bias"],
                        b + ("attn", "bv"): t[a + "v_proj.bias"], b + ("attn", "bo"): t[a + "o_proj.bias"]})
            if gb is not None:
                out[b + ("attn", "gate", "b")] = gb
        if cfg.qk_norm:
            out[b + ("attn", "q_norm")] = t[a + "q_norm.weight"]
            out[b + ("attn", "k_norm")] = t[a + "k_norm.weight"]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def from_gattn(params: dict[tuple, np.ndarray], cfg: ModelConfig, layout: str) -> dict[str, np.ndarray]:
    """gattn parameters {path: array} of the unscanned model -> Hugging Face tensors."""
    P = params
    out = {"model.embed_tokens.weight": P[("embed",)], "model.norm.weight": P[("final_norm", "scale")]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = P[("lm_head",)].T
    for i in range(cfg.num_layers):
        p, b = f"model.layers.{i}.", ("blocks", i)
        out.update({p + "input_layernorm.weight": P[b + ("attn_norm", "scale")],
                    p + "post_attention_layernorm.weight": P[b + ("ffn_norm", "scale")]})
        if cfg.moe is None:
            out.update({f"{p}mlp.{theirs}.weight": P[b + ("ffn", ours)].T for ours, theirs in _FFN_PROJ})
        else:
            out[p + "mlp.gate.weight"] = P[b + ("ffn", "router")].T
            for ours, theirs in _FFN_PROJ:
                out.update({f"{p}mlp.experts.{j}.{theirs}.weight": w.T for j, w in enumerate(P[b + ("ffn", ours)])})
            if cfg.moe.shared_expert_width:
                out.update({f"{p}mlp.shared_expert.{theirs}.weight": P[b + ("ffn", "shared_expert", ours)].T
                            for ours, theirs in _FFN_PROJ})
                out[p + "mlp.shared_expert_gate.weight"] = P[b + ("ffn", "shared_gate")].T
        if cfg.layer_type(i) == "linear_attention":
            from gattn.model import gdn  # noqa: PLC0415
            layer = {path[len(b) + 1:]: value for path, value in P.items() if path[:len(b) + 1] == b + ("linear_attn",)}
            out.update(gdn.to_hf(layer, p + "linear_attn.", gdn.GDNSpec.of(cfg), _packing(layout)))
            continue
        a = p + "self_attn."
        gate = P[b + ("attn", "gate", "w")].T if cfg.gate is not None else None
        out.update({a + "q_proj.weight": _join_q(P[b + ("attn", "wq")].T, gate, cfg, layout),
                    a + "k_proj.weight": P[b + ("attn", "wk")].T, a + "v_proj.weight": P[b + ("attn", "wv")].T,
                    a + "o_proj.weight": P[b + ("attn", "wo")].T})
        if cfg.attention_bias:
            gb = P[b + ("attn", "gate", "b")] if cfg.gate is not None else None
            out.update({a + "q_proj.bias": _join_q(P[b + ("attn", "bq")], gb, cfg, layout),
                        a + "k_proj.bias": P[b + ("attn", "bk")], a + "v_proj.bias": P[b + ("attn", "bv")],
                        a + "o_proj.bias": P[b + ("attn", "bo")]})
        if cfg.qk_norm:
            out[a + "q_norm.weight"] = P[b + ("attn", "q_norm")]
            out[a + "k_norm.weight"] = P[b + ("attn", "k_norm")]
    if _norm_offset(cfg, layout):
        out = _recentre(out, cfg, -_norm_offset(cfg, layout))
    return {k: np.ascontiguousarray(v) for k, v in out.items()}
