"""A researcher's first runs (issue 62, items 4 and 5): `--steps` below a config's warmup shrinks
the warmup and says so in one line; a small corpus keeps a held-out document in every domain
(by either path, text or shards) and every corpus problem is said at once; eval.py --compare says
which steps it compares when a run is unfinished or still training; the evaluation's batch counts
read per domain; the per-layer figure is a grid with y labels; a resume names its step; the docs
list every page and say what gattn.generate needs."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gattn import cli
from gattn.config import Config, ConfigError, DataConfig, ModelConfig, TrainConfig, to_dict
from gattn.data import corpus

from conftest import entry_point, run_config_file

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- warmup and --steps


@pytest.fixture
def trained(monkeypatch):
    """train.py's main() with the trainer replaced: the config it would train (nothing runs)."""
    from gattn.train import trainer

    seen = []
    monkeypatch.setattr(trainer, "train", lambda cfg, workdir, **kw: seen.append(cfg) or {"step": 0})
    return seen


def test_steps_below_the_warmup_shrink_it_in_proportion_and_say_so(tmp_path, trained, capsys):
    assert cli.run_cli(entry_point("train").main, ["--config", "tiny", "--workdir", str(tmp_path / "r"),
                                                   "--steps", "40", "--quiet"]) == 0
    (cfg,) = trained
    assert (cfg.train.steps, cfg.train.warmup_steps) == (40, 5)  # tiny: 50 of 400 steps -> 5 of 40
    notes = [line for line in capsys.readouterr().err.splitlines() if "warmup" in line]
    assert notes == ["note: train.warmup_steps 50 -> 5 for 40 steps (the config's 50 of 400, scaled); "
                     "--config.train.warmup_steps=N sets it"]
    # A warmup the run fits is kept; one the user sets is theirs, and too long is a clear error.
    assert cli.run_cli(entry_point("train").main, ["--config", "tiny", "--workdir", str(tmp_path / "r"),
                                                   "--steps", "60", "--quiet"]) == 0
    assert trained[-1].train.warmup_steps == 50 and "warmup" not in capsys.readouterr().err
    with pytest.raises(ConfigError) as e:
        cli.load("tiny", ["train.steps=40", "train.warmup_steps=50"])
    assert e.value.field == "train.warmup_steps" and e.value.value == 50
    assert str(e.value).startswith("config field 'train.warmup_steps' = 50 is not allowed: expected fewer "
                                   "warmup steps than train.steps (40)"), e.value


def test_a_preset_warmup_is_shrunk_with_its_lr_preset_spelled_out(tmp_path, trained, capsys):
    from gattn.config.train import LR_PRESETS

    argv = ["--config", "moe_15a2b", "--workdir", str(tmp_path / "r"), "--steps", "30", "--quiet"]
    assert cli.run_cli(entry_point("train").main, argv) == 0
    t = trained[-1].train
    peak, floor, warmup = LR_PRESETS["moe_15a2b"]
    assert t.lr_preset == "" and (t.learning_rate, t.min_learning_rate) == (peak, floor)
    assert 1 <= t.warmup_steps < 30 and "lr_preset 'moe_15a2b'" in capsys.readouterr().err


@pytest.mark.slow  # ~1 min; the fast cousin above checks the config train.py builds
def test_train_py_with_tiny_and_40_steps_runs(tmp_path):
    """The command of the issue, at the tiny preset's shapes but a smaller batch and vocabulary."""
    done = subprocess.run([sys.executable, "train.py", "--config", "tiny", "--steps", "40", "--quiet",
                           "--workdir", str(tmp_path / "run"), "--config.train.batch_size=4",
                           "--config.model.vocab_size=512"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "note: train.warmup_steps 50 -> 5 for 40 steps" in done.stderr
    assert "step=40 completed=True" in done.stdout


def test_the_main_job_with_few_steps_shrinks_the_warmup(tmp_path, monkeypatch, capsys):
    from gattn.experiments import main_job, study

    seen = []
    monkeypatch.setattr(study, "run_cells", lambda s, workdir, **kw: seen.append(s))  # None: as after a SIGTERM
    assert main_job.main(["--workdir", str(tmp_path), "--steps", "20", "--quiet"]) == 1
    assert (seen[0].base.train.steps, seen[0].base.train.warmup_steps) == (20, 2)
    assert "train.warmup_steps 50 -> 2 for 20 steps" in capsys.readouterr().err


# --------------------------------------------------------------------------- small corpora


def _names(n: int, held_out: bool, prefix: str = "note") -> list[str]:
    """n file paths (PREFIXi.txt, PREFIX may hold a folder) whose document id hashes into (or out
    of) the ~10% held-out split."""
    return [f for f in (f"{prefix}{i}.txt" for i in range(10_000))
            if (corpus.Document(f, "", "").split == "validation") == held_out][:n]


def _bucket(doc_id: str) -> int:
    return int(corpus.hashlib.sha256(doc_id.encode()).hexdigest()[:8], 16) % 100


def _text(i: int) -> str:
    import pydoc_data.topics

    topics = sorted(pydoc_data.topics.topics)
    return pydoc_data.topics.topics[topics[i % len(topics)]][:3000]


def small_corpus(folder: Path) -> Path:
    """20 files, none of which the hash holds out: 12 at the top ('text'), 8 in law/."""
    for i, name in enumerate(_names(12, False)):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(_text(i))
    (folder / "law").mkdir(parents=True)
    for i, name in enumerate(_names(8, False, "law/art")):
        (folder / name).write_text(_text(100 + i))
    return folder


def test_a_small_corpus_keeps_a_held_out_document_in_every_domain(tmp_path):
    docs = list(corpus.documents(str(small_corpus(tmp_path / "c")), 0))
    assert len(docs) == 20 and not any(corpus.Document(d.id, "", "").split == "validation" for d in docs)
    for domain in ("text", "law"):
        mine = [d for d in docs if d.domain == domain]
        held = [d for d in mine if d.split == "validation"]
        # the one the hash ranks nearest to the held-out split: stable, whatever else is added
        assert [d.id for d in held] == [min((d.id for d in mine), key=lambda i: (_bucket(i), i))]
    corpus.fingerprint(str(tmp_path / "c"), 0)  # (refused before: no held-out document)
    # A domain the hash holds out entirely keeps one document to train on; a one-document
    # domain keeps the hash's split (the one it lacks is a warning); other splits are the hash's.
    (tmp_path / "d" / "all").mkdir(parents=True)
    for name in _names(2, True, "all/h"):
        (tmp_path / "d" / name).write_text("held out by the hash")
    (tmp_path / "d" / "one").mkdir()
    (tmp_path / "d" / _names(1, True, "one/z")[0]).write_text("alone")
    for name in _names(30, False, "t") + _names(3, True, "v"):
        (tmp_path / "d" / name).write_text(f"plain {name}")
    splits = {(d.domain, d.split) for d in corpus.documents(str(tmp_path / "d"), 0)}
    assert ("all", "train") in splits and ("all", "validation") in splits and ("one", "validation") in splits
    top = [d for d in corpus.documents(str(tmp_path / "d"), 0) if d.domain == "text"]
    assert all(d.split == corpus.Document(d.id, "", "").split for d in top)


def test_every_corpus_problem_is_said_at_once(tmp_path):
    from gattn.data.tokenizer import load_tokenizer

    source = tmp_path / "c"
    for domain in ("law", "news"):
        (source / domain).mkdir(parents=True)
        (source / domain / "empty.txt").write_text("")
    for i in range(3):
        (source / f"{i}.txt").write_text(f"a little text {i}")
    with pytest.raises(corpus.DataError) as e:
        corpus.fingerprint(str(source), 0)
    assert "'law'" in str(e.value) and "'news'" in str(e.value) and "\n" not in str(e.value)
    cfg = Config(model=ModelConfig(vocab_size=4096), data=DataConfig(source=str(source)))
    with pytest.raises(ConfigError) as e:
        load_tokenizer(cfg, tmp_path / "run", fresh=True)
    said = str(e.value)
    assert "'law'" in said and "'news'" in said and "model.vocab_size" in said and "\n" not in said, said
    assert re.search(r"at most \d+ to train a tokenizer", said), said


@pytest.mark.slow  # ~10 s; fast cousins: the split above, and test_train's resume with more steps
def test_a_20_file_corpus_trains_on_its_first_try_and_a_resume_names_its_step(tmp_path, capsys):
    """End to end in this process (two short runs): the corpus of `small_corpus`, a 512-piece
    vocabulary, validation on both domains; then a resume with more steps says where it starts."""
    (tmp_path / "tiny.py").write_text(run_config_file(steps=2, warmup_steps=1, eval_every=2, checkpoint_every=2))
    source = small_corpus(tmp_path / "c")
    argv = ["--config", str(tmp_path / "tiny.py"), "--workdir", str(tmp_path / "run"), "--quiet",
            f"--config.data.source={source}"]
    train = entry_point("train").main
    assert cli.run_cli(train, argv) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"val_loss/law", "val_loss/text"} <= {k for r in rows for k in r}
    capsys.readouterr()
    assert cli.run_cli(train, argv + ["--steps", "3"]) == 0
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("resumed")] == [
        f"resumed from step 2 ({tmp_path / 'run' / 'checkpoints'})"], err


def test_prepare_keeps_the_same_held_out_documents_as_the_text_path(tmp_path):
    from gattn.data import prepare, shards

    from test_prepare import hf_tokenizer

    source = small_corpus(tmp_path / "c")
    prepare.prepare(str(source), str(hf_tokenizer(tmp_path / "tok")), str(tmp_path / "s"), num_shards=2, quiet=True)
    m = json.loads((tmp_path / "s" / shards.MANIFEST).read_text())
    held = {d: c["held_out"]["documents"] for d, c in m["counts"]["domains"].items()}
    assert held == {"law": 1, "text": 1}
    # the same documents held out as the text path holds out (their bytes per split agree)
    expected = corpus.count(corpus.documents(str(source), 0), lambda t: 0)
    assert {d: {s: c[s]["bytes"] for s in c} for d, c in m["counts"]["domains"].items()} == \
        {d: {s: c[s]["bytes"] for s in c} for d, c in expected["domains"].items()}


# --------------------------------------------------------------------------- eval.py --compare


CFG = Config(model=ModelConfig(vocab_size=64, d_model=16, num_layers=1, q_heads=2, kv_heads=1, head_dim=8, d_ff=32),
             train=TrainConfig(steps=400, warmup_steps=10), data=DataConfig(eval_batches=4))


def _run(root: Path, name: str, step: int) -> Path:
    """A run directory with a results.json measured at `step` as --compare asks (nothing measured)."""
    from gattn.eval import evaluate

    run = root / name
    (run / "eval").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(to_dict(CFG)))
    (run / "metrics.jsonl").write_text(json.dumps({"step": step, "loss": 3.0}) + "\n")
    overall = {"m_act": 5.0, "m_act_max": 5.0, "f_attn": 0.2, "sink_head_share": 0.0}
    (run / "eval" / "results.json").write_text(json.dumps({
        "workdir": str(run), "step": step, "variant": "baseline", "overrides": [],
        "perplexity": {"docs": {"loss": 3.0, "ppl": 20.0}},
        "measurements": {"overall": overall, "per_layer": [{"layer": 0, **overall}]},
        "settings": evaluate.settings(CFG, step, [], None, 1)}))
    return run


def test_compare_says_which_steps_it_compares_when_a_run_is_still_training(tmp_path, monkeypatch):
    from gattn.eval import evaluate
    from gattn.train import lease

    done, busy = _run(tmp_path, "baseline", 400), _run(tmp_path, "gated", 1)
    monkeypatch.setattr(evaluate.checkpoint, "saved_steps", lambda w: [400] if Path(w).name == "baseline" else [1])
    lines = []
    with lease.hold(busy):  # gated's train.py is still running
        evaluate.compare([done, busy], max_batches=1, figures=False, log=lines.append)
    warned = [line for line in lines if line.startswith("warning")]
    assert len(warned) == 1, lines
    assert re.search(r"baseline at step 400 \(its last\).*gated at step 1 of 400 \(still training", warned[0]), warned
    lines.clear()
    evaluate.compare([done, tmp_path / "baseline"], max_batches=1, figures=False, log=lines.append,
                     out_dir=tmp_path / "same")
    assert not [line for line in lines if line.startswith("warning")]  # the same step, both finished


def test_the_perplexity_line_counts_batches_per_domain():
    from gattn.eval import evaluate

    batches = {"code": ["b"], "docs": ["b"]}
    line = evaluate.perplexity_line("gated", 6, batches, CFG)
    assert line == ("gated: step 6: perplexity over 1 held-out batch per domain (code, docs), all their "
                    "held-out text: fewer than data.eval_batches = 4"), line
    assert evaluate.perplexity_line("g", 6, {"a": [1] * 4, "b": [1] * 3}, CFG) == (
        "g: step 6: perplexity over 3 to 4 held-out batches per domain (a 4, b 3; data.eval_batches = 4)")
    assert evaluate.perplexity_line("g", 6, {"a": [1] * 4}, CFG) == (
        "g: step 6: perplexity over 4 held-out batches per domain (a)")


# --------------------------------------------------------------------------- the per-layer figure


def test_the_per_layer_figure_is_a_grid_with_y_labels_and_whole_titles(monkeypatch, tmp_path):
    """(It was one row of six panels, 2772x396 pixels, its titles cut and no y labels.)"""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    from gattn.eval import plots

    figures, save = [], plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or save(fig, path))
    rows = [{"layer": i, "m_act": 10.0 + i, "m_act_per_token": 2.0, "ffn_act": 3.0, "f_attn": 0.1 * i,
             "sink_head_share": 0.0, "gate_score": 0.3} for i in range(4)]
    path = plots.per_layer({"baseline": {"per_layer": rows}, "gated": {"per_layer": rows}}, tmp_path / "p.png")
    w, h = Image.open(path).size
    assert w / h < 2.5 and h >= 600, (w, h)  # a grid, not a strip
    renderer = FigureCanvasAgg(figures[0]).get_renderer()
    panels = [ax for ax in figures[0].axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == [p[1] for p in plots.PER_LAYER]
    for ax in panels:
        box = ax.get_window_extent(renderer)
        assert ax.get_ylabel(), ax.get_title()
        assert ax.title.get_window_extent(renderer).width <= box.width, ax.get_title()  # whole titles
        assert ax.yaxis.label.get_window_extent(renderer).height <= box.height, ax.get_ylabel()


# --------------------------------------------------------------------------- docs


def test_the_readme_lists_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    listed = set(re.findall(r"\(docs/([\w-]+\.md)\)", readme[readme.index("## Documentation"):]))
    assert {p.name for p in (ROOT / "docs").glob("*.md")} <= listed


def test_generate_needs_no_extra_and_the_docs_say_so():
    """(docs/evaluation.md said it needs the lm-eval extra.) Everything `python -m gattn.generate`
    imports for a run or a Hugging Face folder imports without lm-eval, transformers or torch."""
    text = (ROOT / "docs" / "evaluation.md").read_text()
    section = text[text.index("## Generating text"):text.index("## Cached decoding")]
    assert "lm-eval extra" not in section and "no extra" in section
    blocker = ("import sys, importlib.abc\n"
               "class Block(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('lm_eval', 'transformers', 'torch'):\n"
               "            raise ImportError(name + ' blocked')\n"
               "sys.meta_path.insert(0, Block())\n"
               "import gattn.generate, gattn.interop.runs, gattn.interop.convert, gattn.eval.decode\n"
               "import gattn.eval.speculative, gattn.data.tokenizer, gattn.train.rundir\n")
    done = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
