"""The no-QK-norm lab's LR/warmup search (docs/instability.md, issue 61): each run is
python train.py --config configs/instability_lab_noqk.py with the overrides given, sharing one
tokenizer; its summary row is appended to search.jsonl beside this file (noqk-search.jsonl holds
the rows of the logged search). Copy it to workdir/noqk/ and run from the repository root:

    nice -n 10 .venv/bin/python workdir/noqk/search.py NAME LR [FIELD=VALUE ...]

(min_learning_rate is 1% of LR). The search ran before configs/instability_lab_noqk.py had its own
budget: its rows pass train.steps=100 train.batch_size=8 train.warmup_steps=15 (now the lab's),
except t01 and s01 (the QK-norm lab's 200 steps of 16 x 128)."""
import json, math, sys, time
from pathlib import Path

from gattn import cli
from gattn.experiments.study.runner import _share, read_metrics
from gattn.train import trainer

ROOT = Path(__file__).parent


def summarize(name, wd, seconds, stopped, over):
    rows = read_metrics(wd)
    loss = [r["loss"] if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"]) else math.nan
            for r in rows]
    fin = [(x, i + 1) for i, x in enumerate(loss) if math.isfinite(x)]
    mx = max(fin) if fin else (math.nan, 0)
    means = [sum(loss[i:i + 10]) / 10 for i in range(len(loss) - 9)]
    means = [m for m in means if math.isfinite(m)]
    best = min(means) if means else math.nan
    final = means[-1] if means else math.nan
    spikes = rows[-1].get("loss_spikes", 0) if rows else 0
    rec = dict(name=name, over=over, max_loss=mx[0], max_step=mx[1], best=best, final=final, spikes=spikes,
               stopped=stopped, steps=len(rows), nonfinite=sum(not math.isfinite(x) for x in loss),
               seconds=round(seconds))
    print(json.dumps(rec), flush=True)
    with open(ROOT / "search.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


def main():
    name, lr, *over = sys.argv[1:]
    lr = float(lr)
    over = [f"train.learning_rate={lr}", f"train.min_learning_rate={lr / 100}"] + over
    cfg = cli.load("instability_lab_noqk", over)
    wd = ROOT / "runs" / name
    wd.mkdir(parents=True, exist_ok=True)
    _share(wd, ROOT / "shared")
    t = time.perf_counter()
    stopped = False
    try:
        trainer.train(cfg, wd, progress=False)
    except trainer.TrainingStopped as e:
        stopped = str(e)
    summarize(name, wd, time.perf_counter() - t, stopped, over[2:] + [f"lr={lr:g}"])


main()
