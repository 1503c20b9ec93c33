#!/usr/bin/env python3
"""Training progress of every attention family after the demo's budget on its corpus, over
seeds, with seed-level comparisons to transformer_lite: trained, translated and scored by the
project's own tools.

    .venv/bin/python benchmarks/quality.py run [--commit] [--allow-dirty]   # trains what is not finished
    .venv/bin/python benchmarks/quality.py report [--update-readme]
    .venv/bin/python benchmarks/quality.py curves [--commit]        # learning curves (quality_curves.py)

``run`` calls ``scripts/demo.sh`` once to prepare the data (DEMO_STOP_AFTER=data: the shipped
Spanish->English Bible corpus, Moses tokenization, joint BPE, binarization), then once per
system and seed (DEMO_ARCHS, DEMO_SEED, DEMO_LR, DEMO_DROPOUT, DEMO_STOP_AFTER=translation):
the demo's training flags and budget (1200 updates of 2048 tokens on CPU), its checkpoint
averaging (the last 5) and its beam-5 translation of the test set. Each translation is scored
with ``ea-fairseq-bleu --mode wmt`` (detokenized sacreBLEU, chrF, tokenized BLEU). Two runs at
a time with one CPU thread each, as the demo trains its two models (``--parallel``,
``--threads``).

Steps, per family (``SYSTEMS``):

1. learning rate: seed 1 trained at each of ``--lrs`` (0.001 and 0.002), each run's averaged
   checkpoint also translating the validation set; the rate of the best validation sacreBLEU
   (then chrF, then the lower rate) is the family's, and its run is the family's seed 1
   (``lr_selection/SYSTEM/lrX/``, ``lr_selection/SYSTEM/choice.json``; ``runs/SYSTEM/seed1``
   links to it). The test set plays no part in the choice.
2. the other seeds at that rate: 10 seeds for transformer_lite and ea_transformer_lite, 3 for
   the other families (``--seeds`` gives every family the same list). A system that takes a
   family's rate (the compute-matched baseline, EA's ablations, RAN without its attention
   dropout: ``SYSTEMS``, as ``quality/plan.md`` states them before their runs) trains every seed
   at it; the new seeds of the primary pair keep every checkpoint (``KEEP_CHECKPOINTS``).
3. with ``--rerun``, the plan's runs trained again at the current commit (``RERUNS``: seed 1 of the
   primary pair), once, into ``reruns/SYSTEM/seedK/``: the report sets them beside the stored
   runs (``quality_reruns.py``: scores, and the test sentences translated differently).
4. the rates tried beside the plan's for the primary pair (``LRS_BESIDE``: 5e-4 and 3e-3, seed 1,
   the validation set), where ``--lrs`` is the plan's: recorded in ``choice.json`` beside the
   choice, which they never change; the report names one that beats the chosen rate.
5. with ``--rerun``, the runs that keep every checkpoint for the learning curves whose
   checkpoints are gone from the work directory before any point of theirs was scored
   (``quality_curves.lost``), trained again into ``reruns/SYSTEM/seedK/`` (every checkpoint kept):
   ``quality.py curves`` scores their points from the re-run, and the report sets each re-run
   beside its stored run as in step 3.

Every family trains with the same ``--dropout`` (0.0); a mechanism that defines a dropout of its
own keeps it, and the report says which (``SYSTEMS``).

Provenance: a run records the git commit it ran on, and the runner refuses a working tree with
uncommitted changes (outside the results) unless ``--allow-dirty`` (then the changed files are
recorded); each run keeps ``pip-freeze.txt`` (the environment), its logs (``demo.log``,
``train.log``) and the output of ``benchmarks/collapse_probe.py`` on its averaged checkpoint
(``probe.txt``).

Results: ``--results-dir`` (default ``benchmarks/quality/``), one directory per finished run,
``runs/SYSTEM/seedK/``: ``eval/`` as ea-fairseq-bleu wrote it (hypotheses, scores.json; the
references, identical for every run, are links to ``refs/``), the logs and ``run.json`` (the
exact commands, wall and CPU time, the machine and its load, the commit). A run is moved there
only once it is scored, so a run that is there is finished and is skipped; any other starts
from scratch (checkpoints and work files live in ``--work-dir``, outside the repository). A run
that fails is recorded as failed (with its log's tail) and reported, not retried unless
``--retry-failed``. ``--commit`` commits every finished run, with the regenerated report, as it
completes. One runner per work directory (a second is refused); stop one with
``kill -- -PID`` (its trainings with it), start it again to go on.

``report`` writes ``quality.md`` and ``quality.json`` beside the runs from whatever is stored,
offline (``quality_report.py``, from what ``quality_results.py`` reads of the runs);
``--update-readme`` rewrites the README's table between its markers.

This file is the command line; what runs is ``quality_plan.py`` (``SYSTEMS``), and the runner
that trains, scores and records each run is ``quality_runner.py``.
"""
import argparse
import fcntl
import os
import sys
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import quality_curves  # noqa: E402
import quality_report  # noqa: E402
from quality_plan import LRS, RERUNS, SYSTEMS  # noqa: E402
from quality_runner import Runner, die, git_commit, report_outputs  # noqa: E402


def check_provenance(runner: Runner, allow_dirty: bool) -> None:
    """Every run records the commit it ran on: a tree with uncommitted changes outside the
    results is refused unless allow_dirty (the changed files are then recorded)."""
    state = runner.git
    if state["commit"] is None and not allow_dirty:
        die(f"{REPO} is not a git checkout, so the runs could not record their commit: run from one, "
            "or give --allow-dirty to run without")
    if state["dirty"] and not allow_dirty:
        shown = ", ".join(state["dirty"][:5]) + (f" and {len(state['dirty']) - 5} more" if len(state["dirty"]) > 5 else "")
        die(f"the working tree has uncommitted changes ({shown}): commit them so the runs record the code "
            "they ran, or give --allow-dirty (the changed files are recorded in each run)")


def locked(runner: Runner, name: str):
    """The work directory's lock ``name`` held for this process (one runner, one curve scorer)."""
    os.makedirs(runner.work, exist_ok=True)
    lock = open(os.path.join(runner.work, name), "a+")
    try:  # two of them on one work directory would write the same places
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        die(f"another quality.py {name.split('.')[0]} (pid {lock.read().strip() or '?'}) is using {runner.work}: "
            "wait for it or stop it (kill -- -PID stops it and what it started)")
    return lock


def claim(lock) -> None:
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()


def cmd_curves(args):
    runner = Runner(args)
    lock = locked(runner, "curves.lock")
    check_provenance(runner, args.allow_dirty)
    claim(lock)
    runner.data = os.path.join(runner.work, "prep", "data")
    if not os.path.isdir(runner.data):
        die(f"no prepared data in {runner.work}: run `benchmarks/quality.py run` first (it prepares the data)")
    written = quality_curves.score_points(runner)
    print(f"[quality] curves: {len(written)} point(s) scored", file=sys.stderr, flush=True)
    outputs = quality_report.report(runner.results, readme=args.readme if args.update_readme else None)
    if args.commit and written:
        git_commit([os.path.join(runner.results, "curves"), os.path.join(runner.results, "refs"), *outputs,
                    *report_outputs(runner.results, args)],
                   f"Quality benchmark: {len(written)} learning-curve point(s) scored, report regenerated")
    return 0


def run_all(parallel: int, calls) -> None:
    """Each ``(function, *args)`` of ``calls`` called, ``parallel`` at a time; the first error raised."""
    with ThreadPoolExecutor(parallel) as pool:
        for future in [pool.submit(*call) for call in calls]:
            future.result()


def cmd_run(args):
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        die(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    if args.parallel < 1 or args.threads < 1:
        die("--parallel and --threads must be at least 1")
    if not args.lrs or any(not 0 < lr < 1 for lr in args.lrs) or len(set(args.lrs)) != len(args.lrs):
        die(f"--lrs takes distinct learning rates between 0 and 1 (got {' '.join(map(str, args.lrs))})")
    if args.seeds and (1 not in args.seeds or any(k < 1 for k in args.seeds)):
        die("--seeds must hold seed 1 (the learning rate is chosen on it) and positive seeds only")
    runner = Runner(args)
    if args.commit and os.path.relpath(runner.results, REPO).startswith(".."):
        die(f"--commit: the results directory {runner.results} is outside the repository {REPO}")
    lock = locked(runner, "run.lock")
    check_provenance(runner, args.allow_dirty)
    claim(lock)
    runner.check_config()
    runner.prepare_data()

    def pending(final: str, name: str) -> bool:
        done = runner.finished_at(final)
        if done and (done["status"] == "finished" or not args.retry_failed):
            print(f"[quality] {name}: {done['status']}, kept", file=sys.stderr)
            return False
        return True

    # 1. the learning rate of each family, on the validation set (seed 1)
    candidates = [(s, lr) for s in args.systems if SYSTEMS[s][3] is None for lr in args.lrs
                  if pending(runner.candidate_dir(s, lr), f"{s} seed 1 lr {lr:g}")]
    print(f"[quality] learning rates: {len(candidates)} run(s) to do, {args.parallel} at a time with "
          f"{args.threads} thread(s) each; work files in {runner.work}", file=sys.stderr, flush=True)
    run_all(args.parallel, [(runner.run_one, s, 1, lr, runner.candidate_dir(s, lr), True) for s, lr in candidates])
    chosen = {s: runner.lr_of(s) for s in args.systems}
    # 2. the other seeds at the chosen rate (every seed of a system taking its family's rate)
    todo = [(s, k) for s in args.systems for k in runner.seeds(s)
            if (k != 1 or SYSTEMS[s][3] is not None) and chosen[s] is not None
            and pending(runner.run_dir(s, k), f"{s} seed {k}")]
    print(f"[quality] {len(todo)} run(s) to do at the chosen rates "
          f"({', '.join(f'{s} {lr:g}' for s, lr in chosen.items() if lr is not None) or 'none chosen'})",
          file=sys.stderr, flush=True)
    run_all(args.parallel, [(runner.run_one, s, k, chosen[s], runner.run_dir(s, k)) for s, k in todo])
    # 3. with --rerun, the plan's runs trained again at this commit (quality_reruns.py): reported beside them
    again = [(s, k) for s, k in RERUNS if args.rerun and s in args.systems and chosen[s] is not None
             and pending(runner.rerun_dir(s, k), f"{s} seed {k} again")]
    run_all(args.parallel, [(runner.run_one, s, k, chosen[s], runner.rerun_dir(s, k)) for s, k in again])
    # 4. the rates tried beside the plan's for the primary pair (seed 1, validation): reported, never chosen
    beside = [(s, lr) for s in args.systems if chosen[s] is not None for lr in runner.lrs_beside(s)
              if pending(runner.candidate_dir(s, lr), f"{s} seed 1 lr {lr:g}")]
    run_all(args.parallel, [(runner.run_one, s, 1, lr, runner.candidate_dir(s, lr), True) for s, lr in beside])
    for s in {s for s, _ in beside}:
        runner.choose_lr(s)  # choice.json records them beside the choice
    # 5. with --rerun, the runs kept for the learning curves whose checkpoints are gone, trained again into reruns/
    curves = [(s, k) for s, k in quality_curves.lost(runner) if args.rerun and s in args.systems
              and pending(runner.rerun_dir(s, k), f"{s} seed {k} again")]
    run_all(args.parallel, [(runner.run_one, s, k, chosen[s], runner.rerun_dir(s, k)) for s, k in curves])
    for publisher in runner.publishers:
        publisher.join()
    if not (args.commit or args.report):
        quality_report.report(runner.results, readme=args.readme if args.update_readme else None)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("run", "report", "curves"):
        q = sub.add_parser(name)
        q.add_argument("--results-dir", default=os.path.join(HERE, "quality"),
                       help="finished runs and the report [benchmarks/quality]")
        q.add_argument("--update-readme", action="store_true", help="rewrite the README's generated table")
        q.add_argument("--readme", default=os.path.join(REPO, "README.md"))
    for name in ("run", "curves"):
        q = sub.choices[name]
        q.add_argument("--work-dir", default="~/.cache/ea_fairseq/quality",
                       help="checkpoints, logs and data, outside the repository [~/.cache/ea_fairseq/quality]")
        q.add_argument("--threads", type=int, default=1, help="CPU threads per run [1]")
        q.add_argument("--allow-dirty", action="store_true",
                       help="run on a working tree with uncommitted changes (recorded in each run)")
        q.add_argument("--commit", action="store_true", help="git-commit what is scored with the regenerated report")
    c = sub.choices["curves"]
    c.set_defaults(seeds=None)
    r = sub.choices["run"]
    r.add_argument("--systems", nargs="+", default=list(SYSTEMS), metavar="SYSTEM",
                   help=f"[all: {' '.join(SYSTEMS)}]")
    r.add_argument("--seeds", nargs="+", type=int,
                   help="the seeds of every system [SYSTEMS: 10 for transformer_lite and ea_transformer_lite]")
    r.add_argument("--lrs", nargs="+", type=float, default=list(LRS),
                   help="learning rates tried per family on the validation set, seed 1 [0.001 0.002]")
    r.add_argument("--probe-batch", type=int, default=20,
                   help="the training batch benchmarks/collapse_probe.py probes [20]")
    r.add_argument("--parallel", type=int, default=2, help="runs at a time [2]")
    r.add_argument("--report", action="store_true", help="regenerate the report after each run (without --commit)")
    r.add_argument("--retry-failed", action="store_true", help="run failed runs again")
    r.add_argument("--rerun", action="store_true",
                   help=f"train the plan's runs again at this commit ({', '.join(f'{s} seed {k}' for s, k in RERUNS)}),"
                        " and the curves' runs whose checkpoints are gone, once, into reruns/, reported beside "
                        "the stored ones")
    budget = r.add_argument_group("budget (the demo's CPU defaults when not given; recorded, a results "
                                  "directory holds one budget)")
    budget.add_argument("--updates", type=int)
    budget.add_argument("--max-tokens", type=int)
    budget.add_argument("--warmup", type=int)
    budget.add_argument("--avg", type=int, help="checkpoints averaged")
    budget.add_argument("--bpe-merges", type=int)
    budget.add_argument("--dropout", type=float, default=0.0, help="--dropout of every family [0.0]")
    budget.add_argument("--corpus", help="directory of {train,valid,test}.{es,en}.xz")
    args = p.parse_args(argv)
    if args.command == "run":
        return cmd_run(args)
    if args.command == "curves":
        return cmd_curves(args)
    quality_report.report(os.path.abspath(args.results_dir), readme=args.readme if args.update_readme else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
