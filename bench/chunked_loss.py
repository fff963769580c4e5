"""Memory and time of the loss + gradient with the plain LM-head cross-entropy and with
exec.loss_chunk (the logits computed a chunk of positions at a time, recomputed in the backward).

    python bench/chunked_loss.py [--rows 4 --seq 512 --vocab 32768 --d-model 128 --chunks 64,256]
                                 [--reps 3] [--tpu v5p:2x2x1 --tpu-rows-per-chip 4 --tpu-chunk 512]

Prints JSON. "cpu": a one-layer model where the logits dominate; for each loss_chunk (0 = plain)
the compiled temporary bytes of jax.jit(value_and_grad(lm_loss)) (memory_analysis) and the
median step time. "tpu" (when libtpu is installed; it only compiles here): the trainer's real
train step of dense_1p7b cut to one layer, at its sequence 4096 and vocabulary 151,936, compiled
for --tpu with every chip a data shard, plain and chunked: per-chip bytes (bench/aot_train_step.py;
two compiles of a few minutes each on a CPU host).

The chunked loss recomputes each chunk's logits in the backward pass: the LM head costs 4 matmuls
of N x D x V instead of 3.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gattn.cli import ensure_malloc_tunables, keep_jax_off_absent_tpu  # noqa: E402

keep_jax_off_absent_tpu()  # libtpu is only a compiler here
ensure_malloc_tunables()  # the plain step's logits are served by mmap without it (docs/performance.md)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from gattn import cli  # noqa: E402
from gattn.config import ExecConfig, ModelConfig  # noqa: E402
from gattn.model.transformer import Transformer, with_exec  # noqa: E402
from gattn.train.loss import lm_loss  # noqa: E402

MIB = 2**20


def cpu_case(rows: int, seq: int, vocab: int, d_model: int, chunks: list[int], reps: int) -> dict:
    cfg = ModelConfig(vocab_size=vocab, d_model=d_model, num_layers=1, q_heads=2, kv_heads=2,
                      head_dim=d_model // 2, d_ff=2 * d_model)
    base = Transformer(cfg, ExecConfig(), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (rows, seq + 1), 0, vocab)
    out = {"rows": rows, "seq": seq, "vocab": vocab, "d_model": d_model,
           "logits_mib": round(rows * seq * vocab * 4 / MIB, 1), "by_loss_chunk": {}}
    for chunk in [0, *chunks]:
        graphdef, params = nnx.split(with_exec(base, dataclasses.replace(base.ex, loss_chunk=chunk)), nnx.Param)
        step = jax.jit(jax.value_and_grad(lambda p, t, g=graphdef: lm_loss(nnx.merge(g, p), t)))
        compiled = step.lower(params, tokens).compile()
        loss, _ = jax.block_until_ready(compiled(params, tokens))
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(compiled(params, tokens))
            times.append(time.perf_counter() - t)
        out["by_loss_chunk"][chunk] = {"temp_mib": round(compiled.memory_analysis().temp_size_in_bytes / MIB, 1),
                                       "step_s": round(statistics.median(times), 3), "loss": float(loss)}
    return out


def tpu_case(topology: str, rows_per_chip: int, chunk: int) -> dict:
    """The trainer's step of dense_1p7b (one layer) compiled for `topology`, plain and chunked."""
    spec = importlib.util.spec_from_file_location("aot_train_step", Path(__file__).with_name("aot_train_step.py"))
    aot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(aot)
    from jax.experimental import topologies  # noqa: PLC0415
    chips = len(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)
    out = {"preset": "dense_1p7b", "num_layers": 1, "topology": topology, "mesh": [chips, 1, 1],
           "rows_per_chip": rows_per_chip, "seq_len": 4096, "vocab": 151_936,
           "logits_gib_per_chip": round(rows_per_chip * 4096 * 151_936 * 4 / 2**30, 2), "by_loss_chunk": {}}
    for c in (0, chunk):
        cfg = cli.load("dense_1p7b", ["model.num_layers=1", f"exec.loss_chunk={c}"])
        compiled, kind, _, seconds, _ = aot.compile_step(cfg, topology, (chips, 1, 1), rows_per_chip)
        r = aot.report(compiled, kind)
        out["device"] = kind
        # (cost_analysis counts a loop's body once, so its FLOPs would hide the chunked loop's work)
        out["by_loss_chunk"][c] = {"temp_gib": round(r["per_device_bytes"]["temp"] / 2**30, 2),
                                   "total_gib": r["per_device_gib"], "compile_s": round(seconds, 1)}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--chunks", default="64,256", help="loss_chunk values to compare with 0 (plain)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tpu", default="v5p:2x2x1", help="a TPU topology to AOT-compile for ('' = skip)")
    ap.add_argument("--tpu-rows-per-chip", type=int, default=4)
    ap.add_argument("--tpu-chunk", type=int, default=512)
    args = ap.parse_args(argv)
    out = {"cpu": cpu_case(args.rows, args.seq, args.vocab, args.d_model,
                           [int(c) for c in args.chunks.split(",")], args.reps)}
    if args.tpu and importlib.util.find_spec("libtpu"):
        out["tpu"] = tpu_case(args.tpu, args.tpu_rows_per_chip, args.tpu_chunk)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
