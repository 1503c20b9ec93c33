"""The quality benchmark's runner: each run of the plan (quality_plan.py) trained, translated
and scored through the demo and ea-fairseq-bleu into a staging directory, probed, recorded
(commands, wall and CPU time, the machine and its load, the commit, pip freeze) and moved into
the results once scored; the family's learning rate chosen on the validation set; the report
regenerated and the run committed as it finishes. The processes it starts, their timing, and
the records of the machine, the environment and the git checkout.
"""
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import threading
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "quality.py")
sys.path.insert(0, HERE)  # its sibling modules, however this file is loaded
import quality_report  # noqa: E402
import quality_results  # noqa: E402
from quality_plan import (BASELINE, BUDGET_ENV, COMPARISONS, GEN_ARGS, KEEP_CHECKPOINTS, LRS, LRS_BESIDE,  # noqa: E402
                          SRC, SYSTEMS, TGT)
from quality_results import venv_bin  # noqa: E402


def die(msg: str):
    raise SystemExit(f"quality.py: {msg}")


def machine() -> dict:
    """The machine a run ran on. Two hosts named alike (a VM's "AMD EPYC") may still sum floats
    differently, so the CPU's family, model and vector instructions are kept beside its name."""
    info = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    from importlib.metadata import version
    return {"cpu": info.get("model name") or platform.processor() or "", "cores": os.cpu_count(),
            "cpu_model": " ".join(f"{k} {info[k]}" for k in ("cpu family", "model", "stepping") if k in info),
            "vector": " ".join(sorted(f for f in info.get("flags", "").split() if f.startswith(("avx", "fma")))),
            "platform": platform.platform(), "host": platform.node(),
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
        config = {"budget": budget, "planned": planned, "baseline": BASELINE, "comparisons": [list(c) for c in COMPARISONS],
                  "systems": {s: {"arch": a, "train_args": x, "seeds": n, "lr_of": lr_of,
                                  "own_dropout": quality_results.OWN_DROPOUT.get(s, "")}
                              for s, (a, x, n, lr_of) in SYSTEMS.items()}}
        quality_results.write_json(path, config)

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
        copy = quality_results.copy_source_scores(os.path.join(self.data, "raw", f"test.{SRC}"),
                                                 os.path.join(self.data, "raw", f"test.{TGT}"))
        with open(os.path.join(self.data, "raw", f"train.{SRC}"), encoding="utf-8") as f:
            copy["train_sentences"] = sum(1 for _ in f)
        copy["command"] = command_line(env, argv)
        quality_results.write_json(os.path.join(self.results, "copy_source.json"), copy)

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

    def rerun_dir(self, system: str, seed: int) -> str:
        """Where ``quality.py run --rerun`` trains a stored run again (quality_reruns.py)."""
        return os.path.join(self.results, "reruns", system, f"seed{seed}")

    def run_one(self, system: str, seed: int, lr: float, final: str, validate: bool = False) -> None:
        """Train, translate and score one run into ``final`` (staged beside it, moved there
        once scored); ``validate``: also translate and score the validation set."""
        arch, train_args, _, _ = SYSTEMS[system]
        if seed >= KEEP_CHECKPOINTS.get(system, 1 << 30):
            train_args = f"{train_args} --keep-interval-updates -1".strip()  # every checkpoint kept
        place = os.path.relpath(final, self.results)
        name = f"{system} seed {seed} lr {lr:g}" + (" again" if place.startswith("reruns") else "")
        work = os.path.join(self.work, place)
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
            record["training"] = quality_results.training_summary(os.path.join(stage, "train.log"))
        extra = [record.get(k, (0, 0)) for k in ("score_s", "valid_s", "valid_score_s", "probe_s")]
        record.update(wall_s=wall + sum(x[0] for x in extra), cpu_s=cpu + sum(x[1] for x in extra),
                      load_at_end=os.getloadavg(), ended=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
        quality_results.write_json(os.path.join(stage, "run.json"), record)
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
    def lrs_beside(self, system: str):
        """The rates tried beside the plan's for ``system`` (quality_plan.LRS_BESIDE), where
        this run tries the plan's rates."""
        return [lr for lr in LRS_BESIDE.get(system, ()) if lr not in self.args.lrs] \
            if sorted(self.args.lrs) == sorted(LRS) else []

    def valid_scores(self, system: str, lr: float) -> Optional[dict]:
        """The validation scores of ``system``'s finished seed-1 run at ``lr``; None if not finished."""
        record = self.finished_at(self.candidate_dir(system, lr))
        if not record or record["status"] != "finished":
            return None
        with open(os.path.join(self.candidate_dir(system, lr), "valid", f"valid.{SRC}-{TGT}.scores.json"),
                  encoding="utf-8") as f:
            metrics = json.load(f)["metrics"]
        return {m: metrics[m]["score"] for m in quality_results.METRICS}

    def choose_lr(self, system: str) -> Optional[float]:
        """The family's rate from its finished candidates (all of them finished), written to
        lr_selection/SYSTEM/choice.json with the finished runs at the rates tried beside them
        (``beside``: they never change the choice), its run linked as runs/SYSTEM/seed1; None if
        not all finished."""
        scores = {lr: self.valid_scores(system, lr) for lr in self.args.lrs}
        if any(v is None for v in scores.values()):
            return None
        best = max(scores, key=lambda lr: (scores[lr]["sacrebleu"], scores[lr]["chrf"], -lr))
        beside = {lr: self.valid_scores(system, lr) for lr in self.lrs_beside(system)}
        quality_results.write_json(os.path.join(self.results, "lr_selection", system, "choice.json"),
                                  {"system": system, "lr": best, "seed": 1, "subset": "valid",
                                   "rule": "best validation sacreBLEU, then chrF, then the lower rate",
                                   "valid": {f"{lr:g}": v for lr, v in sorted(scores.items())},
                                   "beside": {f"{lr:g}": v for lr, v in sorted(beside.items()) if v is not None}})
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
        argv = [sys.executable, SCRIPT, "report", "--results-dir", self.results]
        if self.args.update_readme:
            argv += ["--update-readme", "--readme", self.args.readme]
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"[quality] report failed: {done.stderr.strip()[-1000:]}", file=sys.stderr, flush=True)
        if self.args.commit:
            paths = [final, os.path.join(self.results, "refs"), os.path.join(self.results, "config.json"),
                     os.path.join(self.results, "reruns"),
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
