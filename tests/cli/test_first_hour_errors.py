"""A newcomer's first mistakes with ``--user-dir ea_fairseq``: each, through the console entry
point, ends with one line that names the fix (no traceback, no usage and list of every arch),
its exit status, and nothing written (no save dir, no output). Without the plugin fairseq
prints what it always has (the negative controls), and what fairseq runs is still run."""
import importlib.util
import os
import re
import shutil
import subprocess

import pytest
import torch

from conftest import REPO, cli
from ea_fairseq import errors
from ea_fairseq.device_checks import COMMAND_LINE, refusal

FIXTURES = os.path.join(REPO, "tests", "fixtures", "checkpoints")
USER_DIR = os.path.join(REPO, "ea_fairseq")
TORCH_SEEN = f"torch sees 0 here (torch {torch.__version__}, built for CUDA: {torch.version.cuda or 'none'})"
NO_CUDA = not torch.cuda.is_available()
HAS_XLA = importlib.util.find_spec("torch_xla") is not None
LOG_RECORD = re.compile(r"(DEBUG|INFO|WARNING):[\w.]+:")  # fairseq-generate logs its configuration first
TRAIN = ["fairseq-train", "data", "--user-dir", USER_DIR, "--arch", "transformer_lite", "--encoder-layers", "1",
         "--decoder-layers", "1", "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500", "--max-update", "1",
         "--save-dir", "ckpt", "--num-workers", "0", "--disable-validation"]
CONFIGS = os.path.join(REPO, "examples", "translation", "config")
GENERATE = ["fairseq-generate", "data", "--user-dir", USER_DIR, "--cpu", "--beam", "1"]


def run(argv, cwd, stdin=""):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([cli(argv[0]), *argv[1:]], capture_output=True, text=True, cwd=cwd, env=env, timeout=300,
                          input=stdin)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """``data``: train, valid and test splits (5 sentences) binarized with the checkpoint
    fixtures' dictionaries; ``other``: the test split binarized with a larger joined dictionary;
    ``twice``: ``data`` with a word twice in its source dictionary;
    ``checkpoint_best.pt`` and ``checkpoint_last.pt``: the EA fixture."""
    from fairseq import options
    from fairseq_cli import preprocess

    d = tmp_path_factory.mktemp("first-hour")
    for split, lines in (("train", 8), ("valid", 3), ("test", 5)):
        words = [" ".join(f"s{(i + j) % 8}" for j in range(3 + i % 4)) for i in range(lines)]
        (d / f"{split}.src").write_text("".join(f"{w}\n" for w in words))
        (d / f"{split}.tgt").write_text("".join(" ".join(f"t{x[1:]}" for x in reversed(w.split())) + "\n"
                                                for w in words))
    args = ["--source-lang", "src", "--target-lang", "tgt", "--destdir", str(d / "data"), "--workers", "1",
            "--srcdict", os.path.join(FIXTURES, "dict.src.txt"), "--tgtdict", os.path.join(FIXTURES, "dict.tgt.txt")]
    for split in ("train", "valid", "test"):
        args += [f"--{split}pref", str(d / split)]
    (d / "more.src").write_text("".join(f"w{i} x{i}\n" for i in range(30)))
    (d / "more.tgt").write_text("".join(f"v{i}\n" for i in range(30)))
    other = ["--source-lang", "src", "--target-lang", "tgt", "--destdir", str(d / "other"), "--workers", "1",
             "--joined-dictionary", "--trainpref", str(d / "more"), "--testpref", str(d / "test")]
    before = list(preprocess.logger.handlers)
    try:
        for argv in (args, other):
            preprocess.main(options.get_preprocessing_parser().parse_args(argv))
    finally:  # its DESTDIR/preprocess.log handler, closed
        for handler in list(preprocess.logger.handlers):
            if handler not in before:
                preprocess.logger.removeHandler(handler)
                handler.close()
    for name in ("checkpoint_best.pt", "checkpoint_last.pt"):
        shutil.copy(os.path.join(FIXTURES, "ea", "checkpoint.pt"), d / name)
    shutil.copytree(d / "data", d / "twice")  # its source dictionary with one word twice
    with open(d / "twice" / "dict.src.txt", "a", encoding="utf-8") as f:
        f.write("s2 1\n")
    return d


MISTAKES = [  # the command line, its exit status, the one line it prints (its standard input)
    pytest.param([*TRAIN, "--fp16"], 1,
                 f"fairseq-train: error: --fp16 needs a CUDA GPU, and {TORCH_SEEN}: run without --fp16, "
                 "or on a CUDA GPU",
                 id="fp16 without a GPU", marks=pytest.mark.skipif(not NO_CUDA, reason="a CUDA GPU is visible")),
    pytest.param([*TRAIN, "--cpu", "--fp16"], 1,
                 "fairseq-train: error: --fp16 needs a CUDA GPU, and --cpu trains on the CPU: run without --fp16, "
                 "or on a CUDA GPU", id="fp16 with --cpu"),
    pytest.param([*TRAIN, "--cpu", "--bf16"], 1,
                 "fairseq-train: error: --bf16 runs on a TPU (fairseq's command line sets --tpu with it), and "
                 "torch_xla is not installed: run without --bf16",
                 id="bf16 without torch_xla", marks=pytest.mark.skipif(HAS_XLA, reason="torch_xla is installed")),
    pytest.param([*TRAIN, "--cpu", "--distributed-world-size", "2"], 1,
                 "fairseq-train: error: --distributed-world-size 2 needs 2 CUDA GPUs, and --cpu trains on the CPU: "
                 "run with --distributed-world-size 1 (--update-freq 2 keeps the command line's batch), or on 2 "
                 "CUDA GPUs", id="world size above the GPUs",
                 marks=pytest.mark.skipif(torch.cuda.device_count() > 1, reason="two CUDA GPUs are visible")),
    # argparse's status for a command line it refuses, as fairseq's own parser exits
    pytest.param([*TRAIN[:5], "ea_transformer_lit", *TRAIN[6:]], 2,
                 "fairseq-train: error: argument --arch/-a: invalid choice: 'ea_transformer_lit' (did you mean "
                 "ea_transformer_lite?); `ea-fairseq-options` lists the plugin's architectures", id="arch typo"),
    pytest.param([*TRAIN, "--max-tokns", "500"], 2,
                 "fairseq-train: error: unrecognized arguments: --max-tokns 500 (did you mean --max-tokens?)",
                 id="option typo"),
    pytest.param([*TRAIN[:5], "ea_transformer_lite", *TRAIN[6:], "--ea-alpah", "0.5"], 2,
                 "fairseq-train: error: unrecognized arguments: --ea-alpah 0.5 (did you mean --ea-alpha?)",
                 id="model option typo"),
    pytest.param([*TRAIN, "--lr-shceduler"], 2,
                 "fairseq-train: error: unrecognized arguments: --lr-shceduler (did you mean --lr-scheduler?)",
                 id="option typo without a value"),
    pytest.param([*GENERATE, "--path", "checkpoint_bset.pt"], 1,
                 "fairseq-generate: error: --path checkpoint_bset.pt: no such file; . has checkpoint_best.pt, "
                 "checkpoint_last.pt", id="missing checkpoint"),
    pytest.param([*GENERATE, "--path", "ckpt/checkpoint_best.pt"], 1,
                 "fairseq-generate: error: --path ckpt/checkpoint_best.pt: no such file (no folder ckpt); give a "
                 "checkpoint fairseq-train wrote (e.g. SAVE_DIR/checkpoint_best.pt)", id="missing checkpoint folder"),
    pytest.param([*GENERATE, "--path", "checkpoint_best.pt", "--gen-subset", "tset"], 1,
                 "fairseq-generate: error: --gen-subset tset: no such split in data (did you mean test?); it has "
                 "test, train, valid", id="missing split"),
    pytest.param(["fairseq-generate", "other", *GENERATE[2:], "--path", "checkpoint_best.pt"], 1,
                 "fairseq-generate: error: the checkpoint was trained with other dictionaries (embedding rows: source "
                 "24, target 24; the data directory's dict.*.txt make source 96, target 96): give the data directory "
                 "it was trained on, or binarize with its dictionaries (fairseq-preprocess --srcdict/--tgtdict)",
                 id="data with other dictionaries"),
    pytest.param(["fairseq-generate", "twice", *GENERATE[2:], "--path", "checkpoint_best.pt"], 1,
                 "fairseq-generate: error: a dictionary fairseq read: Duplicate word found when loading Dictionary: "
                 "'s2'. Duplicate words can overwrite earlier ones by adding the #fairseq:overwrite flag at the end "
                 "of the corresponding row in the dictionary file. If using the Camembert model, please download an "
                 "updated copy of the model file; give the dictionaries fairseq-preprocess wrote for this data",
                 id="a word twice in a dictionary"),
    pytest.param(["fairseq-interactive", *GENERATE[1:], "--path", "checkpoint_best.pt", "-s", "src", "-t", "tgt",
                  "--buffer-size", "3", "--batch-size", "3",
                  "s1 s2\n" + " ".join(["s3"] * 1100) + "\ns4\n"], 1,
                 "fairseq-interactive: error: Size of sample #1 is invalid (=(1101, 0)) since max_positions=(1024, "
                 "1024), skip this example with --skip-invalid-size-inputs-valid-test; fairseq-interactive --task "
                 "translation_lines reports such a line and translates the others", id="over-long input line"),
    pytest.param(["ea-fairseq-hydra-train", "--config-dir", CONFIGS, "--config-name", "ea_transformer_lite_iwslt1",
                  "task.data=data"], 2,
                 f"ea-fairseq-hydra-train: error: --config-name ea_transformer_lite_iwslt1: no "
                 f"ea_transformer_lite_iwslt1.yaml in {CONFIGS} (did you mean ea_transformer_lite_iwslt14?); hydra "
                 "would run fairseq's defaults instead", id="hydra config typo"),
    pytest.param(["ea-fairseq-analysis", "dump", "checkpoint_best.pt", "--data", "data", "--ids", "999",
                  "--out", "maps.npz"], 1,
                 "ea-fairseq-analysis dump: error: --ids 999: the split test has 5 sentences, ids 0..4",
                 id="dump id beyond the split"),
]


@pytest.mark.parametrize("argv, status, line", MISTAKES)
def test_a_first_hour_mistake_is_one_line(argv, status, line, workdir):
    before = sorted(os.listdir(workdir)), sorted(os.listdir(workdir / "data"))
    argv, stdin = (argv[:-1], argv[-1]) if "\n" in argv[-1] else (argv, "")
    proc = run(argv, workdir, stdin)
    assert proc.returncode == status, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert lines and lines[-1] == line, proc.stderr[-3000:]
    assert all(LOG_RECORD.match(other) for other in lines[:-1]), proc.stderr[-3000:]  # (no traceback)
    assert proc.stdout == ""
    assert (sorted(os.listdir(workdir)), sorted(os.listdir(workdir / "data"))) == before


def test_negative_control_without_the_plugin_fairseq_lists_every_arch(workdir):
    """fairseq-train's own answer to the typo: its usage and every arch's name, status 2."""
    proc = run([TRAIN[0], "data", "--arch", "transformer_lit"], workdir)
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: fairseq-train") and "'transformer_wmt_en_de_big'" in proc.stderr
    assert len(proc.stderr.splitlines()) > 50 and "did you mean" not in proc.stderr


def test_precision_fairseq_trains_on_a_cpu_is_not_refused(workdir, tmp_path):
    """--amp (its autocast turns itself off), --memory-efficient-fp16 and --fp16-no-flatten-grads
    train on a CPU in fairseq-train: not refused; and one of them, through the console script,
    trains and saves as fairseq does."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    def cfg(*flags):
        parser = options.get_training_parser()
        return convert_namespace_to_omegaconf(options.parse_args_and_arch(
            parser, ["data", "--arch", "transformer", "--optimizer", "adam", "--max-tokens", "500", *flags]))

    for flags in (["--amp"], ["--memory-efficient-fp16"], ["--fp16", "--fp16-no-flatten-grads"]):
        assert refusal(cfg("--cpu", *flags), COMMAND_LINE) is None, flags
    assert refusal(cfg("--cpu", "--fp16"), COMMAND_LINE).startswith("--fp16 needs a CUDA GPU")
    assert refusal(cfg("--cpu", "--fp16"), COMMAND_LINE, training=False) is None  # (validate, eval-lm: no trainer)
    proc = run([*TRAIN, "--save-dir", str(tmp_path / "ckpt"), "--cpu", "--amp", "--no-epoch-checkpoints"], workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "ckpt" / "checkpoint_last.pt").is_file()


def test_fairseqs_errors_the_line_cannot_say_more_about_are_left_as_they_are(workdir):
    """A split the data has (for other languages), a data folder without binarized splits, a
    message of another form: None, fairseq's traceback; the recognised ones are one line."""
    data = str(workdir / "data")
    assert errors._one_line(FileNotFoundError(f"Dataset not found: test ({data})")) is None
    assert errors._one_line(FileNotFoundError(f"Dataset not found: tset ({workdir / 'nowhere'})")) is None
    assert errors._one_line(FileNotFoundError(f"Dataset not found: tset ({REPO})")) is None
    assert errors._one_line(OSError("Model file not found (missing.pt)")) is None
    assert errors._one_line(FileNotFoundError(f"Dataset not found: tset ({data})")).startswith("tset: no such split")
