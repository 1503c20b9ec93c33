#!/usr/bin/env python3
"""Translation quality of every attention family on the demo's corpus, over seeds, with paired
tests against transformer_lite: trained, translated and scored by the project's own tools.

    .venv/bin/python benchmarks/quality.py run [--commit]        # trains what is not finished
    .venv/bin/python benchmarks/quality.py report [--update-readme]

``run`` calls ``scripts/demo.sh`` once to prepare the data (DEMO_STOP_AFTER=data: the shipped
Spanish->English Bible corpus, Moses tokenization, joint BPE, binarization), then once per
system and seed (DEMO_ARCHS, DEMO_SEED, DEMO_STOP_AFTER=translation): the demo's training
flags and budget (1200 updates of 2048 tokens on CPU), its checkpoint averaging (the last 5)
and its beam-5 translation of the test set. Each translation is scored with
``ea-fairseq-bleu --mode wmt`` (detokenized sacreBLEU, chrF, tokenized BLEU). Two runs at a time
with one CPU thread each, as the demo trains its two models (``--parallel``, ``--threads``).

Results: ``--results-dir`` (default ``benchmarks/quality/``), one directory per finished run,
``runs/SYSTEM/seedK/``: ``eval/`` as ea-fairseq-bleu wrote it (hypotheses, scores.json; the
references, identical for every run, are links to ``refs/``), ``train.log`` and ``run.json``
(the exact commands, wall and CPU time, the machine and its load). A run is moved there only
once it is scored, so a run that is there is finished and is skipped; any other starts from
scratch (checkpoints and work files live in ``--work-dir``, outside the repository). A run that
fails is recorded as failed (with its log's tail) and reported, not retried unless
``--retry-failed``. ``--commit`` commits every finished run, with the regenerated report, as it
completes. One runner per work directory (a second is refused); stop one with
``kill -- -PID`` (its trainings with it), start it again to go on.

``report`` writes ``quality.md`` and ``quality.json`` beside the runs from whatever is
finished (missing runs are listed as missing): per system and metric (sacreBLEU, chrF) each
seed's score, mean ± std (ddof 1), the difference of means to transformer_lite with
ea-fairseq-compare's paired bootstrap p-values (seed k against seed k, and the largest over
every pair of runs, which is what ``ea-fairseq-compare`` prints) and Kocmi et al.'s (2024)
human-agreement thresholds beside it; the copy-the-source baseline; findings (failed runs,
NaN or rising training loss, scores at or below the copy baseline); the output of
``ea-fairseq-compare`` itself. ``--update-readme`` rewrites the README's table between its
markers.
"""
import argparse
import fcntl
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import quality_report  # noqa: E402
from quality_report import venv_bin  # noqa: E402

BASELINE = "transformer_lite"
SYSTEMS = {  # name -> (arch, extra fairseq-train options); the first is the baseline
    "transformer_lite": ("transformer_lite", ""),
    "ea_transformer_lite": ("ea_transformer_lite", ""),
    "pa_transformer_lite": ("pa_transformer_lite", ""),
    "ran_d_lite": ("ran_d_lite", ""),
    "ran_all_lite": ("ran_all_lite", ""),
    "realformer_lite": ("realformer_lite", ""),
    "resformer_lite": ("resformer_lite", ""),
    # DropAttention(e) with the paper's MT setting (README: p 0.2, window 2)
    "transformer_lite_dropattention_e": ("transformer_lite", "--drop-attention element --drop-attention-p 0.2 "
                                                             "--drop-attention-window 2"),
}
SRC, TGT = "es", "en"
BUDGET_ENV = {"updates": "DEMO_UPDATES", "max_tokens": "DEMO_MAX_TOKENS", "bpe_merges": "DEMO_BPE_MERGES",
              "avg": "DEMO_AVG", "warmup": "DEMO_WARMUP", "corpus": "DEMO_CORPUS"}


def die(msg: str):
    raise SystemExit(f"quality.py: {msg}")


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    from importlib.metadata import version
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "host": platform.node(),
            "python": platform.python_version(), "torch": version("torch"), "fairseq": version("ve-fairseq"),
            "nice": os.nice(0)}


def demo_env(args, **extra) -> dict:
    env = {BUDGET_ENV[k]: str(getattr(args, k)) for k in BUDGET_ENV if getattr(args, k) is not None}
    env.update({"DEMO_DEVICE": "cpu", **{k: str(v) for k, v in extra.items()}})
    return env


def command_line(env: dict, argv) -> str:
    """The command as a shell line, paths inside the repository relative to its root (where it runs)."""
    rel = lambda x: x.replace(REPO + os.sep, "")  # noqa: E731
    return " ".join([f"{k}={shlex.quote(rel(v))}" for k, v in env.items()] + [shlex.quote(rel(a)) for a in argv])


def run_measured(argv, env: dict, log_path: str) -> tuple:
    """Run a command, its output into log_path; (exit status, wall seconds, CPU seconds of it
    and every descendant it waited for: user + system)."""
    t0 = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, time.monotonic() - t0, usage.ru_utime + usage.ru_stime


class Runner:
    def __init__(self, args):
        self.args = args
        self.results = os.path.abspath(args.results_dir)
        self.work = os.path.abspath(os.path.expanduser(args.work_dir))
        self.lock = threading.Lock()
        self.publishers = []
        self.machine = machine()

    # ------------------------------------------------------------------ data, configuration
    def check_config(self):
        budget = {k: getattr(self.args, k) for k in BUDGET_ENV}
        budget["corpus"] = os.path.abspath(budget["corpus"]) if budget["corpus"] else None
        path = os.path.join(self.results, "config.json")
        planned = [[s, k] for k in self.args.seeds for s in self.args.systems]
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
            if config["budget"] != budget:
                die(f"{self.results} holds runs of another budget ({config['budget']}, asked: {budget}): "
                    "give another --results-dir")
            planned = config["planned"] + [p for p in planned if p not in config["planned"]]
        os.makedirs(self.results, exist_ok=True)
        config = {"budget": budget, "planned": planned, "baseline": BASELINE,
                  "systems": {s: {"arch": a, "train_args": x} for s, (a, x) in SYSTEMS.items()}}
        quality_report.write_json(path, config)

    def prepare_data(self):
        prep = os.path.join(self.work, "prep")
        os.makedirs(prep, exist_ok=True)
        env = demo_env(self.args, DEMO_DIR=prep, DEMO_STOP_AFTER="data")
        argv = ["bash", os.path.join(REPO, "scripts", "demo.sh")]
        print(f"[quality] data: {command_line(env, argv)}", file=sys.stderr)
        rc, _, _ = run_measured(argv, env, os.path.join(prep, "demo.log"))
        if rc != 0:
            die(f"the demo's data preparation failed (log: {prep}/demo.log)")
        self.data = os.path.join(prep, "data")
        copy = quality_report.copy_source_scores(os.path.join(self.data, "raw", f"test.{SRC}"),
                                                 os.path.join(self.data, "raw", f"test.{TGT}"))
        with open(os.path.join(self.data, "raw", f"train.{SRC}"), encoding="utf-8") as f:
            copy["train_sentences"] = sum(1 for _ in f)
        copy["command"] = command_line(env, argv)
        quality_report.write_json(os.path.join(self.results, "copy_source.json"), copy)

    # ------------------------------------------------------------------ one run
    def finished(self, system: str, seed: int):
        path = os.path.join(self.results, "runs", system, f"seed{seed}", "run.json")
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    def run_one(self, system: str, seed: int) -> None:
        arch, train_args = SYSTEMS[system]
        name = f"{system} seed {seed}"
        work = os.path.join(self.work, "runs", system, f"seed{seed}")
        final = os.path.join(self.results, "runs", system, f"seed{seed}")
        stage = os.path.join(self.results, "runs", system, f".seed{seed}.partial")
        for d in (work, stage):
            shutil.rmtree(d, ignore_errors=True)
        os.makedirs(work)
        os.makedirs(os.path.join(stage, "eval"))
        os.symlink(self.data, os.path.join(work, "data"))  # the demo reuses it (same stamp)
        env = demo_env(self.args, DEMO_DIR=work, DEMO_ARCHS=arch, DEMO_SEED=seed, DEMO_PARALLEL=1,
                       DEMO_THREADS=self.args.threads, DEMO_STOP_AFTER="translation", DEMO_TRAIN_ARGS=train_args)
        demo = ["bash", os.path.join(REPO, "scripts", "demo.sh")]
        record = {"system": system, "seed": seed, "arch": arch, "train_args": train_args,
                  "machine": self.machine, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                  "load_at_start": os.getloadavg(), "commands": [command_line(env, demo)]}
        print(f"[quality] {name}: training ({work}/demo.log)", file=sys.stderr, flush=True)
        rc, wall, cpu = run_measured(demo, env, os.path.join(work, "demo.log"))
        run_dir = os.path.join(work, "train", arch)
        if os.path.exists(os.path.join(run_dir, "train.log")):
            shutil.copy(os.path.join(run_dir, "train.log"), os.path.join(stage, "train.log"))
        if rc < 0 or rc in (130, 143):  # interrupted: nothing to record, the next sitting restarts it
            shutil.rmtree(stage, ignore_errors=True)
            raise SystemExit(f"quality.py: {name} interrupted (exit {rc}); run again to restart it")
        record.update(demo_wall_s=wall, demo_cpu_s=cpu, demo_exit=rc)
        if rc == 0:
            gen = os.path.join(run_dir, "eval", "generate.out")
            prefix = os.path.join(stage, "eval", f"test.{SRC}-{TGT}")
            bleu = [venv_bin("ea-fairseq-bleu"), gen, "--mode", "wmt", "--target-lang", TGT,
                    "--raw-ref", os.path.join(self.data, "raw", f"test.{TGT}"),
                    "--expect-idx", os.path.join(self.data, "bin", f"test.{SRC}-{TGT}.{SRC}.idx"),
                    "--out-prefix", prefix]
            record["commands"].append(command_line({}, bleu))
            rc_b, wall_b, cpu_b = run_measured(bleu, {}, os.path.join(stage, "eval", f"bleu-test.{SRC}-{TGT}.txt"))
            record.update(score_wall_s=wall_b, score_cpu_s=cpu_b)
            if rc_b != 0:
                rc = rc_b
                record["failure"] = f"ea-fairseq-bleu exited {rc_b}"
        if rc == 0:
            with open(os.path.join(run_dir, "train_seconds"), encoding="utf-8") as f:
                record["train_wall_s"] = int(f.read())
            with open(os.path.join(run_dir, ".done"), encoding="utf-8") as f:
                record["demo_train_stamp"] = f.read().strip()
            self.link_refs(os.path.join(stage, "eval"))
            record["status"] = "finished"
        else:
            record["status"] = "failed"
            with open(os.path.join(work, "demo.log"), encoding="utf-8", errors="replace") as f:
                record["log_tail"] = f.read().splitlines()[-30:]
            record.setdefault("failure", f"scripts/demo.sh exited {rc}")
        if os.path.exists(os.path.join(stage, "train.log")):
            record["training"] = quality_report.training_summary(os.path.join(stage, "train.log"))
        record.update(wall_s=wall + record.get("score_wall_s", 0), cpu_s=cpu + record.get("score_cpu_s", 0),
                      load_at_end=os.getloadavg(), ended=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
        quality_report.write_json(os.path.join(stage, "run.json"), record)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(stage, final)
        print(f"[quality] {name}: {record['status']} in {wall / 60:.1f} min "
              f"(CPU {cpu / 60:.1f} min)", file=sys.stderr, flush=True)
        # report and commit one at a time, beside the next run (a full report takes minutes of CPU)
        publisher = threading.Thread(target=self.publish, args=(name, final))
        publisher.start()
        self.publishers.append(publisher)

    def publish(self, name: str, final: str):
        with self.lock:
            self.after_run(name, final)

    def link_refs(self, eval_dir: str):
        """References are the same for every run: one copy in refs/, links beside the hypotheses."""
        refs = os.path.join(self.results, "refs")
        os.makedirs(refs, exist_ok=True)
        for f in sorted(os.listdir(eval_dir)):
            if ".ref." not in f:
                continue
            mine, shared = os.path.join(eval_dir, f), os.path.join(refs, f)
            with open(mine, "rb") as a:
                text = a.read()
            if not os.path.exists(shared):
                with open(shared, "wb") as b:
                    b.write(text)
            with open(shared, "rb") as b:
                if b.read() != text:
                    die(f"{mine} differs from {shared}: runs scored on other references")
            os.remove(mine)
            os.symlink(os.path.relpath(shared, eval_dir), mine)

    def after_run(self, name: str, final: str):
        if not (self.args.commit or self.args.report):
            return
        # in a fresh process: the report code on disk now, not the one this long run started with
        argv = [sys.executable, os.path.abspath(__file__), "report", "--results-dir", self.results]
        if self.args.update_readme:
            argv += ["--update-readme", "--readme", self.args.readme]
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"[quality] report failed: {done.stderr.strip()[-1000:]}", file=sys.stderr, flush=True)
        outputs = [quality_report.report_stem(self.results) + x for x in (".json", ".md")]
        outputs += [self.args.readme] if self.args.update_readme else []
        if self.args.commit:
            paths = [final, os.path.join(self.results, "refs"), os.path.join(self.results, "config.json"),
                     os.path.join(self.results, "copy_source.json")] + outputs
            status = json.load(open(os.path.join(final, "run.json"), encoding="utf-8"))["status"]
            git_commit(paths, f"Quality benchmark: {name} {status}, report regenerated\n\n"
                              "benchmarks/quality.py run --commit records every run as it finishes, "
                              "so the table grows across sittings.")


def git_commit(paths, message: str):
    paths = [os.path.relpath(p, REPO) for p in paths if os.path.lexists(p)]
    for attempt in range(30):  # another git command may hold the index for a moment
        add = subprocess.run(["git", "add", "-A", "--", *paths], cwd=REPO, capture_output=True, text=True)
        if add.returncode == 0:
            done = subprocess.run(["git", "commit", "-q", "-m", message, "--", *paths], cwd=REPO,
                                  capture_output=True, text=True)
            if done.returncode == 0 or "nothing" in done.stdout + done.stderr:
                return
        time.sleep(2)
    print(f"[quality] git commit failed: {(add.stderr or done.stderr).strip()}", file=sys.stderr)


def cmd_run(args):
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        die(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    if args.parallel < 1 or args.threads < 1:
        die("--parallel and --threads must be at least 1")
    runner = Runner(args)
    if args.commit and os.path.relpath(runner.results, REPO).startswith(".."):
        die(f"--commit: the results directory {runner.results} is outside the repository {REPO}")
    os.makedirs(runner.work, exist_ok=True)
    lock = open(os.path.join(runner.work, "run.lock"), "a+")
    try:  # two runners on one work directory would train the same runs into the same place
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        die(f"another quality.py run (pid {lock.read().strip() or '?'}) is using {runner.work}: wait for it "
            "or stop it (kill -- -PID stops it and its trainings)")
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    runner.check_config()
    runner.prepare_data()
    todo = []
    for seed in args.seeds:
        for system in args.systems:
            done = runner.finished(system, seed)
            if done and (done["status"] == "finished" or not args.retry_failed):
                print(f"[quality] {system} seed {seed}: {done['status']}, kept", file=sys.stderr)
            else:
                todo.append((system, seed))
    print(f"[quality] {len(todo)} run(s) to do, {args.parallel} at a time with {args.threads} thread(s) each; "
          f"work files in {runner.work}", file=sys.stderr, flush=True)
    with ThreadPoolExecutor(args.parallel) as pool:
        for future in [pool.submit(runner.run_one, s, k) for s, k in todo]:
            future.result()
    for publisher in runner.publishers:
        publisher.join()
    if not (args.commit or args.report):
        quality_report.report(runner.results, readme=args.readme if args.update_readme else None)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("run", "report"):
        q = sub.add_parser(name)
        q.add_argument("--results-dir", default=os.path.join(HERE, "quality"),
                       help="finished runs and the report [benchmarks/quality]")
        q.add_argument("--update-readme", action="store_true", help="rewrite the README's generated table")
        q.add_argument("--readme", default=os.path.join(REPO, "README.md"))
    r = sub.choices["run"]
    r.add_argument("--systems", nargs="+", default=list(SYSTEMS), metavar="SYSTEM",
                   help=f"[all: {' '.join(SYSTEMS)}]")
    r.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    r.add_argument("--work-dir", default="~/.cache/ea_fairseq/quality",
                   help="checkpoints, logs and data, outside the repository [~/.cache/ea_fairseq/quality]")
    r.add_argument("--parallel", type=int, default=2, help="runs at a time [2]")
    r.add_argument("--threads", type=int, default=1, help="CPU threads per run [1]")
    r.add_argument("--commit", action="store_true", help="git-commit each finished run with the regenerated report")
    r.add_argument("--report", action="store_true", help="regenerate the report after each run (without --commit)")
    r.add_argument("--retry-failed", action="store_true", help="run failed runs again")
    budget = r.add_argument_group("budget (the demo's CPU defaults when not given; recorded, a results "
                                  "directory holds one budget)")
    budget.add_argument("--updates", type=int)
    budget.add_argument("--max-tokens", type=int)
    budget.add_argument("--warmup", type=int)
    budget.add_argument("--avg", type=int, help="checkpoints averaged")
    budget.add_argument("--bpe-merges", type=int)
    budget.add_argument("--corpus", help="directory of {train,valid,test}.{es,en}.xz")
    args = p.parse_args(argv)
    if args.command == "run":
        return cmd_run(args)
    quality_report.report(os.path.abspath(args.results_dir), readme=args.readme if args.update_readme else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
