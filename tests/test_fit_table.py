"""The generated tables of the presets as configured (gattn/experiments/fit_table.py): each fit in
docs/fits/ describes its preset as configured, the pages hold the tables as generated, and no page
that should quote them states a preset's mesh in a table of its own."""

import json
import re
import shutil

import pytest

from gattn.config import ConfigError
from gattn.experiments import fit_table, plan

ROOT = fit_table.ROOT
FOUND = {r.preset: r for r in fit_table.rows()}


@pytest.mark.parametrize("preset", fit_table.PRESETS)
def test_each_fit_describes_its_preset_as_configured(preset):
    """mesh, batch, microbatches, remat, loss chunk, the MoE path, and no override the preset lacks:
    a refit that changes a preset without its JSON (or the reverse) fails here."""
    row = FOUND[preset]
    if row.fit is None:  # (the lead writes the missing ones; their row says so)
        assert f"no fit yet: `python bench/fit_presets.py --preset {preset}" in row.measured()[0]
        pytest.skip(f"docs/fits/{preset}.json does not exist yet")
    assert row.stale == [], f"docs/fits/{preset}.json is stale: {row.stale}"
    assert row.fit["topology"] == fit_table.configured_slices()[preset]  # the slice bench's ROWS fit it on


def test_the_pages_hold_the_tables_as_generated():
    assert fit_table.stale_pages(list(FOUND.values())) == []
    blocks = {page: [m.group("name") for m in fit_table.BLOCK.finditer((ROOT / page).read_text())]
              for page in fit_table.PAGES}
    assert {"presets", "maxtext"} <= set(blocks["docs/presets.md"])
    assert {"slices", "plan moe_15a2b v5p-64 7"} <= set(blocks["docs/pod-slice.md"])


def hand_rows(text: str) -> list[str]:
    """Table rows outside the generated blocks that name a paper-scale preset in their first cell,
    in a table with a mesh column: a preset's settings stated by hand."""
    text = fit_table.BLOCK.sub("", text)
    found, header = [], ""
    for line in (x.strip() for x in text.splitlines()):  # (a table in a list item is indented)
        if not line.startswith("|"):
            header = ""
            continue
        if not header:
            header = line
            continue
        first = line.split("|")[1]
        if "mesh" in header.lower() and any(f"`{p}`" in first for p in fit_table.PRESETS):
            found.append(line)
    return found


@pytest.mark.parametrize("page", ["docs/pod-slice.md", "docs/moe-and-mesh.md", "README.md"])
def test_no_page_states_a_presets_mesh_by_hand(page):
    assert hand_rows((ROOT / page).read_text()) == []


def test_the_hand_table_rule_finds_the_old_pod_slice_table():
    """The table pod-slice.md had before (its MoE on 2, 8, 4 where the preset runs 1, 32, 1, 1)."""
    old = ("  | preset | mesh (data, expert, model) | global batch |\n  |---|---|---|\n"
           "  | `dense_1p7b` | 16, 1, 4 | 16 |\n  | `moe_15a2b` (capacity 1.25) | 2, 8, 4 | 16 |\n")
    assert len(hand_rows(old)) == 2 and hand_rows(old.replace("mesh", "slice")) == []


@pytest.fixture
def fits(tmp_path):
    for path in plan.FITS.glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    return tmp_path


def edit(fits, preset, **changes):
    path = fits / f"{preset}.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_a_refit_preset_makes_its_row_stale(fits):
    edit(fits, "moe_15a2b", mesh={"data": 1, "fsdp": 4, "expert": 8, "model": 1}, microbatches=2)
    row = fit_table.Row("moe_15a2b", "v5p:4x4x2", fits)
    assert row.stale == ["train.microbatches: the fit has 2, the preset 1",
                         "mesh: the fit has {'data': 1, 'fsdp': 4, 'expert': 8, 'model': 1}, the preset "
                         "{'data': 1, 'fsdp': 32, 'expert': 1, 'model': 1}"]
    assert row.measured()[0].startswith("stale fit (") and "train.microbatches: the fit has 2" in row.measured()[0]
    table = fit_table.presets_table([row])
    assert "| `moe_15a2b` | v5p-64 (v5p:4x4x2), 32 chips, 8 hosts | 1, 32, 1, 1 | 1 (32) |" in table


def test_an_override_the_preset_lacks_makes_its_row_stale(fits):
    edit(fits, "dense_1p7b", overrides=["--config.exec.remat=full"])
    assert fit_table.Row("dense_1p7b", "v5p:4x4x2", fits).stale == [
        "the fit was compiled with --config.exec.remat=full; the preset has exec.remat='none'"]


def test_a_preset_without_a_fit_has_a_row_that_says_so(tmp_path):
    row = fit_table.Row("dense_1p7b", "v5p:4x4x2", tmp_path)
    cells = row.measured()
    assert cells[0] == ("no fit yet: `python bench/fit_presets.py --preset dense_1p7b --topology v5p:4x4x2 > "
                        "docs/fits/dense_1p7b.json`") and set(cells[1:]) == {"-"}
    assert "| 3.73 |" not in fit_table.slices_table([row]) and "| no fit yet |" in fit_table.slices_table([row])


def test_rewrite_fills_a_block_and_leaves_the_rest(fits):
    found = [fit_table.Row("dense_1p7b", "v5p:4x4x2", fits)]
    text = ("before\n<!-- begin fit_table:slices (note) -->\nold\n<!-- end fit_table:slices -->\nafter\n")
    new = fit_table.rewrite(text, found, fits)
    assert new.startswith("before\n<!-- begin fit_table:slices (note) -->\n| preset |")
    assert new.endswith("| a new run |\n<!-- end fit_table:slices -->\nafter\n")
    assert fit_table.rewrite(new, found, fits) == new
    with pytest.raises(ConfigError, match="fit_table block"):
        fit_table.rewrite(text.replace("slices", "nothing"), found, fits)


def test_the_check_command_fails_on_a_stale_fit(fits, monkeypatch, capsys):
    edit(fits, "moe_15a2b", microbatches=2)
    monkeypatch.setattr(plan, "FITS", fits)
    monkeypatch.setattr(fit_table, "rows", lambda: [fit_table.Row(p, t, fits)
                                                    for p, t in fit_table.configured_slices().items()])
    assert fit_table.main(["--check"]) == 1
    assert re.search(r"docs/fits/moe_15a2b.json is stale: train.microbatches", capsys.readouterr().err)


def side_variant(name, step_s, preset="dense_1p7b", topology="v5p-64", unpriced=(), **extra):
    """A variant object as bench/maxtext_side.py writes it, with the fields the maxtext block reads."""
    kernels = {"splash_fwd": {"runs": 1, "tflops": 1.0, "hbm_gib": 1.0, "priced_by": "formula"},
               **{k: {"runs": 1, "tflops": 0.0, "hbm_gib": 1.0, "priced_by": "unpriced"} for k in unpriced}}
    v = {"variant": name, "preset": preset, "model": "qwen3-1.7b", "topology": topology,
         "overrides": ["num_vocab_tiling=8"], "remat": "remat_policy=full (set; MaxText's base.yml default is 'full')",
         "num_vocab_tiling": 8, "gradient_accumulation_steps": 1, "mesh": {"fsdp": 32},
         "memory_gib_per_chip": 30.0, "peak_gib_per_chip": 29.0, "traffic": {"total_gib": 20.0},
         "step": {"counted_tflops_per_chip": 2000.0, "hbm_gib_per_step": 16000.0,
                  "unpriced_kernels": ["AllocateBuffer", *unpriced], "kernels": kernels,
                  "roofline": {"step_s": step_s, "bound": "hbm"}}}
    if preset is None:
        del v["preset"]
    return {**v, **extra}


def write_side(side, **files):
    side.mkdir(exist_ok=True)
    for stem, variants in files.items():
        (side / f"{stem}.json").write_text(json.dumps(variants))
    return side


def test_the_maxtext_block_takes_the_fastest_fitting_comparable_variant_of_the_newest_files(fits, tmp_path):
    """A variant in two files is the later file's (by name: a suffixed file after its bare date); a
    faster one with a Mosaic kernel unpriced, without a preset in its object, on another slice or
    that did not fit is listed as not comparable, not taken."""
    oom = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required for "
           "HLO temporaries (150.01G) exceeds available HBM (95.73G). HLO module: jit_train_step.")
    side = write_side(tmp_path / "side",
                      **{"2026-01-01": [side_variant("again", 1.0), side_variant("default", 0.2, preset=None)],
                         "2026-01-01-later": [side_variant("again", 9.0), side_variant("fast", 4.0),
                                              side_variant("unpriced", 0.5, unpriced=["splash_dq"]),
                                              side_variant("big", 0.3, topology="v5p-128"),
                                              {"variant": "oom", "preset": "dense_1p7b", "fits": False, "error": oom,
                                               "topology": "v5p-64", "overrides": ["remat_policy=minimal"]}]})
    row = fit_table.Row("dense_1p7b", "v5p:4x4x2", fits)
    table = fit_table.maxtext_table([row], side)
    best = next(line for line in table.splitlines() if line.startswith("| `dense_1p7b` |"))
    ours = row.fit["train"]["roofline"]["step_s"]
    assert best.split(" | ")[1] == "`fast` (`qwen3-1.7b`, 2026-01-01-later.json)"
    assert f"| {ours:.2f} ({row.fit['train']['roofline']['bound']}) / 4.00 (hbm) | **{ours / 4:.3f}** |" in best
    assert "| remat full, microbatches 1, vocabulary tiled 8, fsdp 32 |" in best
    others = {line.split(" | ")[1].split()[0]: line.split(" | ")[-1] for line in table.splitlines()
              if "`dense_1p7b` | `" in line and line != best}
    assert others == {"`again`": "yes, slower |",
                      "`unpriced`": "no: its Mosaic kernels unpriced (splash_dq) |",
                      "`big`": "no: on v5p-128, the preset's fit on v5p-64 |",
                      "`default`": "no: its object names no preset (written before PRESET_OF) |",
                      "`oom`": "no: does not fit: 150.01G of temporaries, 95.73G available |"}
    assert "2026-01-01.json, 2026-01-01-later.json in docs/maxtext-side/" in table


def test_a_step_ratio_near_one_shows_which_side_it_is_on(fits, tmp_path):
    ours = fit_table.Row("dense_1p7b", "v5p:4x4x2", fits)
    step = ours.fit["train"]["roofline"]["step_s"]
    for theirs, shown in ((step * 1.0003, "**0.9997**"), (step, "**1.000**"), (step / 0.9, "**0.900**")):
        side = write_side(tmp_path / "side", **{"2026-01-01": [side_variant("fast", theirs)]})
        assert f"| {shown} |" in fit_table.maxtext_table([ours], side)


def test_a_preset_without_a_maxtext_variant_or_a_fit_says_so(tmp_path):
    side = write_side(tmp_path / "side", **{"2026-01-01": [side_variant("fast", 4.0)]})
    found = [fit_table.Row(p, t, tmp_path) for p, t in (("dense_1p7b", "v5p:4x4x2"), ("qwen3_5_2b", "v5p:2x2x4"),
                                                         ("extend_1p7b_32k", "v5p:4x4x2"))]
    lines = fit_table.maxtext_table(found, side).splitlines()
    assert next(x for x in lines if x.startswith("| `dense_1p7b` |")).split(" | ")[3:5] == [
        "no fit yet / 4.00 (hbm)", "-"]  # no ratio without gattn's fit
    assert lines[5].startswith(f"| `qwen3_5_2b` | {fit_table.NO_MAXTEXT['qwen3_5_2b']} | - | no fit yet / - |")
    assert lines[6].startswith("| `extend_1p7b_32k` | no MaxText variant run | - |")


def test_a_changed_maxtext_run_makes_the_page_stale(tmp_path, monkeypatch, capsys):
    side = tmp_path / "side"
    shutil.copytree(fit_table.MAXTEXT_SIDE, side)
    newest = sorted(side.glob("*.json"), key=lambda p: p.stem)[-1]
    variants = json.loads(newest.read_text())
    next(v for v in variants if (v.get("step") or {}).get("roofline"))["step"]["roofline"]["step_s"] += 1.0
    newest.write_text(json.dumps(variants))
    monkeypatch.setattr(fit_table, "MAXTEXT_SIDE", side)
    assert fit_table.stale_pages(list(FOUND.values())) == [
        "docs/presets.md: the block fit_table:maxtext is stale: run python -m gattn.experiments.fit_table --write"]
    monkeypatch.setattr(fit_table, "rows", lambda: list(FOUND.values()))
    assert fit_table.main(["--check"]) == 1
    assert "fit_table:maxtext is stale" in capsys.readouterr().err


def test_a_maxtext_file_that_is_not_a_list_of_variants_is_refused(tmp_path):
    side = write_side(tmp_path / "side", **{"2026-01-01": {"variant": "fast"}})
    with pytest.raises(ConfigError, match=r"2026-01-01.json.*a list of objects, each with a 'variant' name"):
        fit_table.maxtext_variants(side)
