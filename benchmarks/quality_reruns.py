"""The stored runs still describe the code (quality/plan.md): the plan's seeds of the primary
pair (:data:`quality_plan.RERUNS`) trained again, once, at the commit checked out when
``quality.py run --rerun`` runs (and the learning curves' runs whose checkpoints are gone,
:func:`quality_curves.lost`), each into ``reruns/SYSTEM/seedK/`` in a run's layout, and set here beside the stored
run ``runs/SYSTEM/seedK/``: both runs' commits and CPUs, each metric's score of both, and how
many test sentences translate differently. The same hypotheses at another commit say that the
code between the two trains and translates that run alike; a difference is reported, with the
CPUs (another instruction set can change floating-point sums), never averaged in.

    .venv/bin/python benchmarks/quality.py run --systems transformer_lite ea_transformer_lite --rerun
"""
import glob
import os
from typing import List

from quality_plan import SRC, TGT
from quality_results import LABEL, METRICS, _f, _lines, _read, _scores_json


def compared(results: str) -> List[dict]:
    """Every rerun beside its stored run: ``{system, seed, stored, rerun, scores, sentences,
    different}`` (``stored``/``rerun``: commit and CPU; ``scores``: metric -> [stored, rerun];
    ``different``: test sentences whose hypotheses differ); a rerun that failed, has no stored
    run or whose files cannot be read: ``{system, seed, rerun, problem}``."""
    rows = []
    for path in sorted(glob.glob(os.path.join(results, "reruns", "*", "seed*", "run.json"))):
        again = dict(_read(path), dir=os.path.dirname(path))
        row = {"system": again["system"], "seed": again["seed"], "rerun": _at(again)}
        stored_path = os.path.join(results, "runs", again["system"], f"seed{again['seed']}", "run.json")
        if again["status"] != "finished":
            rows.append(dict(row, problem=f"the re-run {again['status']}: {again.get('failure', 'see its run.json')}"))
            continue
        if not os.path.isfile(stored_path):
            rows.append(dict(row, problem="no stored run of that seed to compare with"))
            continue
        stored = dict(_read(stored_path), dir=os.path.dirname(stored_path))
        try:
            hyps = [_lines(os.path.join(r["dir"], "eval", f"test.{SRC}-{TGT}.hyp.sacrebleu")) for r in (stored, again)]
            scores = [_read(_scores_json(r))["metrics"] for r in (stored, again)]
        except (OSError, SystemExit) as e:
            rows.append(dict(row, problem=f"unreadable: {e}"))
            continue
        rows.append(dict(row, stored=_at(stored), scores={m: [x[m]["score"] for x in scores] for m in METRICS},
                         sentences=len(hyps[0]),
                         different=sum(a != b for a, b in zip(*hyps)) + abs(len(hyps[0]) - len(hyps[1]))))
    return rows


def _at(record: dict) -> dict:
    return {"commit": (record.get("git") or {}).get("commit"), "cpu": (record.get("machine") or {}).get("cpu")}


def section(rows: List[dict]) -> List[str]:
    """The report's section of :func:`compared`'s rows."""
    if not rows:
        return ["No run re-run yet (`benchmarks/quality.py run --rerun`)."]
    head = ["run", "stored at (CPU)", "re-run at (CPU)"] + [f"{LABEL[m]}: stored → re-run" for m in METRICS] + \
        ["test sentences translated differently"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        at = {k: f"`{(r[k]['commit'] or 'no commit')[:7]}` ({r[k]['cpu'] or '?'})" if k in r else "–"
              for k in ("stored", "rerun")}
        cells = [f"{_f(a)} → {_f(b)} ({_f(b - a, signed=True)})" for a, b in r["scores"].values()] + \
            [f"{r['different']} of {r['sentences']}"] if "problem" not in r else [r["problem"]] + [""] * len(METRICS)
        lines.append("| " + " | ".join([f"{r['system']} seed {r['seed']}", at["stored"], at["rerun"]] + cells) + " |")
    return ["Each run the plan names trained again at a later commit (the one named), beside the stored run: the "
            "same hypotheses say the code between the two commits trains and translates it alike; a difference is "
            "reported here and not averaged into the tables.", "", *lines]
