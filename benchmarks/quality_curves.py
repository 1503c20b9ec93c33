"""Learning curves of the primary pair (quality/plan.md): the validation set translated and
scored at kept checkpoints :data:`CURVE_EVERY` updates apart, for the runs whose every
checkpoint is kept (``quality_plan.KEEP_CHECKPOINTS``), then tabulated and plotted (the mean
over seeds, and the band from the lowest seed to the highest).

    .venv/bin/python benchmarks/quality.py curves [--commit]   # resumable: a scored point is kept

Each point is the runner's validation (``Runner.validate``: the demo's beam search,
``ea-fairseq-bleu --mode wmt``) of one checkpoint, unaveraged, recorded like a run
(``curves/SYSTEM/seedK/updateU/``: the scores, ``point.json`` with the commands, CPU time, the
machine and the commit), staged beside its place and moved there once scored. A run whose
checkpoints are gone before any of its points is scored (:func:`lost`) is trained again by
``quality.py run --rerun`` into ``reruns/``, and its points are scored from the re-run's
checkpoints once it has finished (``point.json`` names the checkpoint's place); the report's
re-run section says whether the re-run translates the test set as the stored run does.

The plan asks for every 200 updates; the runs save a checkpoint every 60 (the demo's
``DEMO_UPDATES / 20``), of which 200 is no multiple. :data:`CURVE_EVERY` is 240: the interval
nearest 200 that the kept checkpoints give and that ends at the runs' last update (1200),
set before any point was scored.
"""
import json
import os
import re
import shutil
import statistics
import sys
from typing import Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import quality_results  # noqa: E402
from quality_plan import KEEP_CHECKPOINTS, SRC, SYSTEMS, TGT  # noqa: E402

CURVE_EVERY = 240
FIGURE = "curves.svg"  # in the results directory
_CHECKPOINT = re.compile(r"checkpoint_\d+_(\d+)\.pt")
_POINT = re.compile(r"update(\d+)")


def kept_checkpoints(train_dir: str) -> Dict[int, str]:
    """``{update: path}`` of the checkpoints fairseq saved every so many updates in
    ``train_dir``, at multiples of :data:`CURVE_EVERY`."""
    found = {}
    for name in sorted(os.listdir(train_dir)) if os.path.isdir(train_dir) else ():
        match = _CHECKPOINT.fullmatch(name)
        if match and int(match.group(1)) % CURVE_EVERY == 0:
            found[int(match.group(1))] = os.path.join(train_dir, name)
    return found


def point_dir(results: str, system: str, seed: int, update: int) -> str:
    return os.path.join(results, "curves", system, f"seed{seed}", f"update{update}")


def train_dir(runner, system: str, seed: int):
    """The training directory (in the work directory) holding the kept checkpoints of the run
    ``system`` seed ``seed``: the run's own, or where they are gone, its re-run's
    (``quality.py run --rerun`` trains such a run again, :func:`lost`), once it has finished; None
    if neither has any."""
    for final in (runner.run_dir(system, seed), runner.rerun_dir(system, seed)):
        found = os.path.join(runner.work, os.path.relpath(final, runner.results), "train", SYSTEMS[system][0])
        if kept_checkpoints(found) and _finished(runner, final):
            return found
    return None


def _finished(runner, final: str) -> bool:
    done = runner.finished_at(final)
    return bool(done) and done["status"] == "finished"


def _curve_runs(runner):
    """(system, seed) of every finished run whose checkpoints are kept for the curves."""
    for system, first in sorted(KEEP_CHECKPOINTS.items()):
        for seed in runner.seeds(system):
            if seed >= first and _finished(runner, runner.run_dir(system, seed)):
                yield system, seed


def lost(runner) -> List[Tuple[str, int]]:
    """(system, seed) of the finished runs that keep their checkpoints for the curves, none of
    whose points is scored and whose checkpoints are gone from the work directory (and from
    any re-run's): ``quality.py run --rerun`` trains them again, into ``reruns/``, where the
    report also sets them beside the stored runs."""
    return [(system, seed) for system, seed in _curve_runs(runner)
            if not os.path.isdir(os.path.dirname(point_dir(runner.results, system, seed, 0)))
            and train_dir(runner, system, seed) is None]


def score_points(runner) -> List[str]:
    """Every point not scored yet, of every finished run whose checkpoints are kept (or whose
    re-run's are); the directories written."""
    written = []
    for system, seed in _curve_runs(runner):
        train = train_dir(runner, system, seed)
        for update, checkpoint in sorted(kept_checkpoints(train).items()) if train else ():
            final = point_dir(runner.results, system, seed, update)
            if os.path.exists(os.path.join(final, "point.json")):
                continue
            stage = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.partial")
            shutil.rmtree(stage, ignore_errors=True)
            record = {"system": system, "seed": seed, "update": update,
                      "checkpoint": os.path.relpath(checkpoint, runner.work),
                      "git": runner.git, "machine": runner.machine, "commands": []}
            print(f"[quality] curve: {system} seed {seed} at {update} updates", file=sys.stderr, flush=True)
            scratch = os.path.join(os.path.dirname(os.path.dirname(train)), "curves", f"update{update}")
            if runner.validate(record, checkpoint, scratch, stage) != 0:
                raise SystemExit(f"quality.py curves: {system} seed {seed} at {update} updates: {record['failure']}")
            runner.link_refs(stage)
            quality_results.write_json(os.path.join(stage, "point.json"), record)
            shutil.rmtree(final, ignore_errors=True)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.rename(stage, final)
            shutil.rmtree(scratch, ignore_errors=True)
            written.append(final)
    return written


#: ``{system: {update: {seed: (sacreBLEU, chrF)}}}``
Points = Dict[str, Dict[int, Dict[int, Tuple[float, float]]]]


def points(results: str) -> Points:
    """The scored points of ``results``."""
    out: Points = {}
    root = os.path.join(results, "curves")
    for system in sorted(os.listdir(root)) if os.path.isdir(root) else ():
        for seed_dir in sorted(os.listdir(os.path.join(root, system))):
            for update_dir in os.listdir(os.path.join(root, system, seed_dir)):
                match = _POINT.fullmatch(update_dir)
                scores = os.path.join(root, system, seed_dir, update_dir, f"valid.{SRC}-{TGT}.scores.json")
                if not match or not seed_dir.startswith("seed") or not os.path.exists(scores):
                    continue
                with open(scores, encoding="utf-8") as f:
                    metrics = json.load(f)["metrics"]
                out.setdefault(system, {}).setdefault(int(match.group(1)), {})[int(seed_dir[4:])] = (
                    metrics["sacrebleu"]["score"], metrics["chrf"]["score"])
    return out


def _cell(scores: Dict[int, Tuple[float, float]], metric: int) -> str:
    values = [s[metric] for _, s in sorted(scores.items())]
    spread = f" ± {statistics.stdev(values):.2f}" if len(values) > 1 else ""
    return f"{statistics.mean(values):.2f}{spread} ({len(values)})"


def section(curves: Points, figure: str = FIGURE) -> List[str]:
    """The report's section of the scored points ``curves`` (:func:`points`): a table of the mean
    ± standard deviation (seeds) of validation sacreBLEU and chrF per update and system, and the
    figure (:func:`plot`) at ``figure`` (relative to the report)."""
    if not curves:
        return ["No point scored yet (`benchmarks/quality.py curves`)."]
    systems = sorted(curves)
    updates = sorted({u for c in curves.values() for u in c})
    head = ["updates"] + [f"{s}, {m}" for s in systems for m in ("sacreBLEU", "chrF")]
    rows = [[str(u)] + [_cell(curves[s][u], i) if u in curves[s] else "" for s in systems for i in (0, 1)]
            for u in updates]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]
    return [f"Validation scores of single (unaveraged) checkpoints every {CURVE_EVERY} updates (the plan's 200 is no "
            "multiple of the runs' 60-update checkpoints; 240 is the nearest that ends at the last update), the mean "
            "± standard deviation over seeds (how many in brackets); the figure shows the mean and the band from the "
            "lowest seed to the highest.", "", *lines, "", f"![learning curves]({figure})"]


def plot(curves: Points, path: str) -> bool:
    """The figure of :func:`section` at ``path`` (SVG, the same bytes for the same points);
    False where no point is scored."""
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = "quality-curves"
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for i, (ax, metric) in enumerate(zip(axes, ("sacreBLEU", "chrF"))):
        for system in sorted(curves):
            updates = sorted(curves[system])
            values = [[s[i] for s in curves[system][u].values()] for u in updates]
            ax.plot(updates, [statistics.mean(v) for v in values], marker="o", label=system)
            ax.fill_between(updates, [min(v) for v in values], [max(v) for v in values], alpha=0.25)
        ax.set_xlabel("updates")
        ax.set_ylabel(f"validation {metric}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    tmp = path + ".tmp"
    fig.savefig(tmp, format="svg", metadata={"Date": None, "Creator": None})
    plt.close(fig)
    os.replace(tmp, path)
    return True
