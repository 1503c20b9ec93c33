"""What the tests of the translation recipes share: the CLIs installed next to the Python
running the tests, an environment that keeps every recipe offline and on the CPU, a command
run with its output shown when it fails, the tiny model's options, prepare + train steps,
recipe jobs run two at a time, and the documentation's command blocks.

The recipes run offline on tiny fixture archives (tests/support/recipe_fixtures.py): each prepare
script runs with --raw-dir (EA_NO_DOWNLOAD is set as well), its binarized output is trained
on for a few updates with fairseq-train, and examples/translation/evaluate.sh scores the
resulting checkpoints end to end.
"""
import lzma
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "examples" / "translation"
BIN = Path(sys.executable).parent
TINY = ["--arch", "transformer", "--encoder-layers", "1", "--decoder-layers", "1",
        "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
        "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
        "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]
TINY_RUN = ["--required-batch-size-multiple", "1", "--no-progress-bar", "--num-workers", "0",
            "--log-format", "simple", "--seed", "1", "--cpu"]
# the same through train.sh, which sets the seed (SEED), the device (CPU=1) and the log format
TRAIN_SH_RUN = ["--required-batch-size-multiple", "1", "--no-progress-bar", "--num-workers", "0"]


def tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.skip(f"{name} is not installed next to {sys.executable}")
    return str(path)


@pytest.fixture(scope="module")
def env():
    e = dict(os.environ)
    e.update(PATH=f"{BIN}{os.pathsep}{e.get('PATH', '')}", PYTHON=sys.executable,
             FAIRSEQ_GENERATE=tool("fairseq-generate"),
             FAIRSEQ_TRAIN=tool("fairseq-train"), WORKERS="1", EA_NO_DOWNLOAD="1",
             OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    for var in ("EA_RAW_DIR", "EA_WORK_DIR", "EA_DEST_DIR", "BPE_TOKENS", "CUDA_VISIBLE_DEVICES", "NGPUS",
                "CPU", "FP16", "BF16", "SEED", "SEEDS", "SAVE_DIR", "DATA", "ALLOW_CHANGED_SETTINGS",
                "LOG_INTERVAL", "EVAL_BLEU", "EA_FAIRSEQ_SHOW_WARNINGS"):
        e.pop(var, None)
    e["CUDA_VISIBLE_DEVICES"] = ""
    return e


def run(cmd, env, cwd, check=True):
    proc = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd[:3]} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
                             f"stderr:\n{proc.stderr[-5000:]}")
    return proc


def prepare(script, raw, work, env, *args):
    dest = work / "data-bin"
    run(["bash", RECIPES / script, *args, "--raw-dir", raw, "--work-dir", work / "work",
         "--dest-dir", dest], env, cwd=work)
    return dest


def fairseq_train_in_process(*argv):
    """fairseq-train with this command line through its console entry point in this process
    (fairseq is imported here already; a process of its own pays the imports again), on one
    thread; the deprecation warnings of hydra that fairseq's configuration prints unshown, as
    the command's stderr is. Not from a worker thread: fairseq's training keeps process-wide state."""
    import warnings

    import torch
    from fairseq_cli.train import cli_main

    threads, saved_argv = torch.get_num_threads(), sys.argv
    torch.set_num_threads(1)
    sys.argv = ["fairseq-train", *[str(a) for a in argv]]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cli_main()
    finally:
        sys.argv = saved_argv
        torch.set_num_threads(threads)


def train_in_process(data, save, *args, epochs=2):
    """The tiny transformer of ``TINY`` trained on ``data`` into ``save`` (Adam, 1000 tokens a
    batch, ``epochs`` epochs, ``args`` last), with ``fairseq_train_in_process``."""
    fairseq_train_in_process(data, *TINY, "--share-all-embeddings", "--optimizer", "adam", "--lr", "1e-3",
                             "--max-tokens", "1000", "--max-epoch", epochs, "--save-dir", save, *TINY_RUN, *args)
    return save


def lines(path: Path):
    return path.read_text(encoding="utf-8").splitlines()


@contextmanager
def two_at_a_time(jobs: dict, tmp_path_factory, env):
    """Start every job (``name -> job(root, env)``, each in a directory of its own), two at a
    time (the machines have 2 cores; a recipe is mostly serial process start-up); yields
    ``result(name)``, which waits for that job's result."""
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {name: pool.submit(job, tmp_path_factory.mktemp(name), env) for name, job in jobs.items()}
    try:
        yield lambda name: futures[name].result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def dry_run(env, cwd, family, pair, check=True, **extra):
    """train.sh DRY_RUN=1: (command, stderr). Without CUDA here it shows the GPU command;
    PYTHON=true skips its torch probe (a second each), as on a machine without torch."""
    proc = run(["bash", RECIPES / "train.sh", family, pair], dict(env, DRY_RUN="1", PYTHON="true", **extra),
               cwd, check=check)
    return proc.stdout, proc.stderr


def evaluate_recipe(run_info, mode, env, *args):
    """evaluate.sh on a trained recipe's checkpoints (the last 2 averaged), generation kept short."""
    return run(["bash", RECIPES / "evaluate.sh", run_info["save"], run_info["data"], mode,
                "--num-avg", "2", "--cpu", *args, "--", "--max-len-a", "0", "--max-len-b", "6"],
               env, cwd=run_info["root"])


def score_in(line: str) -> float:
    return float(re.search(r": (?:BLEU4 = )?([0-9.]+)", line).group(1))


def compare_table(out: str, metric: str = None):
    """The rows of ea-fairseq-compare's table of ``metric`` (default: the first table), by system."""
    tables = {}
    for block in out.split("\n\n"):
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in block.splitlines() if line.startswith("| ")]
        if rows:
            tables[rows[0][2].rsplit(" of each run", 1)[0]] = {row[0]: row for row in rows[1:]}
    return tables[metric] if metric else next(iter(tables.values()))


# --------------------------------------------- the documentation's commands, as written
def doc_block(doc: Path, heading: str, lang: str) -> str:
    """The first ```LANG block after HEADING in DOC."""
    text = doc.read_text(encoding="utf-8")
    return re.search(rf"^{re.escape(heading)}\n.*?```{lang}\n(.*?)```", text, re.S | re.M).group(1)


def doc_commands(doc: Path, heading: str):
    """The shell commands of that block, continuation lines joined, comments dropped."""
    block = doc_block(doc, heading, "bash").replace("\\\n", " ")
    return [line.strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]


BIBLE = RECIPES / "bible-es-en"
WALK_SIZES = {"train": 150, "valid": 20, "test": 12}


def walk_through_tree(root: Path) -> None:
    """ROOT laid out as the repository is, for commands run from its root: the recipes and
    the plugin linked, the Bible corpus replaced by its first sentence pairs (.xz, as shipped)."""
    recipes = root / "examples" / "translation"
    recipes.mkdir(parents=True)
    for f in RECIPES.iterdir():
        if f.name != "bible-es-en":
            (recipes / f.name).symlink_to(f)
    (root / "ea_fairseq").symlink_to(REPO / "ea_fairseq")
    (root / "scripts").symlink_to(REPO / "scripts")  # (the recipes write through scripts/safe_write.py)
    (recipes / "bible-es-en").mkdir()
    for split, n in WALK_SIZES.items():
        for lang in ("es", "en"):
            with lzma.open(BIBLE / f"{split}.{lang}.xz", "rt", encoding="utf-8") as f:
                head = [next(f) for _ in range(n)]
            with lzma.open(recipes / "bible-es-en" / f"{split}.{lang}.xz", "wt", encoding="utf-8") as f:
                f.writelines(head)
