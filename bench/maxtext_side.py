"""MaxText side by side (issue 44, item 5): MaxText 0.2.5's own Qwen3-1.7B train step, compiled
ahead of time by libtpu for the slice gattn's dense_1p7b preset targets, measured with gattn's
collective-traffic counter.

What it does, per variant (`--variants default,vocab_tiling8`):
  1. Installs `maxtext[tpu]==0.2.5` (it brings jax/jaxlib 0.12 and libtpu 0.0.52) into a Python
     3.12 venv of its own, by default ~/.cache/gattn/maxtext-0.2.5-py312 (`--venv DIR`; the
     interpreter: `--python`, else pyenv's newest 3.12, else python3.12 on PATH), 2.8 GB. Skipped
     when that venv already has maxtext 0.2.5 and libtpu. Nothing goes into gattn's own venv.
  2. Runs MaxText's `maxtext.trainers.pre_train.train_compile` (its `main`, unchanged) in a
     subprocess of that venv, with JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1
     TPU_ACCELERATOR_TYPE=v5p-64 and XLA_FLAGS="--xla_dump_to=TMP --xla_dump_hlo_as_text":
         <site-packages>/maxtext/configs/base.yml model_name=qwen3-1.7b compile_topology=v5p-64
         compile_topology_num_slices=1 per_device_batch_size=32 max_target_length=4096
         remat_policy=full dataset_type=synthetic run_name=aot base_output_directory=TMP
         [num_vocab_tiling=8]
     i.e. dense_1p7b's slice (v5p-64 = v5p:4x4x2, 32 chips), global batch (1024 = 32 chips x 32
     sequences of 4096; MaxText in one step, dense_1p7b in train.microbatches=4) and remat
     (gattn's exec.remat="full"; MaxText's base.yml default remat_policy is 'full' already, set
     explicitly here). MaxText's mesh is its default: every chip on the fsdp axis
     (ici_fsdp_parallelism=-1, pure FSDP over 32 chips). A small wrapper around train_compile
     records the mesh MaxText built (axis names, shape, device ids, slices), the compiled step's
     memory_analysis() and compiled.as_text(), so nothing is scraped from its log.
  3. Counts the step's collectives with gattn's counter, `gattn.experiments.traffic.count`, run in
     THIS repo's venv (.venv/bin/python, `--gattn-python`), with MaxText's mesh as the device ->
     axis map: on compiled.as_text(), and, as a check, on the dump's after-optimizations HLO of
     the train step (the largest `module_*.jit_train_step.*after_optimizations.txt`), whose
     `%param#k` tuple shorthand (jax 0.12's dump) is first given get-tuple-elements; a warning is
     printed if the two disagree.
  4. Prints one JSON object per variant (and writes them all with `--json FILE`):
     {"system": "maxtext 0.2.5", "variant", "model": "qwen3-1.7b", "topology": "v5p-64",
      "per_device_batch_size": 32, "seq": 4096, "remat", "memory_gib_per_chip", "traffic",
      "compile_s", ...}
     memory_gib_per_chip is arguments + outputs - aliased + temporaries (MaxText's own "Total
     estimated memory size" and bench/aot_train_step.py's sum), in GiB (2**30 bytes).

    python bench/maxtext_side.py [--variants default,vocab_tiling8] [--json out.json]
        [--venv DIR] [--keep-dump DIR] [--timeout 1800]

It needs no TPU (libtpu only compiles, on the CPU) and no network beyond PyPI for the first
install. Time on the shared 2-core machine: the install 1.7-2 minutes once (102 s, 116 s into a
fresh venv), each variant 50-130 s wall (the compile itself 40-110 s, with the load of whoever
else shares the cores; ~2 GB of memory), the counting a second. It is a benchmark, never a test
dependency: nothing in tests/ imports it.

Measured here (MaxText 0.2.5, jax 0.12.0.1, libtpu 0.0.52; mesh fsdp=32; global batch 1024 x 4096
in one step; remat_policy=full), per chip per step:

    variant        memory GiB  traffic GiB  all-gather  collective-permute  all-to-all
    default          90.96       10.14        2.48         6.69               0.97
    vocab_tiling8    27.95       24.79        6.41        16.53               1.85

The memory is the issue's (91.0, 28.0). Its traffic (16.6, 40.0) is this HLO counted with each
windowed-einsum loop (XLA's collective-permute all-gather / reduce-scatter of a weight, `iv < 16`,
unrolled to `iv += 2`) run 16 times instead of 8: that reading gives 16.63 and 39.97, twice the
collective-permute bytes. gattn's counter reads the step (8 trips x 4 permutes = the 31 shards a
ring over 32 chips needs). num_vocab_tiling=8 cuts the memory 3.3x and multiplies the traffic
2.4x: each of the 8 tiles gathers the tied [151936, 2048] embedding again, forward and backward.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAXTEXT_VERSION = "0.2.5"
REQUIREMENT = f"maxtext[tpu]=={MAXTEXT_VERSION}"
DEFAULT_VENV = Path.home() / ".cache" / "gattn" / f"maxtext-{MAXTEXT_VERSION}-py312"
TOPOLOGY, REMAT = "v5p-64", "full"
TOPOLOGIES = {"next80b_fsdp_ga8": "v5p-128"}
# the gattn preset each variant stands beside (same shapes, slice and global batch): docs/presets.md's
# side-by-side table (python -m gattn.experiments.fit_table) takes each preset's fastest variant
PRESET_OF = {"default": "dense_1p7b", "vocab_tiling8": "dense_1p7b", "vocab_tiling8_minimal": "dense_1p7b",
             "vocab_tiling8_none": "dense_1p7b", "ga16_minimal": "dense_1p7b",
             "ga16_minimal_with_context": "dense_1p7b", "dense_48l_tiling8": "dense_1p7b_48l",
             "extend_32k": "extend_1p7b_32k", "extend_32k_vocab_tiling8": "extend_1p7b_32k",
             "moe_15a2b": "moe_15a2b", "moe_15a2b_ep8": "moe_15a2b", "moe_15a2b_tiling8": "moe_15a2b",
             "moe_15a2b_ga8": "moe_15a2b", "moe_15a2b_ep8_ga8": "moe_15a2b", "next80b_fsdp_ga8": "qwen3_next_80b"}  # a variant on another slice than TOPOLOGY (its preset's)
COMMON = [f"compile_topology={TOPOLOGY}", "compile_topology_num_slices=1", f"remat_policy={REMAT}",
          "dataset_type=synthetic", "run_name=aot"]
# MaxText's closest config to the MoE preset moe_15a2b: its Qwen3-30B-A3B (128 experts top-8,
# d_model 2048, 32 query / 4 kv heads of 128, QK-norm, renormalised top-k, dropless megablox) set
# to the preset's 24 layers, expert width 704, vocabulary 303,104 and RoPE base 10k.
MOE_15A2B = ["override_model_config=True", "base_num_decoder_layers=24", "base_moe_mlp_dim=704", "base_mlp_dim=704", "vocab_size=303104",
             "rope_max_timescale=10000"]
# name -> (MaxText model_name, per_device_batch_size, max_target_length, extra overrides): the
# global batch is 32 chips x per_device_batch_size, as each gattn preset's.
VARIANTS = {
    "default": ("qwen3-1.7b", 32, 4096, []),                                   # dense_1p7b
    "vocab_tiling8": ("qwen3-1.7b", 32, 4096, ["num_vocab_tiling=8"]),
    "extend_32k": ("qwen3-1.7b", 2, 32768, []),                                 # extend_1p7b_32k: 64 x 32768
    "extend_32k_vocab_tiling8": ("qwen3-1.7b", 2, 32768, ["num_vocab_tiling=8"]),
    "moe_15a2b": ("qwen3-30b-a3b", 32, 4096, MOE_15A2B),                         # pure FSDP over 32
    "moe_15a2b_ep8": ("qwen3-30b-a3b", 32, 4096, MOE_15A2B + ["ici_fsdp_parallelism=4",
                                                              "ici_expert_parallelism=8"]),
    # the batch of 1024 in 8 accumulated microbatches of 4 rows a chip, as moe_15a2b's 8
    # issue 58: MaxText's best configs to set beside the step model, on the same counters: pure
    # FSDP in one step with the vocabulary tiled (the 130 GiB, 60.6 GiB/chip), and the
    # dense model with its `minimal` remat policy and without remat
    "moe_15a2b_tiling8": ("qwen3-30b-a3b", 32, 4096, MOE_15A2B + ["num_vocab_tiling=8"]),
    "vocab_tiling8_minimal": ("qwen3-1.7b", 32, 4096, ["num_vocab_tiling=8", "remat_policy=minimal"]),
    "vocab_tiling8_none": ("qwen3-1.7b", 32, 4096, ["num_vocab_tiling=8", "remat_policy=none"]),
    # MaxText's best dense configs beside gattn's (its remat_policy options on the batch of 1024 in
    # 16 accumulated microbatches of 2 rows a chip, as dense_1p7b's): every dot saved (minimal),
    # and with the attention's output too (minimal_with_context)
    "ga16_minimal": ("qwen3-1.7b", 2, 4096, ["num_vocab_tiling=8", "remat_policy=minimal",
                                             "gradient_accumulation_steps=16"]),
    "ga16_minimal_with_context": ("qwen3-1.7b", 2, 4096, ["num_vocab_tiling=8", "remat_policy=minimal_with_context",
                                                          "gradient_accumulation_steps=16"]),
    # dense_1p7b_48l (48 layers, SwiGLU 2720) as MaxText's best dense config above (one pass, tiled)
    "dense_48l_tiling8": ("qwen3-1.7b", 32, 4096, ["override_model_config=True", "base_num_decoder_layers=48",
                                                   "base_mlp_dim=2720", "num_vocab_tiling=8"]),
    # qwen3_next_80b on v5p-128 (64 chips): the batch of 1024 x 4096 in 8 accumulated microbatches
    # of 2 rows a chip, as the preset's 8, on pure FSDP with the vocabulary tiled
    "next80b_fsdp_ga8": ("qwen3-next-80b-a3b", 2, 4096, ["gradient_accumulation_steps=8", "num_vocab_tiling=8"]),
    "moe_15a2b_ga8": ("qwen3-30b-a3b", 4, 4096, MOE_15A2B + ["gradient_accumulation_steps=8"]),
    "moe_15a2b_ep8_ga8": ("qwen3-30b-a3b", 4, 4096, MOE_15A2B + ["gradient_accumulation_steps=8",
                                                                 "ici_fsdp_parallelism=4", "ici_expert_parallelism=8"]),
}

# Runs inside MaxText's venv: MaxText's train_compile.main as `python -m ...train_compile` runs it,
# with get_topology_mesh and jit_and_compile wrapped to record the mesh and the memory stats.
RUNNER = textwrap.dedent('''
    import json, os, sys, time
    from absl import app
    import maxtext
    from maxtext.trainers.pre_train import train_compile as tc

    record_path = os.environ["GATTN_SIDE_RECORD"]
    record = {}

    def save():
        with open(record_path, "w") as f:
            json.dump(record, f)

    _mesh = tc.get_topology_mesh
    def get_topology_mesh(config):
        mesh = _mesh(config)
        flat = list(mesh.devices.flat)
        record["mesh"] = {"axis_names": list(mesh.axis_names), "shape": list(mesh.devices.shape),
                          "device_ids": [d.id for d in flat],
                          "slice_index": [getattr(d, "slice_index", 0) or 0 for d in flat],
                          "coords": [list(getattr(d, "coords", ())) for d in flat],
                          "device_kind": flat[0].device_kind}
        record["config"] = {k: getattr(config, k, None) for k in (
            "remat_policy", "num_vocab_tiling", "per_device_batch_size", "max_target_length",
            "global_batch_size_to_train_on", "gradient_accumulation_steps", "scan_layers",
            "attention", "dtype", "weight_dtype", "opt_type", "model_name")}
        record["config"] = {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v))
                            for k, v in record["config"].items()}
        save()
        return mesh
    tc.get_topology_mesh = get_topology_mesh

    _compile = tc.jit_and_compile
    def jit_and_compile(*args, **kwargs):
        t0 = time.perf_counter()
        compiled = _compile(*args, **kwargs)
        record["compile_s"] = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        record["memory"] = {k: int(getattr(mem, k)) for k in (
            "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "temp_size_in_bytes", "generated_code_size_in_bytes", "host_temp_size_in_bytes",
            "peak_memory_in_bytes")
            if hasattr(mem, k)}
        with open(os.environ["GATTN_SIDE_HLO"], "w") as f:
            f.write(compiled.as_text())
        import jax
        record["jax"] = jax.__version__
        save()
        return compiled
    tc.jit_and_compile = jit_and_compile

    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    sys.argv = ["train_compile", base] + sys.argv[1:]
    app.run(tc.main)
''')

# Runs in gattn's venv: gattn's counter on the step's HLO text, with MaxText's mesh (device ids in
# the program's device order, row-major over its axes) and each device's slice. It counts
# compiled.as_text() (get-tuple-element instructions, which the counter reads), and the XLA dump's
# after-optimizations file as a check: with jax 0.12 / libtpu 0.0.52 the dump prints tuple
# elements as `%param#k` with no get-tuple-element instruction, which gattn's counter does not
# resolve (18 loops would count once), so for that file each `%x#k` is given its
# get-tuple-element first. The two counts must agree.
COUNTER = textwrap.dedent('''
    import json, re, sys
    import numpy as np
    from gattn.experiments import traffic

    _parse = traffic.parse
    def parse_hash_refs(text):
        comps, entry, module = _parse(text)
        for comp in comps.values():
            for ins in list(comp.instrs.values()):
                for op in ins.operands:
                    ref = op.split()[-1].lstrip("%")
                    m = re.fullmatch(r"(.+)#(\\d+)", ref)
                    src = comp.instrs.get(m.group(1)) if m else None
                    if src is None or ref in comp.instrs or not src.shape.startswith("("):
                        continue
                    parts = traffic._split_top(re.sub(r"/\\*.*?\\*/", "", src.shape)[1:-1])
                    k = int(m.group(2))
                    if k < len(parts):
                        comp.instrs[ref] = traffic.Instr(ref, parts[k], "get-tuple-element",
                                                         ["%" + m.group(1)], f", index={k}")
        return comps, entry, module

    as_text, dump, mesh_path = sys.argv[1:4]
    mesh = json.load(open(mesh_path))
    devices = (np.asarray(mesh["device_ids"]).reshape(mesh["shape"]), mesh["axis_names"])
    slice_of = dict(zip(mesh["device_ids"], mesh["slice_index"]))
    text = open(as_text).read()
    out = {"as_text": traffic.count(text, devices=devices, slice_of=slice_of)}
    # issue 58's step model on the same counters as gattn's fit: the FLOPs the step runs (dots,
    # convolutions, priced kernels, loop trips, recompute) and its HBM bytes
    from gattn.experiments import flops
    # MaxText's splash attention kernels carry no cost estimate: priced as gattn's flash kernel
    # prices itself (flops.splash_formulas, MaxText's sa_block_* of 512); its megablox kernels do
    c = flops.count_flops(text, flops.splash_formulas(block=512))
    mxu = sum(c["by_kind"].get(k, 0) for k in ("dot", "convolution", "custom_call"))
    kernels = {}
    for x in c["custom_calls"]:
        if x["target"] == "tpu_custom_call":
            k = kernels.setdefault(x["name"], {"runs": 0, "tflops": 0.0, "hbm_gib": 0.0, "priced_by": x["priced_by"]})
            k["runs"] += x["runs"]
            k["tflops"] = round(k["tflops"] + x["flops"] / 1e12, 2)
            k["hbm_gib"] = round(k["hbm_gib"] + x["bytes"] / 2**30, 1)
    out["step"] = {"counted_tflops_per_chip": round(mxu / 1e12, 2), "hbm_gib_per_step": round(c["hbm_bytes"] / 2**30, 1),
                   "unpriced_kernels": sorted({x["name"] if x["target"] == "tpu_custom_call" else x["target"]
                                               for x in c["custom_calls"] if x["priced_by"] == "unpriced"}),
                   "kernels": kernels,
                   "roofline": traffic.roofline(mxu, out["as_text"], "v5p", counted_flops=mxu,
                                                hbm_bytes=c["hbm_bytes"])}
    traffic.parse = parse_hash_refs
    out["dump"] = traffic.count(open(dump).read(), devices=devices, slice_of=slice_of)
    print(json.dumps(out))
''')


def log(msg: str) -> None:
    print(f"[maxtext_side] {msg}", file=sys.stderr, flush=True)


def find_python312(explicit: str | None) -> str:
    if explicit:
        return explicit
    roots = []
    try:
        roots.append(subprocess.run(["pyenv", "root"], capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    roots.append(os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv")))
    for root in roots:
        found = sorted(glob.glob(os.path.join(root, "versions", "3.12*", "bin", "python3.12")),
                       key=lambda p: [int(x) for x in re.findall(r"\d+", Path(p).parents[1].name)])
        if found:
            return found[-1]
    which = shutil.which("python3.12")
    if which:
        return which
    raise SystemExit("no Python 3.12 found (pyenv versions/3.12.*, python3.12 on PATH): pass --python")


def installed(venv: Path) -> bool:
    py = venv / "bin" / "python"
    if not py.exists():
        return False
    probe = ("import importlib.metadata as m; assert m.version('maxtext') == %r; m.version('libtpu'); "
             "import jax; print(jax.__version__)" % MAXTEXT_VERSION)
    return subprocess.run([str(py), "-c", probe], capture_output=True).returncode == 0


def ensure_venv(venv: Path, python: str | None) -> dict:
    """Creates `venv` with maxtext[tpu]==0.2.5 unless it already has it; returns what it did."""
    if installed(venv):
        log(f"{REQUIREMENT} already in {venv}: install skipped")
        return {"installed_now": False, "install_s": 0.0}
    t0 = time.perf_counter()
    py = find_python312(python)
    log(f"installing {REQUIREMENT} into {venv} with {py} (a few minutes)")
    venv.parent.mkdir(parents=True, exist_ok=True)
    if not (venv / "bin" / "python").exists():
        subprocess.run([py, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    subprocess.run(pip + ["install", "-q", "--upgrade", "pip"], check=True)
    subprocess.run(pip + ["install", "-q", REQUIREMENT], check=True)
    if not installed(venv):
        raise SystemExit(f"{venv}: {REQUIREMENT} did not install (no libtpu?)")
    return {"installed_now": True, "install_s": round(time.perf_counter() - t0, 1)}


def train_step_hlo(dump: Path) -> Path:
    """The train step's HLO after optimizations: the largest after-optimizations module whose
    name is jit_train_step (MaxText's dump_hlo_module_name)."""
    files = [Path(p) for p in glob.glob(str(dump / "*after_optimizations.txt"))]
    step = [p for p in files if re.search(r"\.jit_train_step\.", p.name)]
    if not step:
        names = sorted({re.sub(r"^module_\d+\.|\..*$", "", p.name) for p in files})
        raise SystemExit(f"no jit_train_step after-optimizations HLO in {dump}; modules: {names}")
    return max(step, key=lambda p: p.stat().st_size)


def count_traffic(gattn_python: str, as_text: Path, dump: Path, mesh: dict, work: Path) -> dict:
    """gattn.experiments.traffic.count on the step's compiled.as_text() and on its dumped HLO, run
    by `gattn_python` (a Python that imports gattn): {"as_text": ..., "dump": ...}."""
    mesh_path = work / "mesh.json"
    mesh_path.write_text(json.dumps(mesh))
    out = subprocess.run([gattn_python, "-c", COUNTER, str(as_text), str(dump), str(mesh_path)], cwd=REPO,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"gattn.experiments.traffic failed on {as_text}:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_variant(name: str, venv: Path, gattn_python: str, timeout: float, keep: Path | None) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"maxtext_side_{name}_"))
    dump, out_dir, record_path = work / "xla_dump", work / "out", work / "record.json"
    runner = work / "runner.py"
    runner.write_text(RUNNER)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
           "TPU_ACCELERATOR_TYPE": TOPOLOGY, "GATTN_SIDE_RECORD": str(record_path),
           "GATTN_SIDE_HLO": str(work / "train_step.as_text.hlo"),
           "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    model, per_device, seq, extra = VARIANTS[name]
    keys = {e.split("=", 1)[0] for e in extra}  # a variant's own setting replaces COMMON's (remat_policy)
    topology = TOPOLOGIES.get(name, TOPOLOGY)
    env["TPU_ACCELERATOR_TYPE"] = topology
    args = [c.replace(TOPOLOGY, topology) if c.startswith("compile_topology=") else c
            for c in COMMON if c.split("=", 1)[0] not in keys] + [
        f"model_name={model}", f"per_device_batch_size={per_device}", f"max_target_length={seq}",
        f"base_output_directory={out_dir}"] + extra
    log(f"{name}: train_compile {' '.join(args)}")
    t0 = time.perf_counter()
    try:
        with open(work / "train_compile.log", "w") as logf:
            proc = subprocess.run([str(venv / "bin" / "python"), str(runner), *args], env=env, cwd=work,
                                  stdout=logf, stderr=subprocess.STDOUT, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{name}: train_compile ran past --timeout {timeout:.0f} s; log {work}/train_compile.log")
    wall = time.perf_counter() - t0
    text = (work / "train_compile.log").read_text(errors="replace")
    oom = re.search(r"RESOURCE_EXHAUSTED: .*?Ran out of memory on HBM[^\n]*", text)
    if proc.returncode != 0 and oom:  # a measured result: this config does not fit the chip
        shutil.rmtree(work, ignore_errors=True)
        return {"system": f"maxtext {MAXTEXT_VERSION}", "variant": name, "preset": PRESET_OF.get(name),
                "model": model, "topology": TOPOLOGIES.get(name, TOPOLOGY),
                "per_device_batch_size": per_device, "seq": seq, "overrides": extra, "fits": False,
                "error": oom.group(0)[:400], "wall_s": round(wall, 1)}
    if proc.returncode != 0 or not record_path.exists():
        raise SystemExit(f"{name}: train_compile failed (rc {proc.returncode}), log {work}/train_compile.log:\n"
                         + text[-4000:])
    if keep is not None:  # the step's HLO (dump and as_text), log and record: `--recount` reads them again
        dest = keep / name
        dest.mkdir(parents=True, exist_ok=True)
        for p in (train_step_hlo(dump), work / "train_step.as_text.hlo", work / "train_compile.log", record_path):
            shutil.copy2(p, dest / p.name)
    out = describe(name, work, train_step_hlo(dump), gattn_python)
    out["wall_s"] = round(wall, 1)
    shutil.rmtree(work, ignore_errors=True)
    return out


def describe(name: str, work: Path, hlo: Path, gattn_python: str) -> dict:
    """A compiled variant's JSON object from `work` (its record.json and train_step.as_text.hlo)
    and its dumped train-step HLO `hlo`: memory, the network, the counted step."""
    model, per_device, seq, extra = VARIANTS[name]
    record = json.loads((work / "record.json").read_text())
    if "memory" not in record:
        raise SystemExit(f"{name}: no compiled step recorded, log {work}/train_compile.log")
    mem = record["memory"]
    used = (mem["argument_size_in_bytes"] + mem["output_size_in_bytes"] - mem["alias_size_in_bytes"]
            + mem["temp_size_in_bytes"])
    counted = count_traffic(gattn_python, work / "train_step.as_text.hlo", hlo, record["mesh"], work)
    traffic, check = counted["as_text"], counted["dump"]
    if abs(traffic["total_gib"] - check["total_gib"]) > 0.01 or traffic["unknown_trip_counts"]:
        log(f"{name}: WARNING: compiled.as_text() counts {traffic['total_gib']} GiB "
            f"({traffic['unknown_trip_counts']} loops unbounded), the dump {check['total_gib']} GiB")
    shape = dict(zip(record["mesh"]["axis_names"], record["mesh"]["shape"]))
    cfg = record["config"]
    out = {"system": f"maxtext {MAXTEXT_VERSION}", "variant": name, "preset": PRESET_OF.get(name), "model": model,
           "topology": TOPOLOGIES.get(name, TOPOLOGY),
           "per_device_batch_size": per_device, "seq": seq, "overrides": extra,
           "remat": f"remat_policy={cfg['remat_policy']} (set; MaxText's base.yml default is 'full')",
           "num_vocab_tiling": cfg["num_vocab_tiling"], "global_batch": cfg["global_batch_size_to_train_on"],
           "gradient_accumulation_steps": cfg["gradient_accumulation_steps"],
           "mesh": {k: v for k, v in shape.items() if v > 1} or shape,
           "device_kind": record["mesh"]["device_kind"], "jax": record.get("jax"),
           "memory_gib_per_chip": round(used / 2**30, 2),
           "memory_bytes": {"arguments": mem["argument_size_in_bytes"], "outputs": mem["output_size_in_bytes"],
                            "aliased": mem["alias_size_in_bytes"], "temp": mem["temp_size_in_bytes"], "total": used},
           # XLA's heap peak (CompiledMemoryStats.peak_memory_in_bytes), beside the sum above
           "peak_gib_per_chip": round(mem.get("peak_memory_in_bytes", 0) / 2**30, 2),
           "traffic": traffic, "dump_traffic_total_gib": check["total_gib"], "hlo_dump": hlo.name,
           # counted FLOPs, HBM bytes and the modelled step (its MFU field is counted over counted:
           # compare step_s with gattn's fit, bench/fit_presets.py)
           "step": counted["step"],
           "compile_s": round(record["compile_s"], 1)}
    (work / "mesh.json").unlink(missing_ok=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="default,vocab_tiling8", help=f"comma-separated of {list(VARIANTS)}")
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="MaxText's venv (created if missing)")
    ap.add_argument("--python", default=None, help="the Python 3.12 that creates the venv")
    ap.add_argument("--gattn-python", default=str(REPO / ".venv" / "bin" / "python"),
                    help="a Python that imports gattn (runs the traffic counter)")
    ap.add_argument("--json", type=Path, default=None, help="write the variants' objects to this file")
    ap.add_argument("--keep-dump", type=Path, default=None,
                    help="copy each variant's train-step HLO, log and record into DIR/VARIANT")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per compile")
    ap.add_argument("--recount", type=Path, default=None, metavar="DIR",
                    help="count the variants kept in DIR/VARIANT by an earlier --keep-dump again (no compile, "
                         "no MaxText venv): after a change to gattn's counters")
    args = ap.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    results = []
    if args.recount is not None:
        for name in names:
            kept = args.recount / name
            res = {**describe(name, kept, train_step_hlo(kept), args.gattn_python), "recounted": True}
            print(json.dumps(res), flush=True)
            results.append(res)
    else:
        install = ensure_venv(args.venv.expanduser(), args.python)
        for name in names:
            res = {**run_variant(name, args.venv.expanduser(), args.gattn_python, args.timeout, args.keep_dump),
                   **install}
            install = {"installed_now": False, "install_s": 0.0}
            print(json.dumps(res), flush=True)
            results.append(res)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
