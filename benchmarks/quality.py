#!/usr/bin/env python3
"""Training progress of every attention family after the demo's budget on its corpus, over
seeds, with seed-level comparisons to transformer_lite: trained, translated and scored by the
project's own tools.

    .venv/bin/python benchmarks/quality.py run [--commit] [--allow-dirty]   # trains what is not finished
    .venv/bin/python benchmarks/quality.py report [--update-readme]

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
offline (``quality_report.py``); ``--update-readme`` rewrites the README's table between its
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
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import quality_report  # noqa: E402
from quality_report import venv_bin  # noqa: E402

BASELINE = "transformer_lite"
#: name -> (arch, extra fairseq-train options, seeds, the family whose learning rate it takes, or
#: None: its own, chosen on the validation set); the first is the baseline. The dropout a
#: mechanism defines itself: quality_report.OWN_DROPOUT. Seeds and the systems after the first
#: eight: the plan stated before their runs (quality/plan.md)
SYSTEMS = {
    "transformer_lite": ("transformer_lite", "", 10, None),
    "ea_transformer_lite": ("ea_transformer_lite", "", 10, None),
    "pa_transformer_lite": ("pa_transformer_lite", "", 3, None),
    "ran_d_lite": ("ran_d_lite", "", 3, None),
    "ran_all_lite": ("ran_all_lite", "", 3, None),
    "realformer_lite": ("realformer_lite", "", 3, None),
    "resformer_lite": ("resformer_lite", "", 3, None),
    # DropAttention(e) with the paper's MT setting (README: p 0.2, window 2)
    "transformer_lite_dropattention_e": ("transformer_lite", "--drop-attention element --drop-attention-p 0.2 "
                                                             "--drop-attention-window 2", 3, None),
    # the baseline given EA-Lite's CPU time per run (1.16 x: 1200 -> 1400 updates, the same schedule)
    "transformer_lite_1400_updates": ("transformer_lite", "--max-update 1400", 5, "transformer_lite"),
    # EA's two parts apart: the residual convolution alone (alpha 0), the alpha skip alone (beta 0)
    "ea_transformer_lite_alpha0": ("ea_transformer_lite", "--ea-alpha 0", 5, "ea_transformer_lite"),
    "ea_transformer_lite_beta0": ("ea_transformer_lite", "--ea-beta 0", 5, "ea_transformer_lite"),
    # RAN without the attention dropout its architectures set, as every other family trains
    "ran_d_lite_attention_dropout0": ("ran_d_lite", "--attention-dropout 0.0", 3, "ran_d_lite"),
    "ran_all_lite_attention_dropout0": ("ran_all_lite", "--attention-dropout 0.0", 3, "ran_all_lite"),
}
#: system -> its first seed whose every checkpoint is kept (in --work-dir), for learning curves
KEEP_CHECKPOINTS = {"transformer_lite": 6, "ea_transformer_lite": 6}
LRS = (0.001, 0.002)
SRC, TGT = "es", "en"
BUDGET_ENV = {"updates": "DEMO_UPDATES", "max_tokens": "DEMO_MAX_TOKENS", "bpe_merges": "DEMO_BPE_MERGES",
              "avg": "DEMO_AVG", "warmup": "DEMO_WARMUP", "corpus": "DEMO_CORPUS", "dropout": "DEMO_DROPOUT"}
#: the demo's translation of the test set (scripts/demo.sh, gen_args), here of the validation set
GEN_ARGS = ["--source-lang", SRC, "--target-lang", TGT, "--beam", "5", "--remove-bpe", "--max-tokens", "6000",
            "--required-batch-size-multiple", "1", "--max-len-a", "1.5", "--max-len-b", "10", "--num-workers", "0",
            "--cpu"]


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


def git_state(repo: str, exclude) -> dict:
    """The commit checked out in ``repo`` and the files changed or untracked outside the
    ``exclude`` paths (the results); None for the commit outside a git checkout."""
    def git(*argv):
        return subprocess.run(["git", *argv], cwd=repo, capture_output=True, text=True)
    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
        return {"commit": None, "dirty": []}
    specs = ["."] + [f":(exclude){os.path.relpath(p, repo)}" for p in exclude
                     if not os.path.relpath(p, repo).startswith("..")]
    status = git("status", "--porcelain", "--untracked-files=normal", "--", *specs)
    return {"commit": head.stdout.strip(), "dirty": [line[3:] for line in status.stdout.splitlines() if line]}


def pip_freeze() -> str:
    done = subprocess.run([venv_bin("python"), "-m", "pip", "freeze", "--all"], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else f"pip freeze failed (exit {done.returncode}): {done.stderr}"


def lr_name(lr: float) -> str:
    return f"lr{lr:g}"


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
        self.git = git_state(REPO, [self.results, *report_outputs(self.results, args)])
        self.freeze = pip_freeze()

    def seeds(self, system: str):
        return list(self.args.seeds) if self.args.seeds else list(range(1, SYSTEMS[system][2] + 1))

    def lr_of(self, system: str) -> Optional[float]:
        """The rate ``system`` trains at: its own choice, or that of the family it takes it from
        (None while that choice is not made)."""
        family = SYSTEMS[system][3]
        if family is None:
            return self.choose_lr(system)
        path = os.path.join(self.results, "lr_selection", family, "choice.json")
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)["lr"]

    # ------------------------------------------------------------------ data, configuration
    def check_config(self):
        budget = {k: getattr(self.args, k) for k in BUDGET_ENV}
        budget["corpus"] = os.path.abspath(budget["corpus"]) if budget["corpus"] else None
        budget["lrs"] = sorted(self.args.lrs)
        path = os.path.join(self.results, "config.json")
        planned = [[s, k] for s in self.args.systems for k in self.seeds(s)]
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
            if config["budget"] != budget:
                die(f"{self.results} holds runs of another budget ({config['budget']}, asked: {budget}): "
                    "give another --results-dir")
            planned = config["planned"] + [p for p in planned if p not in config["planned"]]
        os.makedirs(self.results, exist_ok=True)
        config = {"budget": budget, "planned": planned, "baseline": BASELINE,
                  "systems": {s: {"arch": a, "train_args": x, "seeds": n, "lr_of": lr_of,
                                  "own_dropout": quality_report.OWN_DROPOUT.get(s, "")}
                              for s, (a, x, n, lr_of) in SYSTEMS.items()}}
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
    def finished_at(self, final: str):
        path = os.path.join(final, "run.json")
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    def candidate_dir(self, system: str, lr: float) -> str:
        return os.path.join(self.results, "lr_selection", system, lr_name(lr))

    def run_dir(self, system: str, seed: int) -> str:
        return os.path.join(self.results, "runs", system, f"seed{seed}")

    def run_one(self, system: str, seed: int, lr: float, final: str, validate: bool = False) -> None:
        """Train, translate and score one run into ``final`` (staged beside it, moved there
        once scored); ``validate``: also translate and score the validation set."""
        arch, train_args, _, _ = SYSTEMS[system]
        if seed >= KEEP_CHECKPOINTS.get(system, 1 << 30):
            train_args = f"{train_args} --keep-interval-updates -1".strip()  # every checkpoint kept
        name = f"{system} seed {seed} lr {lr:g}"
        work = os.path.join(self.work, os.path.relpath(final, self.results))
        stage = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.partial")
        for d in (work, stage):
            shutil.rmtree(d, ignore_errors=True)
        os.makedirs(work)
        os.makedirs(os.path.join(stage, "eval"))
        os.symlink(self.data, os.path.join(work, "data"))  # the demo reuses it (same stamp)
        env = demo_env(self.args, DEMO_DIR=work, DEMO_ARCHS=arch, DEMO_SEED=seed, DEMO_LR=f"{lr:g}", DEMO_PARALLEL=1,
                       DEMO_THREADS=self.args.threads, DEMO_STOP_AFTER="translation", DEMO_TRAIN_ARGS=train_args)
        demo = ["bash", os.path.join(REPO, "scripts", "demo.sh")]
        with open(os.path.join(stage, "pip-freeze.txt"), "w", encoding="utf-8") as f:
            f.write(self.freeze)
        record = {"system": system, "seed": seed, "lr": lr, "arch": arch, "train_args": train_args,
                  "git": self.git, "machine": self.machine, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                  "load_at_start": os.getloadavg(), "commands": [command_line(env, demo)]}
        print(f"[quality] {name}: training ({work}/demo.log)", file=sys.stderr, flush=True)
        rc, wall, cpu = run_measured(demo, env, os.path.join(work, "demo.log"))
        run_dir = os.path.join(work, "train", arch)
        for log in (os.path.join(run_dir, "train.log"), os.path.join(work, "demo.log")):
            if os.path.exists(log):
                shutil.copy(log, os.path.join(stage, os.path.basename(log)))
        if rc < 0 or rc in (130, 143):  # interrupted: nothing to record, the next sitting restarts it
            shutil.rmtree(stage, ignore_errors=True)
            raise SystemExit(f"quality.py: {name} interrupted (exit {rc}); run again to restart it")
        record.update(demo_wall_s=wall, demo_cpu_s=cpu, demo_exit=rc)
        if rc == 0:
            rc = self.score(record, os.path.join(run_dir, "eval", "generate.out"), "test", os.path.join(stage, "eval"))
        averaged = os.path.join(run_dir, "eval", "averaged.pt")
        if rc == 0 and validate:
            rc = self.validate(record, averaged, os.path.join(work, "valid"), os.path.join(stage, "valid"))
        if rc == 0:
            with open(os.path.join(run_dir, "train_seconds"), encoding="utf-8") as f:
                record["train_wall_s"] = int(f.read())
            with open(os.path.join(run_dir, ".done"), encoding="utf-8") as f:
                record["demo_train_stamp"] = f.read().strip()
            for scored in ("eval", "valid") if validate else ("eval",):
                self.link_refs(os.path.join(stage, scored))
            self.probe(record, averaged, os.path.join(stage, "probe.txt"))
            record["status"] = "finished"
        else:
            record["status"] = "failed"
            with open(os.path.join(work, "demo.log"), encoding="utf-8", errors="replace") as f:
                record["log_tail"] = f.read().splitlines()[-30:]
            record.setdefault("failure", f"scripts/demo.sh exited {rc}")
        if os.path.exists(os.path.join(stage, "train.log")):
            record["training"] = quality_report.training_summary(os.path.join(stage, "train.log"))
        extra = [record.get(k, (0, 0)) for k in ("score_s", "valid_s", "valid_score_s", "probe_s")]
        record.update(wall_s=wall + sum(x[0] for x in extra), cpu_s=cpu + sum(x[1] for x in extra),
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

    def score(self, record: dict, generated: str, subset: str, out_dir: str) -> int:
        """ea-fairseq-bleu on a translation of ``subset`` into ``out_dir``; its exit status."""
        os.makedirs(out_dir, exist_ok=True)
        bleu = [venv_bin("ea-fairseq-bleu"), generated, "--mode", "wmt", "--target-lang", TGT,
                "--raw-ref", os.path.join(self.data, "raw", f"{subset}.{TGT}"),
                "--expect-idx", os.path.join(self.data, "bin", f"{subset}.{SRC}-{TGT}.{SRC}.idx"),
                "--out-prefix", os.path.join(out_dir, f"{subset}.{SRC}-{TGT}")]
        record["commands"].append(command_line({}, bleu))
        rc, wall, cpu = run_measured(bleu, {}, os.path.join(out_dir, f"bleu-{subset}.{SRC}-{TGT}.txt"))
        key = "score_s" if subset == "test" else "valid_score_s"
        record[key] = [wall, cpu]
        if rc != 0:
            record["failure"] = f"ea-fairseq-bleu exited {rc} ({subset})"
        return rc

    def validate(self, record: dict, averaged: str, work: str, out_dir: str) -> int:
        """The averaged checkpoint's translation of the validation set (the demo's beam search),
        scored as the test set is: what the learning rate is chosen on."""
        os.makedirs(work, exist_ok=True)
        gen = [venv_bin("fairseq-generate"), os.path.join(self.data, "bin"), "--user-dir",
               os.path.join(REPO, "ea_fairseq"), "--path", averaged, "--gen-subset", "valid", *GEN_ARGS]
        record["commands"].append(command_line({}, gen))
        out = os.path.join(work, "generate.out")
        t0 = time.monotonic()
        with open(out, "w", encoding="utf-8") as f, open(os.path.join(work, "generate.log"), "w") as log:
            proc = subprocess.Popen(gen, stdout=f, stderr=log, cwd=REPO,
                                    env={**os.environ, "OMP_NUM_THREADS": str(self.args.threads)})
            _, status, usage = os.wait4(proc.pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        record["valid_s"] = [time.monotonic() - t0, usage.ru_utime + usage.ru_stime]
        if rc != 0:
            record["failure"] = f"fairseq-generate on the validation set exited {rc}"
            return rc
        return self.score(record, out, "valid", out_dir)

    def probe(self, record: dict, averaged: str, out: str) -> None:
        """benchmarks/collapse_probe.py on the averaged checkpoint, its output kept beside the
        run (a probe that fails is recorded, the run stands)."""
        argv = [venv_bin("python"), os.path.join(HERE, "collapse_probe.py"), averaged, os.path.join(self.data, "bin"),
                "--batch", str(self.args.probe_batch)]
        record["commands"].append(command_line({}, argv))
        rc, wall, cpu = run_measured(argv, {"OMP_NUM_THREADS": str(self.args.threads)}, out)
        record.update(probe_s=[wall, cpu], probe_exit=rc)

    def publish(self, name: str, final: str):
        with self.lock:
            self.after_run(name, final)

    def link_refs(self, eval_dir: str):
        """References are the same for every run: one copy of each (test and validation) in refs/,
        links beside the hypotheses."""
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

    # ------------------------------------------------------------------ learning rate
    def choose_lr(self, system: str) -> Optional[float]:
        """The family's rate from its finished candidates (all of them finished), written to
        lr_selection/SYSTEM/choice.json, its run linked as runs/SYSTEM/seed1; None if not all
        finished."""
        scores = {}
        for lr in self.args.lrs:
            record = self.finished_at(self.candidate_dir(system, lr))
            if not record or record["status"] != "finished":
                return None
            valid = os.path.join(self.candidate_dir(system, lr), "valid", f"valid.{SRC}-{TGT}.scores.json")
            with open(valid, encoding="utf-8") as f:
                metrics = json.load(f)["metrics"]
            scores[lr] = {m: metrics[m]["score"] for m in quality_report.METRICS}
        best = max(scores, key=lambda lr: (scores[lr]["sacrebleu"], scores[lr]["chrf"], -lr))
        quality_report.write_json(os.path.join(self.results, "lr_selection", system, "choice.json"),
                                  {"system": system, "lr": best, "seed": 1, "subset": "valid",
                                   "rule": "best validation sacreBLEU, then chrF, then the lower rate",
                                   "valid": {f"{lr:g}": v for lr, v in sorted(scores.items())}})
        link = self.run_dir(system, 1)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        target = os.path.relpath(self.candidate_dir(system, best), os.path.dirname(link))
        if os.path.islink(link) and os.readlink(link) == target:
            return best
        if os.path.lexists(link) and not os.path.islink(link):
            die(f"{link} is a run of its own, not a link to its family's learning-rate run: give another "
                "--results-dir (this one holds runs of another layout)")
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(target, link)
        return best

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
        if self.args.commit:
            paths = [final, os.path.join(self.results, "refs"), os.path.join(self.results, "config.json"),
                     os.path.join(self.results, "copy_source.json"), os.path.join(self.results, "runs"),
                     os.path.join(self.results, "lr_selection")] + report_outputs(self.results, self.args)
            status = json.load(open(os.path.join(final, "run.json"), encoding="utf-8"))["status"]
            git_commit(paths, f"Quality benchmark: {name} {status}, report regenerated\n\n"
                              "benchmarks/quality.py run --commit records every run as it finishes, "
                              "so the table grows across sittings.")


def report_outputs(results: str, args) -> list:
    outputs = [quality_report.report_stem(results) + x for x in (".json", ".md")]
    return outputs + ([os.path.abspath(args.readme)] if getattr(args, "update_readme", False) else [])


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
    os.makedirs(runner.work, exist_ok=True)
    lock = open(os.path.join(runner.work, "run.lock"), "a+")
    try:  # two runners on one work directory would train the same runs into the same place
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        die(f"another quality.py run (pid {lock.read().strip() or '?'}) is using {runner.work}: wait for it "
            "or stop it (kill -- -PID stops it and its trainings)")
    check_provenance(runner, args.allow_dirty)
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
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
    with ThreadPoolExecutor(args.parallel) as pool:
        for future in [pool.submit(runner.run_one, s, 1, lr, runner.candidate_dir(s, lr), True)
                       for s, lr in candidates]:
            future.result()
    chosen = {s: runner.lr_of(s) for s in args.systems}
    # 2. the other seeds at the chosen rate (every seed of a system taking its family's rate)
    todo = [(s, k) for s in args.systems for k in runner.seeds(s)
            if (k != 1 or SYSTEMS[s][3] is not None) and chosen[s] is not None
            and pending(runner.run_dir(s, k), f"{s} seed {k}")]
    print(f"[quality] {len(todo)} run(s) to do at the chosen rates "
          f"({', '.join(f'{s} {lr:g}' for s, lr in chosen.items() if lr is not None) or 'none chosen'})",
          file=sys.stderr, flush=True)
    with ThreadPoolExecutor(args.parallel) as pool:
        for future in [pool.submit(runner.run_one, s, k, chosen[s], runner.run_dir(s, k)) for s, k in todo]:
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
    r.add_argument("--seeds", nargs="+", type=int,
                   help="the seeds of every system [SYSTEMS: 10 for transformer_lite and ea_transformer_lite]")
    r.add_argument("--lrs", nargs="+", type=float, default=list(LRS),
                   help="learning rates tried per family on the validation set, seed 1 [0.001 0.002]")
    r.add_argument("--probe-batch", type=int, default=20,
                   help="the training batch benchmarks/collapse_probe.py probes [20]")
    r.add_argument("--allow-dirty", action="store_true",
                   help="run on a working tree with uncommitted changes (recorded in each run)")
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
    budget.add_argument("--dropout", type=float, default=0.0, help="--dropout of every family [0.0]")
    budget.add_argument("--corpus", help="directory of {train,valid,test}.{es,en}.xz")
    args = p.parse_args(argv)
    if args.command == "run":
        return cmd_run(args)
    quality_report.report(os.path.abspath(args.results_dir), readme=args.readme if args.update_readme else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
