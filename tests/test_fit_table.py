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
    assert "presets" in blocks["docs/presets.md"]
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
