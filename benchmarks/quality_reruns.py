"""The stored runs still describe the code (quality/plan.md): the plan's seeds of the primary
pair (:data:`quality_plan.RERUNS`) trained again at the current commit by ``quality.py run
--rerun``, each into ``reruns/SYSTEM/seedK/`` in a run's layout, and set here beside the stored
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


def rerun_dir(results: str, system: str, seed: int) -> str:
    return os.path.join(results, "reruns", system, f"seed{seed}")


def compared(results: str) -> List[dict]:
    """Every finished rerun beside its stored run: ``{system, seed, stored, rerun, scores,
    sentences, different}`` (``stored``/``rerun``: commit and CPU; ``scores``: metric ->
    [stored, rerun]; ``different``: test sentences whose hypotheses differ)."""
    rows = []
    for path in sorted(glob.glob(os.path.join(results, "reruns", "*", "seed*", "run.json"))):
        again = dict(_read(path), dir=os.path.dirname(path))
        stored_path = os.path.join(results, "runs", again["system"], f"seed{again['seed']}", "run.json")
        if again["status"] != "finished" or not os.path.isfile(stored_path):
            continue
        stored = dict(_read(stored_path), dir=os.path.dirname(stored_path))
        hyps = [_lines(os.path.join(r["dir"], "eval", f"test.{SRC}-{TGT}.hyp.sacrebleu")) for r in (stored, again)]
        scores = [_read(_scores_json(r))["metrics"] for r in (stored, again)]
        rows.append({"system": again["system"], "seed": again["seed"],
                     **{name: {"commit": (r.get("git") or {}).get("commit"), "cpu": (r.get("machine") or {}).get("cpu")}
                        for name, r in (("stored", stored), ("rerun", again))},
                     "scores": {m: [s[m]["score"] for s in scores] for m in METRICS},
                     "sentences": len(hyps[0]),
                     "different": sum(a != b for a, b in zip(*hyps)) + abs(len(hyps[0]) - len(hyps[1]))})
    return rows


def section(rows: List[dict]) -> List[str]:
    """The report's section of :func:`compared`'s rows."""
    if not rows:
        return ["No run re-run yet (`benchmarks/quality.py run --rerun`)."]
    head = ["run", "stored at (CPU)", "re-run at (CPU)"] + [f"{LABEL[m]}: stored → re-run" for m in METRICS] + \
        ["test sentences translated differently"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        at = {k: f"`{(r[k]['commit'] or 'no commit')[:7]}` ({r[k]['cpu'] or '?'})" for k in ("stored", "rerun")}
        lines.append("| " + " | ".join([f"{r['system']} seed {r['seed']}", at["stored"], at["rerun"]] +
                                      [f"{_f(a)} → {_f(b)} ({_f(b - a, signed=True)})" for a, b in r["scores"].values()] +
                                      [f"{r['different']} of {r['sentences']}"]) + " |")
    return ["Each run the plan names trained again at the current commit, beside the stored run: the same "
            "hypotheses say the code between the two commits trains and translates it alike; a difference is "
            "reported here and not averaged into the tables.", "", *lines]
