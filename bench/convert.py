"""Hugging Face conversion: time, throughput and logit parity at a size closer to the released models.

    python bench/convert.py [--layers 12] [--d-model 768] [--heads 12] [--kv-heads 4] [--vocab 32000]
                            [--seq 128] [--models qwen3,qwen3_next]

Needs the test extra (torch, transformers). For each model: a random transformers model in float32
(Qwen3ForCausalLM, the baseline; Qwen3NextForCausalLM with full-attention layers, dense MLPs and
partial rotary, the elementwise-gated layout transformers ships), saved with save_pretrained, then
prints JSON: its parameters and safetensors size, `from-hf` and `to-hf` seconds and MB/s, the
largest logit difference between transformers and gattn on 2 x --seq tokens (and the logits'
scale), whether the greedy next tokens agree, the forward time of each (gattn jitted, after
compilation), and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gattn.cli import ensure_malloc_tunables, keep_jax_off_absent_tpu  # noqa: E402

keep_jax_off_absent_tpu()  # no libtpu start-up errors on a CPU host (libtpu is only a compiler here)
ensure_malloc_tunables()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from flax import nnx  # noqa: E402
from tokenizers import Tokenizer, models  # noqa: E402

from gattn.interop import convert  # noqa: E402
from gattn.train import rundir  # noqa: E402


def build(kind: str, args) -> torch.nn.Module:
    dims = dict(vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=args.d_model * 8 // 3 // 64 * 64,
                num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                head_dim=args.d_model // args.heads, max_position_embeddings=4096, attn_implementation="eager")
    if kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**dims))
    else:
        cfg = transformers.Qwen3NextConfig(**dims, layer_types=["full_attention"] * args.layers,
                                           mlp_only_layers=list(range(args.layers)), num_experts=0,
                                           rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                            "partial_rotary_factor": 0.25})
        model = transformers.Qwen3NextForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every weight random, norms around their identity value
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            center = (0.0 if kind == "qwen3_next" else 1.0) if "norm" in name else 0.0
            p.copy_(center + (0.2 if "norm" in name else 0.02) * noise)
    return model.eval()


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench(kind: str, args, root: Path) -> dict:
    model = build(kind, args)
    src = root / f"{kind}_hf"
    model.save_pretrained(src)
    Tokenizer(models.BPE()).save(str(src / "tokenizer.json"))  # (conversion copies it; unused here)
    size_mb = sum(f.stat().st_size for f in src.glob("*.safetensors")) / 2**20
    tokens = np.random.default_rng(0).integers(0, args.vocab, size=(2, args.seq))

    t = time.perf_counter()
    convert.from_hf(src, root / f"{kind}_run")
    from_s = time.perf_counter() - t
    t = time.perf_counter()
    convert.to_hf(root / f"{kind}_run", root / f"{kind}_back")
    to_s = time.perf_counter() - t

    with torch.no_grad():
        model(torch.tensor(tokens[:, :8]))  # warm up
        t = time.perf_counter()
        ref = model(torch.tensor(tokens)).logits.numpy()
        torch_s = time.perf_counter() - t
    _, ours_model, _ = rundir.load(root / f"{kind}_run")
    graphdef, state = nnx.split(ours_model)
    fwd = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x))
    fwd(state, jnp.asarray(tokens)).block_until_ready()  # compile
    t = time.perf_counter()
    ours = np.asarray(fwd(state, jnp.asarray(tokens)).block_until_ready())
    gattn_s = time.perf_counter() - t
    n = sum(p.numel() for p in model.parameters())
    return {"model": kind, "params_m": round(n / 1e6, 1), "safetensors_mb": round(size_mb, 1),
            "from_hf_s": round(from_s, 2), "from_hf_mb_per_s": round(size_mb / from_s, 1),
            "to_hf_s": round(to_s, 2), "to_hf_mb_per_s": round(size_mb / to_s, 1),
            "max_abs_logit_diff": float(np.abs(ours - ref).max()), "logit_scale": float(np.abs(ref).max()),
            "greedy_agreement": float((ours.argmax(-1) == ref.argmax(-1)).mean()),
            "forward_s": {"transformers": round(torch_s, 3), "gattn_jit": round(gattn_s, 3)},
            "peak_rss_mb": round(peak_rss_mb())}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--models", default="qwen3,qwen3_next")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    out = {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
           "results": []}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.models.split(","):
            out["results"].append(bench(kind, args, Path(tmp)))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
