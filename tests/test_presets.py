"""The paper-scale presets follow the paper, and say where they do not: the RoPE protocol of
Sec. 4.4, AdamW without clipping (Sec. 3.1), and a source for every setting (docs/presets.md)."""

import dataclasses
from pathlib import Path

import pytest

from gattn import cli
from gattn.experiments import provenance, tables

ROOT = Path(__file__).resolve().parents[1]
EXTENSIONS = [name for name in cli.presets() if name.startswith("extend_")]


@pytest.mark.parametrize("name", ["dense_1p7b", "dense_1p7b_48l", "moe_15a2b", "tiny"])
def test_pretraining_presets_use_rope_base_10k(name):
    assert cli.load(name).model.rope_base == 10_000.0  # Sec. 4.4: "from 10k to 1M"


@pytest.mark.parametrize("name", EXTENSIONS)
def test_each_extension_raises_the_rope_base_of_the_preset_it_continues(name):
    """Sec. 4.4: base 10k -> 1M for the longer context, and nothing else of the architecture
    changes (train.init_from accepts the source run)."""
    continues = provenance.preset_module(name).CONTINUES
    base, ext = cli.load(continues).model, cli.load(name).model
    assert (base.rope_base, ext.rope_base) == (10_000.0, 1_000_000.0)
    assert dataclasses.replace(ext, rope_base=base.rope_base) == base
    assert cli.load(name).train.seq_len > cli.load(continues).train.seq_len


def test_the_extension_presets_are_found():
    assert {"extend_1p7b_32k", "extend_tiny"} <= set(EXTENSIONS)


@pytest.mark.parametrize("name", provenance.PAPER_PRESETS)
def test_paper_presets_do_not_clip_and_clipping_is_one_flag_away(name):
    assert cli.load(name).train.grad_clip == 0  # Sec. 3.1: AdamW's defaults, no clipping stated
    assert cli.load(name, ["train.grad_clip=1.0"]).train.grad_clip == 1.0


@pytest.mark.parametrize("name", provenance.PAPER_PRESETS)
def test_every_setting_has_a_source(name):
    """Every field gets a source; a field the preset changes from the schema's default gets one
    from the preset itself (not the default's), unless it is bookkeeping or execution; and the
    preset's PROVENANCE names only real fields."""
    module = provenance.preset_module(name)
    rows = provenance.table(name)
    assert [r["field"] for r in rows if not r["source"]] == []
    owed = [p for p, v, d in provenance.fields(cli.load(name))
            if v != d and p.split(".")[0] in ("model", "train")
            and p.split(".")[-1] not in provenance.BOOKKEEPING and p not in module.PROVENANCE]
    assert owed == []
    assert set(module.PROVENANCE) <= {r["field"] for r in rows}
    ours = [r for r in rows if r["source"].startswith("ours")]
    assert ours and "ours" in module.__doc__.lower()


def test_ours_is_marked_where_the_issue_found_it_unmarked():
    """QK-norm, the MoE loss weights and renormalised top-k, the dense warmup and floor, the
    initialisation and the fitted widths are ours; the RoPE base and clipping are the paper's."""
    dense = {r["field"]: r["source"] for r in provenance.table("dense_1p7b")}
    moe = {r["field"]: r["source"] for r in provenance.table("moe_15a2b")}
    for src in (dense["model.qk_norm"], moe["model.qk_norm"], moe["model.moe.lbl_coef"],
                moe["model.moe.z_loss_coef"], moe["model.moe.renormalize"], moe["model.vocab_size"],
                moe["model.moe.expert_width"], dense["train.warmup_steps"],
                dense["train.min_learning_rate"], dense["model.init_std"]):
        assert src.startswith("ours")
    for src in (dense["model.rope_base"], moe["model.rope_base"], dense["train.grad_clip"]):
        assert src.startswith("Sec.")


def test_docs_presets_md_holds_the_generated_tables():
    assert provenance.markdown() in (ROOT / "docs" / "presets.md").read_text()


def test_params_cli_prints_the_provenance(capsys):
    tables.main(["--provenance", "moe_15a2b"])
    out = capsys.readouterr().out
    assert "| `model.moe.expert_width` | 704 | ours: fitted" in out
