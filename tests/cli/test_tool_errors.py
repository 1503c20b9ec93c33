"""Ordinary mistakes on the plugin's command lines: each tool, through its console entry point,
ends with one line that names the argument and what to give, exit status 1, nothing written;
and ``ea-fairseq-options`` lists the options ``fairseq-train --arch X --help`` cannot."""
import os
import subprocess
import sys

import pytest

from conftest import cli
from ea_fairseq.models.hydra_config import unknown_key_message
from ea_fairseq_cli import bleu, options

GENERATE_OUTPUT = "S-0\tein Haus\nT-0\ta house\nH-0\t-0.2\ta house\nD-0\t-0.2\ta house\n"
WARM_START = [sys.executable, "-m", "ea_fairseq_cli.warm_start"]
CHECKPOINT = "give a checkpoint fairseq-train wrote (e.g. SAVE_DIR/checkpoint_best.pt)"


def run(argv, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = argv if argv[0] == sys.executable else [cli(argv[0]), *argv[1:]]  # console scripts by name
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A generate output and an empty folder, beside paths that do not exist."""
    d = tmp_path_factory.mktemp("mistakes")
    (d / "gen.out").write_text(GENERATE_OUTPUT, encoding="utf-8")
    (d / "folder").mkdir()
    return d


MISTAKES = {  # tool and mistake: the command line, the one line it prints
    "bleu missing file": (["ea-fairseq-bleu", "gen.ou", "--mode", "iwslt"],
                          "ea-fairseq-bleu: error: gen.ou: no such file; give the file fairseq-generate's output "
                          "was saved to (fairseq-generate DATA --path CKPT ... > gen.out)"),
    "bleu folder for a file": (["ea-fairseq-bleu", "folder", "--mode", "iwslt"],
                               "ea-fairseq-bleu: error: folder is a folder; give the file fairseq-generate's "
                               "output was saved to (fairseq-generate DATA --path CKPT ... > gen.out)"),
    "bleu missing --raw-ref": (["ea-fairseq-bleu", "gen.out", "--mode", "wmt", "--target-lang", "en",
                                "--raw-ref", "ref.txt"],
                               "ea-fairseq-bleu: error: ref.txt: no such file; give --raw-ref the untokenized "
                               "references, one per line"),
    "bleu --out-prefix in a missing folder": (
        ["ea-fairseq-bleu", "gen.out", "--mode", "iwslt", "--out-prefix", "evl/test"],
        "ea-fairseq-bleu: error: --out-prefix evl/test: the folder {cwd}/evl does not exist; create it "
        "(mkdir -p {cwd}/evl) or give a path in an existing folder"),
    "analysis dump missing checkpoint": (["ea-fairseq-analysis", "dump", "checkpoint_bset.pt", "--out", "a.npz"],
                                         f"ea-fairseq-analysis dump: error: checkpoint_bset.pt: no such file; {CHECKPOINT}"),
    "analysis dump missing --data": (["ea-fairseq-analysis", "dump", "gen.out", "--data", "data-bn", "--out", "a.npz"],
                                     "ea-fairseq-analysis dump: error: data-bn: no such folder; give --data the data "
                                     "directory with the model's dictionaries (dict.*.txt)"),
    "analysis metrics missing checkpoint": (["ea-fairseq-analysis", "metrics", "gen.out", "ckpt.pt", "--out", "m"],
                                            f"ea-fairseq-analysis metrics: error: ckpt.pt: no such file; {CHECKPOINT}"),
    "analysis plot missing dump": (["ea-fairseq-analysis", "plot", "maps", "a.npz", "--out-dir", "figs"],
                                   "ea-fairseq-analysis plot maps: error: a.npz: no such file; give a dump that "
                                   "ea-fairseq-analysis dump wrote (its .npz)"),
    "analysis plot missing log": (["ea-fairseq-analysis", "plot", "curves", "train.lg", "--out", "c.png"],
                                  "ea-fairseq-analysis plot curves: error: train.lg: no such file; give a "
                                  "fairseq-train log (train.sh writes SAVE_DIR/train.log)"),
    "analysis flops missing checkpoint": (["ea-fairseq-analysis", "flops", "--checkpoint", "c.pt"],
                                          f"ea-fairseq-analysis flops: error: c.pt: no such file; {CHECKPOINT}"),
    "average --output in a missing folder": (
        ["ea-fairseq-average-checkpoints", "--inputs", "gen.out", "--output", "avg/avg.pt"],
        "average_checkpoints: error: --output avg/avg.pt: the folder {cwd}/avg does not exist; create it "
        "(mkdir -p {cwd}/avg) or give a path in an existing folder"),
    "compare missing run": (["ea-fairseq-compare", "runs/base", "runs/ea"],
                            "ea-fairseq-compare: no test.*.scores.json under runs/base/eval or runs/base/seed*/eval: "
                            "score it with examples/translation/evaluate.sh first"),
    "warm start missing checkpoint": (
        [*WARM_START, "vanilla.pt", "--arch", "ea_transformer_lite", "--output", "ea.pt"],
        "warm_start: error: vanilla.pt: no such file; give the checkpoint of a vanilla fairseq transformer "
        "(e.g. SAVE_DIR/checkpoint_best.pt)"),
    "warm start --output under a file": (  # (a missing folder is made: test_warm_start_command.py)
        [*WARM_START, "gen.out", "--arch", "ea_transformer_lite", "--output", "gen.out/ws/ea.pt"],
        "warm_start: error: --output gen.out/ws/ea.pt: {cwd}/gen.out is not a folder; give a path in a folder"),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_mistake_is_one_line_that_says_what_to_do(mistake, workdir):
    argv, line = MISTAKES[mistake]
    before = sorted(os.listdir(workdir))
    proc = run(argv, workdir)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [line.format(cwd=workdir)], proc.stderr[-2000:]
    assert proc.stdout == "" and sorted(os.listdir(workdir)) == before


def test_negative_control_without_the_checks_the_readers_raise(tmp_path):
    """The readers the checks stand in front of raise (a traceback on the command line), and a
    valid command line still scores and writes its files."""
    with pytest.raises(FileNotFoundError):
        bleu.parse_generate(str(tmp_path / "gen.ou"))
    (tmp_path / "gen.out").write_text(GENERATE_OUTPUT, encoding="utf-8")
    with pytest.raises(FileNotFoundError):
        bleu._write(str(tmp_path / "evl" / "test.hyp.tok"), ["a house"])
    (tmp_path / "evl").mkdir()
    assert bleu.main([str(tmp_path / "gen.out"), "--mode", "iwslt", "--out-prefix", str(tmp_path / "evl" / "test")]) == 0
    assert (tmp_path / "evl" / "test.scores.json").is_file()


# ------------------------------------------------------------------ ea-fairseq-options
def test_options_lists_an_archs_options_with_the_values_fairseq_train_uses(tmp_path):
    """Through the console script: the plugin's options first, then fairseq's, each with the
    value fairseq-train takes for the arch and the options given; the hydra refusal of an
    unknown model key names this command."""
    proc = run(["ea-fairseq-options", "ea_transformer_lite", "--ea-beta", "0.3"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    plugin, fairseq_part = out.split("fairseq's transformer options:")
    assert "the plugin's options of --arch ea_transformer_lite:" in plugin
    for option, value in (("--ea-alpha", "0.1"), ("--ea-beta", "0.3"), ("--encoder-attention", "ea"),
                          ("--hcsa-normalize", None), ("--ea-no-encoder-conv", "off")):
        block = plugin.split(f"  {option}")[1].split("\n  --")[0]
        assert value is None or f"[{value}]" in " ".join(block.split()), (option, block)
    assert "--encoder-layers" in fairseq_part and "--ea-alpha" not in fairseq_part
    assert "[160]" in " ".join(fairseq_part.split("--encoder-ffn-embed-dim")[1].split("\n  --")[0].split())
    assert "`ea-fairseq-options ea_transformer_lite` lists them" in unknown_key_message(
        "ea_alpah", "ea_transformer_lite", {"ea_alpha"})


def test_options_refusals_and_the_whole_help(capsys):
    """In-process (the console script is the same main): a typo, a value and an unknown arch
    are one line; ``--all`` is fairseq-train's whole help with the arch's, the task's and the
    criterion's options, which fairseq-train's own --help lacks (the negative control)."""
    with pytest.raises(SystemExit, match=r"^ea-fairseq-options: error: not options of fairseq-train --arch "
                                         r"ea_transformer_lite: --ea-alpah 0\.3 \(did you mean --ea-alpha\?\)$"):
        options.main(["ea_transformer_lite", "--ea-alpah", "0.3"])
    with pytest.raises(SystemExit, match=r"^ea-fairseq-options: error: 'ea_transformer_lit' is not an "
                                         r"architecture \(did you mean ea_transformer_lite\?\)"):
        options.main(["ea_transformer_lit"])
    with pytest.raises(SystemExit, match=r"^ea-fairseq-options: error: argument --ea-alpha: invalid float value"):
        options.main(["ea_transformer_lite", "--ea-alpha", "x"])
    assert options.main(["ea_transformer_lite", "--all", "--criterion", "label_smoothed_cross_entropy"]) == 0
    whole = capsys.readouterr().out
    assert whole.startswith("usage: fairseq-train")
    wanted = ("--ea-alpha", "--hcsa-normalize", "--encoder-layers", "--eval-bleu", "--label-smoothing")
    assert all(f"{o} " in whole for o in wanted)
    assert options.main([]) == 0 and "  ea_transformer_lite\n" in capsys.readouterr().out
    # the arch as fairseq-train takes it (--arch X, -a X, --arch=X) lists the same
    options.main(["ea_transformer_lite"])
    listing = capsys.readouterr().out
    for written in (["--arch", "ea_transformer_lite"], ["-a", "ea_transformer_lite"], ["--arch=ea_transformer_lite"]):
        assert options.main(written) == 0 and capsys.readouterr().out == listing
    with pytest.raises(SystemExit, match=r"^ea-fairseq-options: error: two architectures, 'ran_d' and --arch "
                                         r"'ea_transformer_lite': give one$"):
        options.main(["ran_d", "--arch", "ea_transformer_lite"])

    from fairseq import options as fairseq_options

    parser = fairseq_options.get_training_parser()
    with pytest.raises(SystemExit):
        fairseq_options.parse_args_and_arch(parser, ["--arch", "ea_transformer_lite", "--help",
                                                     "--criterion", "label_smoothed_cross_entropy"])
    fairseq_help = capsys.readouterr().out
    assert fairseq_help.startswith("usage: ") and not any(f"{o} " in fairseq_help for o in wanted)


def test_options_show_and_explain_a_ran_decoders_encoder_decoder_attention(capsys):
    """ran_d_lite's --cross-attention is dot_product, and its help says what that is beside
    vanilla (the same attention and parameters; fairseq's module or the plugin's path)."""
    assert options.main(["ran_d_lite"]) == 0
    block = " ".join(capsys.readouterr().out.split("  --cross-attention")[1].split("\n  --")[0].split())
    assert block.endswith("[dot_product]"), block
    assert "vanilla: fairseq's module" in block and "dot_product: the same attention" in block, block
