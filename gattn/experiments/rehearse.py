"""A dress rehearsal of a preset before a slice is spent on it: the run as configured, shrunk only
where a CPU must, on local processes with the preset's chip count.

    python -m gattn.rehearse PRESET --processes P --local-devices D [--variant V] [--workdir DIR]
                             [--config.FIELD=VALUE ...]

Kept as the preset has them: the mesh axes, the global batch (train.batch_size), the eval batch,
train.microbatches, every exec setting (the Pallas kernels run in interpret mode on CPU) and the
order of events. Shrunk, and printed field by field: width, depth, vocabulary, experts, sequence
length, and the step counts (steps, warmup, the eval and checkpoint cadences). The chips are
P processes x D CPU devices, joined with jax.distributed (gloo), as `python -m gattn.launch` runs them.

Stages, each ending in one line "STAGE: ok" or "STAGE: error ...":
  config      the shrunk config builds and the mesh fits P x D chips
  train       P x D processes train from scratch (validation and a checkpoint on the way)
  validation  metrics.jsonl holds held-out losses from the run (the eval step on the mesh)
  checkpoint  a checkpoint was saved before the stop
  SIGTERM     SIGTERM to the launcher: every process saves the current step and exits 0
  resume      the run resumes on another process layout (P' x D', same chips) and completes
  eval        eval.py on the finished run (one process, P x D devices)
Logs: WORKDIR/rehearsal/STAGE.log. Exit status 0 only if every stage is ok.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gattn import cli
from gattn.config import ConfigError, flat_fields
from gattn.kernels.standin import ENV as STANDIN_ENV

# What a CPU can run: the shrinkable fields and their rehearsal values.
SMALL = {"model.d_model": 64, "model.num_layers": 2, "model.vocab_size": 512, "model.head_dim": 8,
         "model.d_ff": 128, "model.moe.expert_width": 32, "train.seq_len": 64}
STEPS, WARMUP, EVAL_EVERY, CHECKPOINT_EVERY = 8, 2, 2, 2
STANDIN_NOTE = ("exec.attention_impl=pallas and exec.grouped_matmul=megablox keep their shard_map and buffers; their "
                "bodies run the XLA reference on CPU (gattn/kernels/standin.py; --interpret runs the real "
                "interpret mode, minutes per step)")
STAGES = ("config", "train", "validation", "checkpoint", "SIGTERM", "resume", "eval")
ROOT = Path(__file__).resolve().parents[2]


def shrink(preset: str, variant: str | None, overrides: list[str], chips: int) -> tuple[list[str], list[str]]:
    """(overrides that shrink `preset`, lines saying what changed: field, preset value -> rehearsal
    value). Experts shrink to 2 per expert-axis device (at least top_k)."""
    cfg = cli.load(preset, overrides, variant=variant)
    before = flat_fields(cfg)
    small = dict(SMALL)
    if cfg.model.moe is not None:
        moe = cfg.model.moe
        experts = max(2 * cfg.mesh.expert, moe.top_k)
        experts += -experts % cfg.mesh.expert  # experts split evenly over the expert axis
        small["model.moe.num_experts"] = experts
        if moe.micro_batches > 1:
            small.pop("model.moe.micro_batches", None)
    else:
        small.pop("model.moe.expert_width")
    if cfg.model.hybrid:  # one period of the layer pattern (3 Gated DeltaNet : 1 attention), small heads
        la, period = cfg.model.linear_attention, cfg.model.layer_period
        small.update({"model.num_layers": period, "model.layer_types": tuple(cfg.model.layer_types[:period]),
                      "model.linear_attention.num_k_heads": 2,
                      "model.linear_attention.num_v_heads": 2 * la.num_v_heads // la.num_k_heads,
                      "model.linear_attention.head_k_dim": 8, "model.linear_attention.head_v_dim": 8})
    if cfg.model.rope_dim:  # RoPE on the same share of the smaller heads (Qwen3.5's quarter)
        share = cfg.model.rope_dim / cfg.model.head_dim
        small["model.rope_dim"] = max(2, 2 * round(share * SMALL["model.head_dim"] / 2))
    ctx = cfg.mesh.context
    if ctx > 1:  # 2 x context chunks of at least the conv's left context (and of 64 tokens in all)
        least = cfg.model.linear_attention.conv_kernel - 1 if cfg.model.hybrid else 1
        small["train.seq_len"] = 2 * ctx * max(least, -(-SMALL["train.seq_len"] // (2 * ctx)))
    peak, floor, warmup = cfg.train.schedule  # (the preset's own, through lr_preset)
    small.update({"train.steps": STEPS, "train.eval_every": EVAL_EVERY, "train.checkpoint_every": CHECKPOINT_EVERY,
                  "train.log_every": 1, "train.keep_checkpoints": STEPS})
    if cfg.train.lr_preset:  # the preset's warmup is longer than the rehearsal: its values, spelled out
        small.update({"train.lr_preset": "", "train.learning_rate": peak, "train.min_learning_rate": floor})
    small["train.warmup_steps"] = WARMUP
    changed = {k: v for k, v in small.items() if before.get(k) != v}  # (against the fields as set)
    shown = {**before, **dict(zip(("train.learning_rate", "train.min_learning_rate", "train.warmup_steps"),
                                  (peak, floor, warmup)))}  # (the schedule in use)
    lines = [f"{k}: {shown.get(k)!r} -> {v!r}" for k, v in changed.items()]
    return [f"{k}={v}" for k, v in changed.items()], lines


def _run(command: list[str], log: Path, timeout: float, env=None, until=None) -> tuple[int | None, str]:
    """Runs `command` (output to `log`); `until(proc)` may act while it runs. (status, last lines)."""
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                start_new_session=True)
        deadline = time.time() + timeout
        while proc.poll() is None and time.time() < deadline:
            if until is not None:
                until(proc)
            time.sleep(0.5)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None, f"timed out after {timeout:.0f} s (log: {log})"
    return proc.returncode, log.read_text()


def _error(text: str, log: Path) -> str:
    """The line that says what went wrong: the last that names an error, else the last line."""
    lines = [ln.split("] ", 1)[-1].strip() for ln in text.splitlines() if ln.strip()]
    named = [ln for ln in lines if "error" in ln.lower() or "failed" in ln.lower()]
    return f"{(named or lines or ['no output'])[-1]} (log: {log})"


def _checkpoints(workdir: Path) -> list[int]:
    folder = workdir / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


def other_layout(processes: int, devices: int) -> tuple[int, int]:
    """Another (processes, devices per process) with the same chips, for the resume."""
    if processes > 1 and processes % 2 == 0:
        return processes // 2, devices * 2
    if devices % 2 == 0:
        return processes * 2, devices // 2
    return processes * devices, 1 if processes == 1 and devices > 1 else (processes, devices)


def rehearse(preset: str, processes: int, devices: int, *, variant: str | None = None,
             overrides: list[str] = (), workdir: Path | None = None, timeout: float = 1800.0,
             interpret: bool = False) -> dict[str, str]:
    """Runs the stages; {stage: "ok" or the error}. Prints what it shrank and each stage's line.
    `interpret`: the Pallas kernels in interpret mode instead of their XLA stand-ins."""
    results: dict[str, str] = {}
    env = {**os.environ, "JAX_PLATFORMS": "cpu", STANDIN_ENV: "0" if interpret else "1"}
    workdir = Path(workdir or tempfile.mkdtemp(prefix=f"rehearse-{preset}-"))
    logs = workdir / "rehearsal"
    logs.mkdir(parents=True, exist_ok=True)
    run = workdir / "run"
    chips = processes * devices
    try:
        small, lines = shrink(preset, variant, list(overrides), chips)
        cfg = cli.load(preset, list(overrides) + small, variant=variant)
        import jax  # noqa: PLC0415 (JAX only past the config)

        from gattn.model.sharding import AXES, check_batch, mesh_shape  # noqa: PLC0415

        shape = mesh_shape(cfg.mesh, chips)
        check_batch(cfg.train.batch_size, cfg.train.microbatches, jax.sharding.AbstractMesh(shape, AXES))
        print(f"rehearsing {preset} on {processes} x {devices} = {chips} CPU devices, mesh (data, fsdp, context, expert, model) "
              f"= {shape}, global batch {cfg.train.batch_size}, eval batch {cfg.data.eval_batch_size}, "
              f"microbatches {cfg.train.microbatches}; shrunk:", flush=True)
        for line in lines:
            print(f"  {line}", flush=True)
        if not interpret and (cfg.exec.attention_impl == "pallas" or cfg.exec.grouped_matmul == "megablox"):
            print(f"  {STANDIN_NOTE}", flush=True)
        results["config"] = "ok"
    except (ConfigError, ValueError) as e:
        results["config"] = f"error: {e}"
        return _report(results)
    args = ["--config", preset, *(["--variant", variant] if variant else []),
            *(f"--config.{o}" for o in [*overrides, *small]), "--quiet"]
    train = [sys.executable, "-m", "gattn.launch", "--processes", str(processes), "--local-devices", str(devices),
             str(ROOT / "train.py"), "--workdir", str(run), "--distributed", *args]
    sent = {}

    def stop_after_first_checkpoint(proc):
        if "at" not in sent and _checkpoints(run):
            time.sleep(1.0)  # the save is asynchronous: let the next step start
            sent["at"] = _checkpoints(run)[-1]
            proc.send_signal(signal.SIGTERM)

    status, text = _run(train, logs / "train.log", timeout, env=env, until=stop_after_first_checkpoint)
    ok = status == 0
    results["train"] = "ok" if ok else f"error: exit {status}: {_error(text, logs / 'train.log')}"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] \
        if (run / "metrics.jsonl").exists() else []
    val = [r["step"] for r in rows if any(k.startswith("val_loss/") for k in r)]
    results["validation"] = f"ok (held-out loss at steps {val})" if val else "error: no held-out loss was logged"
    saved = _checkpoints(run)
    results["checkpoint"] = f"ok (steps {saved})" if saved else "error: no checkpoint was saved"
    if "at" not in sent:
        results["SIGTERM"] = "error: the run ended before a checkpoint appeared; SIGTERM was not sent"
    elif ok and "SIGTERM: saved step" in text and saved and saved[-1] < STEPS:
        results["SIGTERM"] = f"ok (sent after checkpoint {sent['at']}; saved step {saved[-1]} and exited 0)"
    else:
        results["SIGTERM"] = f"error: exit {status}, checkpoints {saved}: {_error(text, logs / 'train.log')}"
    p2, d2 = other_layout(processes, devices)
    resume = [sys.executable, "-m", "gattn.launch", "--processes", str(p2), "--local-devices", str(d2),
              str(ROOT / "train.py"), "--workdir", str(run), "--distributed", *args]
    status, text = _run(resume, logs / "resume.log", timeout, env=env)
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    if status == 0 and summary.get("completed"):
        results["resume"] = f"ok ({p2} x {d2}: from step {saved[-1] if saved else 0} to {summary['step']})"
    else:
        results["resume"] = f"error ({p2} x {d2}): exit {status}: {_error(text, logs / 'resume.log')}"
    env["XLA_FLAGS"] = " ".join([*(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f),
                                 f"--xla_force_host_platform_device_count={chips}"])
    status, text = _run([sys.executable, str(ROOT / "eval.py"), "--workdir", str(run), "--max-batches", "1",
                         "--no-figures"], logs / "eval.log", timeout, env=env)
    results["eval"] = "ok" if status == 0 and (run / "eval" / "results.json").exists() else \
        f"error: exit {status}: {_error(text, logs / 'eval.log')}"
    return _report(results)


def _report(results: dict[str, str]) -> dict[str, str]:
    for stage in STAGES:
        results.setdefault(stage, "not run (an earlier stage failed)")
        print(f"{stage}: {results[stage]}", flush=True)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preset", help="a preset name (dense_1p7b, moe_15a2b, ...) or config file")
    ap.add_argument("--processes", type=int, required=True, help="local processes (hosts)")
    ap.add_argument("--local-devices", type=int, required=True, help="CPU devices per process (chips per host)")
    ap.add_argument("--variant", help="a registered variant (python -m gattn.variants)")
    ap.add_argument("--workdir", type=Path, help="where the run and the logs go (default: a new temporary folder)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds each stage may take")
    ap.add_argument("--interpret", action="store_true", help="run the Pallas kernels in interpret mode "
                    "(minutes per step at a preset's batch) instead of their XLA stand-ins")
    args, overrides = cli.parse_args(ap, argv)
    if args.processes < 1 or args.local_devices < 1:
        raise ConfigError("--processes/--local-devices", (args.processes, args.local_devices), "positive integers")
    results = rehearse(args.preset, args.processes, args.local_devices, variant=args.variant,
                       overrides=[o.removeprefix("--config.") for o in overrides], workdir=args.workdir, timeout=args.timeout, interpret=args.interpret)
    return 0 if all(v.startswith("ok") for v in results.values()) else 1
