"""Hugging Face checkpoints <-> gattn runs, with numerical parity.

    python -m gattn.convert from-hf SRC_DIR --workdir DIR
    python -m gattn.convert to-hf WORKDIR --out DIR [--step N] [--layout auto|qwen3|llama|qwen3_next|qwen3_moe|qwen3_5|release]

`from-hf` reads a local Hugging Face model folder (config.json, safetensors shards or
pytorch_model.bin files, tokenizer.json; nothing is downloaded) and writes a gattn run directory
that eval.py restores and `train.py --init-from` continues: config.json, an Orbax checkpoint of
the parameters (step 0) and the tokenizer under tokenizer/hf/. `to-hf` writes the reverse, with
the run's tokenizer as files AutoTokenizer loads as they are; its --layout auto writes only a
layout transformers loads as is (qwen3, llama, qwen3_next, qwen3_moe, qwen3_5) and refuses a run none of
them holds, naming the explicit layouts that do. What a converted folder's config.json says but
the model does not determine (max_position_embeddings, Qwen3.5's mrope_section) is kept in
converted.json and written back as it was; a gattn-native run gets the length it was trained at
(train.seq_len, or YaRN's original length x factor) and the default section. A tokenizer.json
the tokenizers library does not load is refused, naming the file, both ways; a declared MTP
layer whose mtp.* tensors the folder lacks is said in one warning line.

Layouts (all Linear weights are [out, in]; gattn stores [in, out], so each is transposed):

    qwen3        Qwen3ForCausalLM: QK-norm, no gate.
    llama        LlamaForCausalLM: no QK-norm, no gate.
    qwen3_moe    Qwen3MoeForCausalLM, every layer sparse: QK-norm, no gate, gattn's MoE (router
                 mlp.gate [E, d]; expert j's gate/up/down_proj = slice j of the stacked w1/w3/w2;
                 norm_topk_prob = moe.renormalize), dropless as transformers computes it.
    release      the paper's released models (Qwen3 modeling code with headwise_attn_output_gate /
                 elementwise_attn_output_gate, use_qk_norm, qkv_bias). The gate is packed into a
                 widened q_proj, per kv group g: rows [queries of the group's G heads | their gates],
                 G gates per group (headwise) or G * head_dim (elementwise). Written only on
                 request: transformers loads it only with the release's own modeling code.
    qwen3_next   Qwen3NextForCausalLM: full-attention layers with a G1 gate and Gated DeltaNet
                 layers in any pattern (layer_types; linear_attn.* through gattn/model/gdn.py's
                 from_hf / to_hf), dense MLPs or an MoE with a shared expert in every layer
                 (mlp.shared_expert.*, mlp.shared_expert_gate [1, d]). q_proj rows per head:
                 [query | gate] (elementwise; a headwise gate is written with each head's row
                 repeated head_dim times). Every RMSNorm but the GDN's scales by (1 + w): gattn
                 reads it as model.zero_centered_norm and copies w as it is (a model without it
                 is written with w = scale - 1). Partial rotary embedding (rope_dim). The
                 multi-token-prediction layer (mtp.*) is model.mtp_layers = 1, read and written
                 by gattn/interop/mtp.py (transformers skips it on load). transformers applies
                 hidden_act to the GDN's causal conv as well as to the FFN, and gattn's conv is
                 SiLU: a model with GDN layers is read and written with hidden_act silu only.
                 config.json is read as strictly as Qwen3.5's (gattn/interop/fields.py).
    qwen3_5      Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM (and, read only, the language model
                 of Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration, under
                 model.language_model. beside the skipped vision tower model.visual.): qwen3_next's
                 model, with the GDN projections one per role (in_proj_qkv [all q | all k | all v],
                 in_proj_z, in_proj_b, in_proj_a), a dense MLP or an MoE with a shared expert in
                 every layer, the router always renormalised, experts read per expert or fused
                 (mlp.experts.gate_up_proj / down_proj) and written per expert, and the multimodal
                 RoPE's mrope_section (plain RoPE on text). auto writes it for a run converted
                 from one (converted.json, or that of the run's train.init_from); config.json is
                 gattn/interop/qwen3_5.py.

gattn's GQA grouping (query head h reads kv head h // G) and its rotate-half RoPE are Hugging
Face's, so no head is permuted. Biases (attention_bias / qkv_bias) split as the weights do.
Everything is checked before anything is written: a missing shard, an absent, unexpected or
misshapen tensor, or a config field gattn cannot represent is refused with its name.

Each family is one module that owns its config fields, tensor names, packing and refusals
(gattn/interop/llama.py, qwen3_moe.py, qwen3_next.py, qwen3_5.py, release.py; the list is
families.py), beside a shared core: fields.py (config.json checks and the fields every decoder
shares), decoder.py (the tensors every family shares) and files.py (a folder's files, ConversionError).
hf_config.py and weights.py dispatch to the family by layout; hf_config.py also chooses the export
layout across the families; mtp.py maps Qwen3-Next's and Qwen3.5's MTP layer.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from gattn.config import Config, ConfigError, ModelConfig, TrainConfig
from gattn.interop import mtp as hf_mtp
from gattn.interop.families import family
from gattn.interop.files import IGNORED_SUFFIXES, ConversionError, TensorFiles, read_json
from gattn.interop.hf_config import (LAYOUTS, detect_layout, export_layout, hf_config, kept_fields, model_config,
                                     text_fields)
from gattn.interop.weights import from_gattn, hf_shapes, to_gattn

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


# --------------------------------------------------------------------------- from-hf


def read_hf(src: str | Path) -> tuple[dict, str, ModelConfig, dict[str, np.ndarray]]:
    """(config.json, layout, gattn model config, tensors) of model folder `src`, all checked:
    every expected tensor present with its shape, none unexpected."""
    src = Path(src)
    if not (src / "config.json").is_file():
        raise ConversionError(f"{src}: no config.json (expected a Hugging Face model folder)")
    hf = read_json(src / "config.json")
    layout = detect_layout(hf)
    cfg = model_config(hf, layout)
    files = TensorFiles(src)
    family(layout).read_files(files, hf, cfg)  # (Qwen3.5: a multimodal folder's language model, fused experts)
    present = [n for n in files.names() if not n.endswith(IGNORED_SUFFIXES)]
    # Qwen3-Next's and Qwen3.5's multi-token-prediction layer (mtp.*): model.mtp_layers = 1, every tensor kept
    cfg = dataclasses.replace(cfg, mtp_layers=hf_mtp.mtp_layers(text_fields(hf), present))
    absent = hf_mtp.absent_layer(text_fields(hf), present)
    if absent:
        print(f"warning: {src / 'config.json'} {absent}", file=sys.stderr)
    if cfg.tie_embeddings and "lm_head.weight" in present and _head_differs(files, src):
        cfg = dataclasses.replace(cfg, tie_embeddings=False)
    elif cfg.tie_embeddings and "lm_head.weight" in present:
        present.remove("lm_head.weight")  # some exports write the tied head as well
    expected = {**hf_shapes(cfg, layout), **hf_mtp.hf_shapes(cfg, layout)}
    unexpected = sorted(n for n in present if n not in expected)
    if unexpected:
        raise ConversionError(f"tensor {unexpected[0]} is not part of the {layout} layout of this config "
                              f"({len(unexpected)} such tensors: a bias, an MoE or linear-attention weight "
                              "that config.json does not declare or gattn does not hold?)")
    tensors = {}
    for name, shape in expected.items():
        if name not in files.where:
            raise ConversionError(f"tensor {name} is missing from {src}")
        tensors[name] = files.get(name)
        if tuple(tensors[name].shape) != shape:
            raise ConversionError(f"tensor {name} has shape {tuple(tensors[name].shape)}; config.json "
                                  f"implies {shape} for layout {layout}")
    return hf, layout, cfg, tensors


def _head_differs(files: TensorFiles, src: Path) -> bool:
    """Whether a checkpoint that config.json calls tied stores an lm_head.weight unlike its
    embedding. transformers then keeps the stored head untied (with a warning), so gattn does
    too, and says so: dropping it would change every logit."""
    if "model.embed_tokens.weight" not in files.where:
        return False  # (reported as a missing tensor)
    head, embed = files.get("lm_head.weight"), files.get("model.embed_tokens.weight")
    if head.shape == embed.shape and np.array_equal(head, embed):
        return False
    diff = float(np.abs(head - embed).max()) if head.shape == embed.shape else float("nan")
    print(f"warning: {src / 'config.json'} says tie_word_embeddings: true, but tensor lm_head.weight "
          f"differs from model.embed_tokens.weight (max |difference| {diff:.3g}): keeping lm_head.weight "
          "as an untied head, as transformers does (the run's model.tie_embeddings is False)", file=sys.stderr)
    return True


def load_tokenizer_files(src: Path, hf: dict) -> dict[str, bytes]:
    """The tokenizer files to copy (tokenizer.json is required), with the eos token recorded in
    tokenizer_config.json when only config.json names it."""
    if not (src / "tokenizer.json").is_file():
        raise ConversionError(f"{src}: no tokenizer.json (eval.py reads text with the model's own "
                              "tokenizer; save it with tokenizer.save_pretrained)")
    files = {n: (src / n).read_bytes() for n in HF_TOKENIZER_FILES if (src / n).is_file()}
    check_tokenizer_json(src / "tokenizer.json", files["tokenizer.json"])
    tc = read_json(src / "tokenizer_config.json", files.get("tokenizer_config.json", b"{}"))
    eos = hf.get("eos_token_id") if hf.get("eos_token_id") is not None else text_fields(hf).get("eos_token_id")
    if "eos_token" not in tc and eos is not None:
        tc["eos_token_id"] = eos[0] if isinstance(eos, list) else eos
        files["tokenizer_config.json"] = json.dumps(tc, indent=2).encode()
    return files


def check_tokenizer_json(path: Path, data: bytes) -> None:
    """Refuses, naming `path`, a tokenizer.json the tokenizers library does not load (as eval.py,
    the trainer and AutoTokenizer would, later and without naming it)."""
    from tokenizers import Tokenizer  # noqa: PLC0415

    try:
        Tokenizer.from_str(data.decode())
    except Exception as e:  # noqa: BLE001 (tokenizers raises plain Exception; a bad encoding UnicodeDecodeError)
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConversionError(f"{path}: the tokenizers library cannot load it ({why}); save the tokenizer "
                              "again (tokenizer.save_pretrained)") from None


class HFRun(NamedTuple):
    """What a Hugging Face model folder converts into, in memory: the run's config, its parameters
    (an nnx.State laid out as Transformer(cfg.model) builds it), the tokenizer files to copy and
    the weight layout read, and the config.json values to-hf writes back as they were
    (hf_config.kept_fields)."""

    cfg: Config
    params: object
    tokenizer_files: dict[str, bytes]
    layout: str
    kept: dict


def read_run(src: str | Path) -> HFRun:
    """Hugging Face model folder `src` as a gattn run in memory, every tensor read and checked."""
    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from gattn.model.transformer import Transformer  # noqa: PLC0415

    hf, layout, model_cfg, tensors = read_hf(src)
    tokenizer_files = load_tokenizer_files(Path(src), hf)
    variant = "baseline" if model_cfg.gate is None else f"sdpa_{model_cfg.gate.granularity}"
    max_len = int(text_fields(hf).get("max_position_embeddings") or 4096)
    cfg = Config(model=model_cfg, train=dataclasses.replace(TrainConfig(), seq_len=min(max_len, 4096)),
                 variant=variant)
    params = {**to_gattn(tensors, model_cfg, layout), **hf_mtp.to_gattn(tensors, model_cfg, layout)}
    del tensors  # (each parameter is moved into a jax array below: about two copies at the peak)
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(abstract, nnx.Param)
    flat = []
    for path, var in nnx.to_flat_state(abstract_params):
        value = params.pop(path)  # every gattn parameter has its tensor (hf_shapes / to_gattn)
        if value.shape != var.shape:
            raise ConversionError(f"parameter {'.'.join(map(str, path))}: {value.shape} != {var.shape}")
        flat.append((path, var.replace(jax.numpy.asarray(value, var.dtype))))
    if params:
        raise ConversionError(f"tensors without a gattn parameter: {sorted(params)[:5]}")
    return HFRun(cfg, nnx.from_flat_state(flat), tokenizer_files, layout, kept_fields(hf, layout))


def write_run(run: HFRun, src: str | Path, workdir: Path, *, checkpoint_too: bool = True) -> None:
    """Writes `run` (converted from `src`) into the new folder `workdir`: config.json, the
    tokenizer files, converted.json and, with `checkpoint_too`, its parameters as checkpoint 0."""
    import jax  # noqa: PLC0415

    from gattn.data.tokenizer import HF_TOKENIZER_DIR  # noqa: PLC0415
    from gattn.train import checkpoint, rundir  # noqa: PLC0415

    src = Path(src)
    tok_dir = workdir / "tokenizer" / HF_TOKENIZER_DIR
    tok_dir.mkdir(parents=True)
    for name, data in run.tokenizer_files.items():
        (tok_dir / name).write_bytes(data)
    if checkpoint_too:
        meta = rundir.meta(run.cfg, converted_from=str(src.absolute()), layout=run.layout)
        mngr = checkpoint.manager(workdir, 1, 1)
        try:
            checkpoint.save(mngr, 0, {"params": run.params}, {}, meta, force=True)
            mngr.wait_until_finished()
            checkpoint.seal(mngr.directory / "0")
        finally:
            mngr.close()
    rundir.write_config(workdir, run.cfg)
    n = int(sum(math.prod(x.shape) for x in jax.tree.leaves(run.params)))
    converted = {"from": str(src.absolute()), "layout": run.layout, "params": n, "kept": run.kept}
    (workdir / "converted.json").write_text(json.dumps(converted, indent=2))


def from_hf(src: str | Path, workdir: str | Path) -> Path:
    """Converts Hugging Face model folder `src` into gattn run directory `workdir` (which must
    not hold a run). Returns the workdir."""
    src, workdir = Path(src), Path(workdir)
    _check_new_folder(workdir, "--workdir")
    run = read_run(src)
    # Everything is read and checked: now write, into a sibling folder renamed at the end.
    with _written(workdir) as tmp:
        write_run(run, src, tmp)
    return workdir


def _check_new_folder(path: Path, flag: str) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConversionError(f"{path} is not empty; choose a new {flag} folder")


@contextlib.contextmanager
def _written(path: Path):
    """A temporary sibling of `path` to write into, renamed to `path` when the block succeeds and
    removed when it fails: a conversion leaves either its whole output or nothing."""
    tmp = path.with_name(f".{path.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if path.exists():
            path.rmdir()  # (checked empty)
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- to-hf


def to_hf(workdir: str | Path, out: str | Path, *, step: int | None = None, layout: str = "auto",
          max_shard_bytes: int = 5 * 2**30) -> Path:
    """Writes run `workdir`'s checkpoint `step` (default: the latest) as a Hugging Face model
    folder `out` that transformers loads as it is (but for an explicit --layout release):
    config.json and generation_config.json (the tokenizer's bos / eos / pad ids), safetensors
    shards with an index when more than one, and the run's tokenizer (`export_tokenizer`).
    Returns `out`."""
    import safetensors.numpy  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from gattn.data.tokenizer import tokenizer_path  # noqa: PLC0415
    from gattn.train import rundir  # noqa: PLC0415

    workdir, out = Path(workdir), Path(out)
    _check_gattn_run(workdir)
    cfg = rundir.read_config(workdir)
    record = converted_record(workdir, cfg)
    layout = export_layout(cfg.model, layout, source=record.get("layout"))
    _check_new_folder(out, "--out")
    max_len = cfg.train.seq_len if cfg.model.yarn is None else int(cfg.model.yarn.original_len * cfg.model.yarn.factor)
    tokenizer_files = export_tokenizer(cfg, tokenizer_path(cfg, workdir), max_len)
    special = special_token_ids(tokenizer_files)
    model = rundir.load(workdir, step, ["exec.scan_layers=false"]).model
    params = {path: np.asarray(var[...], np.float32) for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    tensors = {**from_gattn(params, model.cfg, layout), **hf_mtp.from_gattn(params, model.cfg, layout)}
    config = {**hf_config(model.cfg, layout, max_len, record.get("kept")), **hf_mtp.hf_config_fields(model.cfg, layout),
              **special}

    shards, size = [[]], 0
    for name in tensors:
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    with _written(out) as tmp:
        weight_map = {}
        for i, names in enumerate(shards):
            fname = (f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1
                     else "model.safetensors")
            safetensors.numpy.save_file({n: tensors[n] for n in names}, tmp / fname, metadata={"format": "pt"})
            weight_map.update({n: fname for n in names})
        if len(shards) > 1:
            total = sum(t.nbytes for t in tensors.values())
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        for name, data in tokenizer_files.items():
            (tmp / name).write_bytes(data)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(special, indent=2))
    return out


# --------------------------------------------------------------------------- to-hf: the tokenizer


def export_tokenizer(cfg: Config, path: Path, max_len: int) -> dict[str, bytes]:
    """The tokenizer files of an exported folder: AutoTokenizer loads them as they are and gives
    the ids gattn's tokenizer gives. A converted run's tokenizer.json is copied with its
    tokenizer_config.json (naming tokenizer_class PreTrainedTokenizerFast where it names none:
    the model type's own class, e.g. Qwen2Tokenizer, would rebuild it); a SentencePiece model is
    rewritten as a tokenizer.json (`_spm_tokenizer`) and kept as tokenizer.model; the
    Bigram-Backcopy task's characters become one piece each."""
    from tokenizers import Tokenizer, decoders, models  # noqa: PLC0415

    from gattn.config import BACKCOPY  # noqa: PLC0415
    from gattn.data import backcopy  # noqa: PLC0415

    if not path.is_file():
        raise ConversionError(f"tokenizer {path} is missing: to-hf writes the run's tokenizer with its "
                              "weights (set data.tokenizer to the run's tokenizer file)")
    if cfg.data.source == BACKCOPY:  # every sequence opens with <s>; unknown characters are dropped
        chars = backcopy.Tokenizer.from_json(path.read_text()).chars
        tok = Tokenizer(models.BPE(vocab={"<s>": backcopy.START, **{c: i + 1 for i, c in enumerate(chars)}},
                                   merges=[]))
        tok.decoder = decoders.Fuse()
        return _fast_tokenizer_files(tok, {"bos_token": "<s>"}, True, max_len)
    if path.suffix == ".json":
        files = {name: (path.parent / name).read_bytes() for name in HF_TOKENIZER_FILES[1:]
                 if (path.parent / name).is_file()}
        files["tokenizer.json"] = path.read_bytes()
        check_tokenizer_json(path, files["tokenizer.json"])
        tc = read_json(path.parent / "tokenizer_config.json", files.get("tokenizer_config.json", b"{}"))
        if "tokenizer_class" not in tc:
            tc = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len, **tc}
            files["tokenizer_config.json"] = json.dumps(tc, indent=2).encode()
        return files
    tok, special = _spm_tokenizer(path)
    return {**_fast_tokenizer_files(tok, special, cfg.data.bos, max_len), "tokenizer.model": path.read_bytes()}


def _fast_tokenizer_files(tok, special: dict[str, str], add_bos: bool, max_len: int) -> dict[str, bytes]:
    """tokenizer.json and tokenizer_config.json of a `tokenizers` tokenizer with `special` tokens
    ({"bos_token": "<s>", ...}). `add_bos` (data.bos: every training document opened with BOS)
    makes encoding with special tokens prepend it. Special tokens' text is read as plain text
    (split_special_tokens), as gattn's tokenizer reads it."""
    from tokenizers import AddedToken, processors  # noqa: PLC0415

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special.values()])
    if add_bos and "bos_token" in special:
        bos = special["bos_token"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "model_max_length": max_len,
              "split_special_tokens": True, "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": tok.to_str(pretty=True).encode(),
            "tokenizer_config.json": json.dumps(config, indent=2).encode()}


def _spm_tokenizer(path: Path):
    """A SentencePiece BPE model (as gattn trains it) as a `tokenizers` BPE that gives the same ids:
    its pieces in order; merges ranked by the merged piece's score, as SentencePiece merges the
    adjacent pair whose union scores highest (byte pieces come only by fallback); the dummy-prefix
    '▁' and the escaped spaces from the normalizer, and no pre-tokenizer (SentencePiece merges
    across words: its whitespace-only pieces do). Returns (tokenizer, its special tokens).
    Settings this does not reproduce are refused, naming the setting."""
    from tokenizers import Tokenizer, decoders, models, normalizers  # noqa: PLC0415

    try:  # (protobuf comes with tensorflow-datasets)
        from google.protobuf.message import DecodeError  # noqa: PLC0415
        from sentencepiece import sentencepiece_model_pb2 as pb  # noqa: PLC0415
    except ImportError as e:
        raise ConversionError(f"tokenizer {path}: reading a SentencePiece model's settings needs protobuf "
                              f"({e}): pip install protobuf") from None
    proto = pb.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except DecodeError as e:
        raise ConversionError(f"tokenizer {path}: not a SentencePiece model ({e})") from None
    t, n = proto.trainer_spec, proto.normalizer_spec
    user_defined = [p.piece for p in proto.pieces if p.type == pb.ModelProto.SentencePiece.USER_DEFINED]
    checks = [("model_type", pb.TrainerSpec.ModelType.Name(t.model_type), t.model_type == pb.TrainerSpec.BPE, "BPE"),
              ("byte_fallback", t.byte_fallback, t.byte_fallback, "True"),
              ("normalization_rule_name", n.name, n.name == "identity" and not n.precompiled_charsmap, "identity"),
              ("remove_extra_whitespaces", n.remove_extra_whitespaces, not n.remove_extra_whitespaces, "False"),
              ("escape_whitespaces", n.escape_whitespaces, n.escape_whitespaces, "True"),
              ("treat_whitespace_as_suffix", t.treat_whitespace_as_suffix, not t.treat_whitespace_as_suffix, "False"),
              ("user_defined_symbols", user_defined[:3], not user_defined, "none")]
    for name, value, ok, allowed in checks:
        if not ok:
            raise ConversionError(f"tokenizer {path}: SentencePiece {name} = {value!r}; to-hf rewrites as a "
                                  f"tokenizer.json only models trained as gattn trains them ({name} {allowed})")
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    normal = sorted((-p.score, i, p.piece) for i, p in enumerate(proto.pieces)
                    if p.type == pb.ModelProto.SentencePiece.NORMAL)
    pieces = {piece for _, _, piece in normal}
    merges = [(piece[:k], piece[k:]) for _, _, piece in normal for k in range(1, len(piece))
              if piece[:k] in pieces and piece[k:] in pieces]
    special = {f"{name}_token": proto.pieces[i].piece for name in ("bos", "eos", "pad", "unk")
               if 0 <= (i := getattr(t, f"{name}_id")) < len(proto.pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=special.get("unk_token"), byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁")] * n.add_dummy_prefix
                                          + [normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + [decoders.Strip(content=" ", left=1)] * n.add_dummy_prefix)
    return tok, special


def special_token_ids(files: dict[str, bytes]) -> dict[str, int | None]:
    """bos / eos / pad_token_id as the exported tokenizer_config.json names them (a token, or an
    explicit NAME_token_id), for config.json and generation_config.json."""
    from tokenizers import Tokenizer  # noqa: PLC0415

    tok = Tokenizer.from_str(files["tokenizer.json"].decode())
    tc = json.loads(files.get("tokenizer_config.json", b"{}"))
    out = {}
    for name in ("bos", "eos", "pad"):
        token = tc.get(f"{name}_token")
        token = token.get("content") if isinstance(token, dict) else token
        out[f"{name}_token_id"] = tc.get(f"{name}_token_id", tok.token_to_id(token) if token else None)
    return out


def converted_record(workdir: Path, cfg: Config) -> dict:
    """The converted.json of run `workdir` (what from-hf wrote: the layout read, the config.json
    values kept), or that of the run it continues (train.init_from), or {}."""
    for run in (workdir, Path(cfg.train.init_from) if cfg.train.init_from else None):
        if run is not None and (run / "converted.json").is_file():
            return read_json(run / "converted.json")
    return {}


def converted_layout(workdir: Path, cfg: Config) -> str | None:
    """The layout run `workdir` was converted from, or that of the run it continues, or None."""
    return converted_record(workdir, cfg).get("layout")


def _check_gattn_run(workdir: Path) -> None:
    """Refuses a folder that is not a gattn run, saying what it is instead."""
    what = "expected a gattn run directory (written by train.py or from-hf)"
    if not workdir.is_dir():
        raise ConversionError(f"{workdir}: no such folder; {what}")
    if not (workdir / "config.json").is_file():
        raise ConversionError(f"{workdir}: not a gattn run (no config.json); {what}")
    cfg = read_json(workdir / "config.json")
    if "model" not in cfg and ("architectures" in cfg or "model_type" in cfg):
        raise ConversionError(f"{workdir}: not a gattn run but a Hugging Face model folder (its config.json "
                              f"has 'architectures'/'model_type'); from-hf converts it into one")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gattn.convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("from-hf", help="a Hugging Face model folder -> a gattn run directory")
    a.add_argument("src", help="local Hugging Face model folder (config.json + weights + tokenizer.json)")
    a.add_argument("--workdir", required=True, help="new run directory to write")
    b = sub.add_parser("to-hf", help="a gattn run directory -> a Hugging Face model folder")
    b.add_argument("workdir", help="gattn run directory")
    b.add_argument("--out", required=True, help="new folder to write")
    b.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    b.add_argument("--layout", default="auto",
                   help=f"auto (a layout transformers loads as is) or one of {', '.join(LAYOUTS)}")
    b.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size")
    args = parser.parse_args(argv)
    if args.command == "to-hf" and not (math.isfinite(args.max_shard_gb) and args.max_shard_gb > 0):
        # (before: 0 and -1 wrote a shard per tensor, nan raised a ValueError)
        print(f"error: {ConfigError('--max-shard-gb', args.max_shard_gb, 'a size in GB above 0, e.g. 5')}",
              file=sys.stderr)
        return 2
    try:
        if args.command == "from-hf":
            path = from_hf(args.src, args.workdir)
            print(json.dumps(json.loads((path / "converted.json").read_text())))
        else:
            path = to_hf(args.workdir, args.out, step=args.step, layout=args.layout,
                         max_shard_bytes=int(args.max_shard_gb * 2**30))
            print(json.dumps({"out": str(path), "files": sorted(p.name for p in path.iterdir())}))
    except (ConversionError, ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
