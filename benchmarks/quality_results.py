"""What the quality benchmark's stored runs hold and what they show: the content of
quality.json, read offline from a results directory (config.json, each run's run.json,
scores.json and logs, the learning-rate runs and choices, the copy-the-source scores): each
run's scores and training summary, the learning-rate runs that are no family's seed 1, the
commits the runs ran on, the comparisons to the baseline and the findings. The runner writes
its records with the same helpers (``write_json``, ``training_summary``, ``copy_source_scores``).

Scores are those ea-fairseq-bleu wrote (each run's ``eval/test.es-en.scores.json``); the
comparisons to the baseline are ea-fairseq-compare's seed-level inference
(``ea_fairseq_cli.significance.compare``: Δ of the means over seeds, its 95% CI by a
hierarchical bootstrap over seeds and test sentences and by Welch's t, Welch's p with Holm's
correction over every reported test (each system in sacreBLEU and chrF: one family), the
permutation test over the seeds, the sign agreement of the pairs of runs, and Kocmi et al.'s
human-agreement range implied by the CIs), whose own output the report appends verbatim.
"""
import glob
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
from typing import Dict, List, Optional

METRICS = ("sacrebleu", "chrf")
LABEL = {"sacrebleu": "sacreBLEU", "chrf": "chrF"}
BOOTSTRAP, TRIALS, SEED = 1000, 10000, 12345
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # quality_plan.py, however this is loaded
from quality_plan import COMPARISONS, SENSITIVITY  # noqa: E402
RAN_DROPOUT = "attention dropout 0.2, which the RAN paper sets (§Settings) and its architectures keep"
#: the dropout a family's mechanism defines itself, kept beside the --dropout every family gets
OWN_DROPOUT = {"ran_d_lite": RAN_DROPOUT, "ran_all_lite": RAN_DROPOUT,
               "transformer_lite_dropattention_e": "DropAttention(e) p 0.2, window 2: the mechanism itself"}
LOSS = re.compile(r"(?<![\w])loss[= ]([^,|\s]+)")
UPDATES = re.compile(r"num_updates[= ](\d+)")
PARAMS = re.compile(r"num\. (?:shared )?model params: ([\d,]+)")


def venv_bin(tool: str) -> str:
    venv = os.environ.get("EA_FAIRSEQ_VENV", os.path.join(REPO, ".venv"))
    path = os.path.join(venv, "bin", tool)
    if not os.path.exists(path):
        raise SystemExit(f"quality.py: {path} not found: create the environment first (bash scripts/setup_env.sh)")
    return path


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def _read(path: str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _lines(path: str) -> List[str]:
    with open(path, encoding="utf-8") as f:
        return f.read().split("\n")[:-1]


def copy_source_scores(src_path: str, ref_path: str) -> dict:
    """The trivial baseline: the untranslated source scored against the references, with the
    metrics ea-fairseq-bleu scores the runs with."""
    from ea_fairseq_cli import bleu

    src, ref = _lines(src_path), _lines(ref_path)
    out = {}
    for name in METRICS:
        metric = bleu.sacrebleu_metric(name)
        out[name] = {"score": metric.corpus_score(src, [ref]).score, "signature": str(metric.get_signature())}
    return {"sentences": len(ref), "metrics": out}


def training_summary(log_path: str) -> dict:
    """Updates, parameters and the training loss curve of a fairseq-train log: its train_inner
    lines (each the mean over one log interval), or its per-epoch train lines in a log that has
    none (a run shorter than one interval); the epoch lines are means over a whole epoch, so the
    two are not mixed. ``updates``: the last update any line logs."""
    inner, epochs = [], []
    params, updates = None, 0
    with open(log_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = PARAMS.search(line)
            params = m.group(1) if m else params
            loss, upd = LOSS.search(line), UPDATES.search(line)
            if loss and upd and " valid " not in line:
                updates = max(updates, int(upd.group(1)))
                try:
                    point = [int(upd.group(1)), float(loss.group(1))]
                except ValueError:
                    point = [int(upd.group(1)), float("nan")]
                (inner if " train_inner " in line else epochs).append(point)
    curve = inner or epochs
    finite = all(math.isfinite(x) for _, x in curve)
    return {"params": params, "updates": updates, "finite_loss": finite, "points": len(curve),
            "first_loss": curve[0][1] if curve else None, "last_loss": curve[-1][1] if curve else None,
            "last_loss_update": curve[-1][0] if curve else None, "loss_curve": curve}


def load_runs(results: str) -> Dict[str, Dict[int, dict]]:
    runs: Dict[str, Dict[int, dict]] = {}
    for path in glob.glob(os.path.join(results, "runs", "*", "seed*", "run.json")):
        record = _read(path)
        record["dir"] = os.path.dirname(path)
        runs.setdefault(record["system"], {})[int(record["seed"])] = record
    return runs


def load_candidates(results: str, runs: Dict[str, Dict[int, dict]]) -> Dict[str, Dict[str, dict]]:
    """The learning-rate runs (``lr_selection/SYSTEM/lrX/``) that are no family's seed 1: the
    rates not chosen, or every rate while a family's choice waits for its runs. A seed 1 is its
    learning-rate run where it links to it or is a copy of it (the links dereferenced); each run
    is keyed by its rate (its record's, else its directory's), two runs at one rate by the rate
    and the directory."""
    seed_runs = {os.path.realpath(r["dir"]) for rs in runs.values() for r in rs.values()}
    seed_records = [{x: y for x, y in r.items() if x != "dir"} for rs in runs.values() for r in rs.values()]
    candidates: Dict[str, Dict[str, dict]] = {}
    for path in sorted(glob.glob(os.path.join(results, "lr_selection", "*", "lr*", "run.json"))):
        record = _read(path)
        if os.path.realpath(os.path.dirname(path)) in seed_runs or record in seed_records:
            continue
        record["dir"] = os.path.dirname(path)
        name = os.path.basename(record["dir"])
        lr = record.get("lr") if record.get("lr") is not None else _stamp_option(record, "lr") or name[len("lr"):]
        key = _rate(lr)
        mine = candidates.setdefault(record["system"], {})
        mine[key if key not in mine else f"{key} ({name})"] = record
    return candidates


def _rate(lr) -> str:
    try:
        return f"{float(lr):g}"
    except (TypeError, ValueError):
        return str(lr)


def _rate_order(item) -> tuple:
    """Candidates in the order of their rates (a rate that is no number last)."""
    key = item[0].split(" ")[0]
    try:
        return 0, float(key), item[0]
    except ValueError:
        return 1, 0.0, item[0]


def selection(choice: Optional[dict], lr: str, has_seed1: bool) -> str:
    """What its family's choice (``choice.json``, or None) made of a learning-rate run that is not
    the family's seed 1."""
    if not choice:
        return "its family's rate not chosen yet"
    if not has_seed1 and lr.split(" ")[0] == _rate(choice.get("lr")):
        return "chosen, not linked as the family's seed 1 yet"
    return "not chosen"


def _training(record: dict) -> dict:
    """The run's training summary, from its committed log (this code's reading of it)."""
    log = os.path.join(record["dir"], "train.log")
    return training_summary(log) if os.path.exists(log) else record.get("training", {})


def _mean_std(values: List[float]):
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def _scores_json(record: dict) -> str:
    found = glob.glob(os.path.join(record["dir"], "eval", "*.scores.json"))
    if len(found) != 1:
        raise SystemExit(f"quality.py: {record['dir']} is recorded as finished but holds {len(found)} "
                         "eval/*.scores.json, not one: remove it and run `quality.py run` again to redo that run")
    return found[0]


def compare_cli(results: str, systems: List[str], runs) -> dict:
    """ea-fairseq-compare itself on the finished runs, as a reader would run it."""
    rel = os.path.relpath(os.path.join(results, "runs"), REPO)
    specs = [f"{s}={rel}/{s}" for s in systems
             if any(r["status"] == "finished" for r in runs.get(s, {}).values())]
    argv = ["ea-fairseq-compare", "--agreement", "--results-dir", os.path.relpath(results, REPO), *specs,
            "--metric", *METRICS]
    if len(specs) < 2:
        return {"command": " ".join(argv), "output": "(fewer than two systems with a finished run)"}
    done = subprocess.run([venv_bin(argv[0]), *argv[1:]], cwd=REPO, capture_output=True, text=True)
    out = done.stdout if done.returncode == 0 else f"exit {done.returncode}: {done.stderr.strip()[-2000:]}"
    return {"command": " ".join(shlex.quote(a) for a in argv), "output": out.rstrip("\n")}


def lr_choices(results: str) -> Dict[str, dict]:
    """lr_selection/SYSTEM/choice.json of each family that has one."""
    return {os.path.basename(os.path.dirname(p)): _read(p)
            for p in sorted(glob.glob(os.path.join(results, "lr_selection", "*", "choice.json")))}


def _stamp_option(record: dict, option: str) -> Optional[str]:
    m = re.search(rf"--{option} (\S+)", record.get("demo_train_stamp") or "")
    return m.group(1) if m else None


def comparison_name(system: str, against: str, seeds=None) -> str:
    """The key of a comparison of the plan: ``"SYSTEM vs AGAINST"``, with ``", seeds K–L"``
    where it compares those seeds alone (a consecutive range)."""
    if not seeds:
        return f"{system} vs {against}"
    if sorted(seeds) != list(range(min(seeds), max(seeds) + 1)):
        raise ValueError(f"a comparison over seeds takes a consecutive range, not {seeds}")
    return f"{system} vs {against}, " + (f"seeds {min(seeds)}–{max(seeds)}" if len(seeds) > 1 else f"seed {seeds[0]}")


def comparisons(finished: Dict[str, Dict[int, dict]], order: List[str], base_name: str, results: str,
                pairs=()) -> Dict[str, Dict[str, dict]]:
    """ea-fairseq-compare's seed-level inference per metric, over the systems with a finished
    run, the baseline first, and for each ``(system, against)`` or ``(system, against, seeds)``
    of ``pairs`` whose two systems have finished runs (of those seeds), under the key
    :func:`comparison_name`: {metric: {name: result}}; Holm's correction over all of them; the
    runs' files read inside ``results``."""
    from ea_fairseq_cli import compare_systems as cs
    from ea_fairseq_cli import significance as sig

    names = [base_name] + [s for s in order if s != base_name and finished.get(s)]
    if not finished.get(base_name) or len(names) < 2:
        return {m: {} for m in METRICS}
    runs = {s: {k: cs.Run(_scores_json(r), results) for k, r in sorted(finished[s].items())} for s in names}
    pairs = [(s, a, tuple(p[0]) if p else None) for s, a, *p in pairs if s in runs and a in runs
             and all(set(p[0]) <= set(runs[x]) for x in (s, a) if p)]  # a subset: once every seed is there
    out = {}
    for m in METRICS:
        stats = {s: {k: cs.sentence_statistics(m, r, False) for k, r in rs.items()} for s, rs in runs.items()}
        score_of = cs.scorer(m, runs[base_name][min(runs[base_name])].sentences, False)
        out[m] = sig.compare({s: list(st.values()) for s, st in stats.items()}, score_of, BOOTSTRAP, TRIALS, SEED)
        for s, a, seeds in pairs:
            both = {x: [v for k, v in stats[x].items() if seeds is None or k in seeds] for x in (a, s)}
            out[m][comparison_name(s, a, seeds)] = sig.compare(both, score_of, BOOTSTRAP, TRIALS, SEED)[s]
    sig.holm_over_metrics(out)  # one family: every comparison in every metric
    for m, result in out.items():
        agreed, _ = cs.agreement_of(m, [r for rs in runs.values() for r in rs.values()])
        for s, against, key in [(s, base_name, s) for s in names[1:]] + \
                [(s, a, comparison_name(s, a, seeds)) for s, a, seeds in pairs]:
            e = result[key]
            e["agreement_thresholds"] = list(cs.AGREEMENT[agreed]) if agreed else None
            e["agreement"] = (cs.sig.agreement_range(e["agreement_ci"], cs.AGREEMENT[agreed], s, against,
                                                     e["p_holm"]) if agreed else None)
    return out


def _difference(e: dict) -> dict:
    """A comparison's entry of quality.json: Δ, its CIs and tests."""
    return dict(delta=e["delta"], ci=list(e["ci"]), welch_ci=list(e["welch"]["ci"]) if e["welch"] else None,
                p=e["p"], test=e["test"], p_holm=e["p_holm"], sign=list(e["sign"]), permutation=e["permutation"],
                agreement_ci=list(e["agreement_ci"]), agreement=e["agreement"],
                agreement_thresholds=e["agreement_thresholds"])


def provenance(named: List[tuple]) -> dict:
    """The commits the runs (``(name, record)`` pairs) ran on, the runs that recorded none, and
    whether the commits' code differs (git diff outside the results, where this checkout knows
    both commits)."""
    commits: Dict[str, List[str]] = {}
    unrecorded, dirty, frozen = [], [], 0
    for name, r in named:
        git = r.get("git") or {}
        if git.get("commit"):
            commits.setdefault(git["commit"], []).append(name)
        else:
            unrecorded.append(name)
        if git.get("dirty"):
            dirty.append(f"{name}: {', '.join(git['dirty'][:10])}")
        frozen += os.path.exists(os.path.join(r["dir"], "pip-freeze.txt"))
    same_code = None
    if len(commits) > 1:
        first, *rest = commits
        results = ["benchmarks/quality", "benchmarks/quality.md", "benchmarks/quality.json", "README.md"]
        diffs = [subprocess.run(["git", "diff", "--quiet", first, c, "--", ".", *[f":(exclude){x}" for x in results]],
                                cwd=REPO, capture_output=True) for c in rest]
        same_code = (None if any(d.returncode not in (0, 1) for d in diffs)
                     else all(d.returncode == 0 for d in diffs))
    return {"commits": commits, "unrecorded": unrecorded, "dirty": dirty, "pip_freeze": frozen, "runs": len(named),
            "same_code": same_code}


def build(results: str) -> dict:
    config = _read(os.path.join(results, "config.json"))
    copy_path = os.path.join(results, "copy_source.json")
    copy = _read(copy_path) if os.path.exists(copy_path) else None
    runs = load_runs(results)
    base_name = config["baseline"]
    planned: Dict[str, List[int]] = {}
    for s, k in config["planned"]:
        planned.setdefault(s, []).append(k)
    order = [s for s in config["systems"] if s in planned or s in runs]
    finished = {s: {k: r for k, r in runs.get(s, {}).items() if r["status"] == "finished"} for s in order}
    scores = {s: {k: _read(_scores_json(r))["metrics"] for k, r in finished[s].items()} for s in order}
    stored = load_candidates(results, runs)
    candidates = {s: dict(sorted(c.items(), key=_rate_order)) for s, c in stored.items() if s in order}
    left_out = [os.path.relpath(r["dir"], results) for s in sorted(set(runs) - set(order))
                for _, r in sorted(runs[s].items())] + \
        [os.path.relpath(r["dir"], results) for s in sorted(set(stored) - set(order)) for r in stored[s].values()]
    choices = lr_choices(results)
    chose = {s: {lr: selection(choices.get(s), lr, 1 in runs.get(s, {})) for lr in c} for s, c in candidates.items()}
    rel = os.path.relpath(results, REPO)
    out = {"results": rel if not rel.startswith("..") else results, "budget": config["budget"], "baseline": base_name,
           "copy_source": copy,
           "test": {"bootstrap": BOOTSTRAP, "trials": TRIALS, "seed": SEED,
                    "type": "seed-level inference of ea-fairseq-compare"},
           "systems": {}, "findings": [], "machines": [], "signatures": {}, "left_out": left_out,
           "provenance": provenance([(f"{s} seed {k}", r) for s in order for k, r in sorted(runs.get(s, {}).items())] +
                                    [(candidate_name(s, lr, chose[s][lr]), r)
                                     for s in order for lr, r in candidates.get(s, {}).items()])}
    pairs = [tuple(c) for c in config.get("comparisons", COMPARISONS)] + \
        [c for c in SENSITIVITY if all(set(c[2]) <= set(planned.get(s, ())) for s in c[:2])]  # where planned
    compared = comparisons(finished, order, base_name, results, pairs)
    names = [comparison_name(*c) for c in pairs]
    out["comparisons"] = {n: ({m: _difference(compared[m][n]) for m in METRICS} if n in compared[METRICS[0]] else None)
                          for n in names}
    for m in METRICS:
        sig = next((v[m]["signature"] for s in order for v in scores[s].values() if m in v), None)
        out["signatures"][m] = sig or (copy["metrics"][m]["signature"] if copy else None)
    for s in order:
        seeds = sorted(set(planned.get(s, [])) | set(runs.get(s, {})))
        system = config["systems"][s]
        done = [r for _, r in sorted(finished[s].items())]
        trainings = [_training(r) for r in done]
        lrs = sorted({str(r.get("lr") if r.get("lr") is not None else _stamp_option(r, "lr")) for r in done})
        dropouts = sorted({str(_stamp_option(r, "dropout")) for r in done})
        cpu = [r["cpu_s"] for r in done if r.get("cpu_s") is not None]
        entry = {"arch": system["arch"], "train_args": system["train_args"],
                 "own_dropout": system.get("own_dropout", OWN_DROPOUT.get(s, "")), "lr": lrs, "dropout": dropouts,
                 "lr_selection": choices.get(s), "lr_of": system.get("lr_of"),
                 "params": next((t["params"] for t in trainings if t.get("params")), None),
                 "cpu_s_mean": statistics.fmean(cpu) if cpu else None,
                 "seeds_planned": sorted(planned.get(s, [])), "seeds_finished": sorted(finished[s]),
                 "seeds_failed": sorted(k for k, r in runs.get(s, {}).items() if r["status"] != "finished"),
                 "seeds_missing": [k for k in seeds if k not in runs.get(s, {})], "runs": {}, "metrics": {},
                 "lr_candidates": {}}
        for k, r in sorted(runs.get(s, {}).items()):
            entry["runs"][str(k)] = run_entry(r, scores[s].get(k, {}))
        for lr, r in candidates.get(s, {}).items():
            entry["lr_candidates"][lr] = {**run_entry(r, _read(_scores_json(r))["metrics"]
                                                      if r["status"] == "finished" else {}), "selection": chose[s][lr]}
        for r in [*entry["runs"].values(), *entry["lr_candidates"].values()]:
            if r["machine"] not in out["machines"]:
                out["machines"].append(r["machine"])
        for m in METRICS:
            values = [scores[s][k][m]["score"] for k in sorted(finished[s])]
            mean, std = _mean_std(values)
            metric = {"scores": values, "mean": mean, "std": std}
            e = compared[m].get(s)
            if s != base_name and e:
                metric.update(_difference(e))
            entry["metrics"][m] = metric
        out["systems"][s] = entry
    out["findings"] = findings(out)
    return out


def candidate_name(system: str, lr: str, chosen: str) -> str:
    """How the report names a learning-rate run that is not the family's seed 1 (``chosen``: its
    ``selection``)."""
    return f"{system} seed 1 at lr {lr} (learning-rate run, {chosen})"


def run_entry(r: dict, metrics: dict) -> dict:
    """One stored run as the report keeps it: its scores (``metrics``: its scores.json's),
    training summary, times, records and the paths of its kept outputs."""
    return {"status": r["status"], "scores": {m: metrics[m]["score"] for m in METRICS if m in metrics},
            "training": {x: y for x, y in _training(r).items() if x != "loss_curve"},
            "lr": r.get("lr") if r.get("lr") is not None else _stamp_option(r, "lr"),
            "train_wall_s": r.get("train_wall_s"), "wall_s": r.get("wall_s"), "cpu_s": r.get("cpu_s"),
            "load_at_start": r.get("load_at_start"), "load_at_end": r.get("load_at_end"),
            "started": r.get("started"), "machine": r["machine"], "commands": r["commands"],
            "git": r.get("git"), "probe": (os.path.relpath(os.path.join(r["dir"], "probe.txt"), REPO)
                                           if os.path.exists(os.path.join(r["dir"], "probe.txt")) else None),
            "demo_train_stamp": r.get("demo_train_stamp"), "log_tail": r.get("log_tail"),
            "failure": r.get("failure")}


def named_runs(out: dict) -> List[tuple]:
    """(name, run entry) of every stored run: the table's, then the learning-rate runs not chosen."""
    return ([(f"{s} seed {k}", r) for s, e in out["systems"].items() for k, r in e["runs"].items()] +
            [(candidate_name(s, lr, r["selection"]), r) for s, e in out["systems"].items()
             for lr, r in e["lr_candidates"].items()])


def findings(out: dict) -> List[str]:
    """What the stored runs show of runs that failed or did not train, the learning-rate runs
    not chosen among them: failed runs, NaN or rising training loss, test scores at or below the
    copy-the-source baseline; where the run kept the collapse probe's output, where it is; and the
    stored runs the report leaves out (of families config.json does not list)."""
    found = []
    copy = out["copy_source"]
    for name, r in named_runs(out):
        t = r["training"]
        mine = []
        if r["status"] != "finished":
            mine.append(f"{name}: {r['status']} ({r['failure']})")
        if t and not t.get("finite_loss", True):
            mine.append(f"{name}: NaN or infinite training loss")
        elif t and t.get("points", 0) > 1 and t["last_loss"] >= t["first_loss"]:
            mine.append(f"{name}: training loss did not fall ({t['first_loss']} at the first "
                        f"log line, {t['last_loss']} at the last): diverged")
        for m in METRICS:
            if copy and m in r["scores"] and r["scores"][m] <= copy["metrics"][m]["score"]:
                mine.append(f"{name}: {LABEL[m]} {r['scores'][m]:.2f}, not above the copy-the-source "
                            f"baseline ({copy['metrics'][m]['score']:.2f}); training loss "
                            f"{_f(t.get('last_loss'))} at update {t.get('last_loss_update') or t.get('updates', '?')}")
        if mine and r.get("probe"):
            mine.append(f"{name}: the collapse probe's output on its averaged checkpoint: `{r['probe']}`")
        found += mine
    if out.get("left_out"):
        found.append("Stored runs of families that config.json does not list, left out of this report: " +
                     ", ".join(out["left_out"]))
    return found


def _f(x, digits=2, signed=False):
    return "–" if x is None else f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"
