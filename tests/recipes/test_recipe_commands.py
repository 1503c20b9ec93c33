"""Commands the recipes print for the user to paste are quoted: a shell reads train.sh's
"evaluate with:" line (also kept in SAVE_DIR/train.settings and reused for SEEDS) back as the
words it names, whatever the paths hold, and runs nothing in them."""
import subprocess

import pytest

from test_recipes import RECIPES, env, run  # noqa: F401  (fixture)

# a folder name holding a space, both quotes, a command substitution, ; and a glob
HOSTILE = "d a't\"a $(touch pwned); `touch pwned` *"


def read_back(printed: str, cwd) -> list:
    """The words bash reads from ``printed`` (as if pasted): ``eval set -- ...``."""
    proc = subprocess.run(["bash", "-c", 'eval "set -- $1"; printf "%s\\0" "$@"', "_", printed],
                          cwd=cwd, capture_output=True, text=True)
    return proc.stdout.split("\0")[:-1]


def own_data(root):
    data = root / f"data {HOSTILE}"
    data.mkdir(parents=True)
    for name in ("train.xx-yy.xx.idx", "train.xx-yy.yy.idx", "dict.xx.txt", "dict.yy.txt"):
        (data / name).write_text("a 1\n")
    return data


def _hint(stderr: str, prefix: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, stderr
    return lines[0][len(prefix):]


def test_the_evaluate_line_reads_back_as_its_words(env, tmp_path):  # noqa: F811
    data, save = own_data(tmp_path), tmp_path / f"save {HOSTILE}"
    dry = dict(env, DRY_RUN="1", PYTHON="true", DATA=str(data), SAVE_DIR=str(save))
    proc = run(["bash", RECIPES / "train.sh", "ea_lite", "own"], dry, tmp_path)
    hint = _hint(proc.stderr, "[train] evaluate with: ")
    words = ["bash", "examples/translation/evaluate.sh", str(save), str(data), "wmt"]
    marker = tmp_path / "pwned"
    assert read_back(hint, tmp_path) == words and not marker.exists()
    # negative control: words pasted unquoted (as "evaluate.sh $SAVE_DIR $DATA $mode") split, and
    # a command in them runs
    plain = ["bash", "examples/translation/evaluate.sh", str(tmp_path / "s $(touch pwned); x"), "d", "wmt"]
    assert read_back(" ".join(plain), tmp_path) != plain and marker.exists()
    marker.unlink()

    # SEEDS: the line for the directory of all seeds, from the last seed's train.settings
    seed = save / "seed2"
    proc = run(["bash", RECIPES / "train.sh", "ea_lite", "own"], dict(dry, SAVE_DIR=str(seed)), tmp_path)
    seed_hint = _hint(proc.stderr, "[train] evaluate with: ")
    seed.mkdir(parents=True)
    (seed / "train.settings").write_text(f"# evaluate with: {seed_hint}\nfamily=ea_lite\n")
    proc = run(["bash", RECIPES / "train.sh", "ea_lite", "own"], dict(dry, SEEDS="2"), tmp_path)
    all_seeds = _hint(proc.stderr, "[train] evaluate every seed (mean ± std) with: ")
    assert read_back(all_seeds, tmp_path) == words and not marker.exists()


@pytest.mark.parametrize("name", ["plain", "tab\tand\nnewline", "ünïcode ☃", "-dash", "$HOME", "a\\b"])
def test_other_names_read_back_too(env, tmp_path, name):  # noqa: F811
    data, save = own_data(tmp_path), tmp_path / (name if name == "plain" else f"s {name}")
    proc = run(["bash", RECIPES / "train.sh", "ea_lite", "own"],
               dict(env, DRY_RUN="1", PYTHON="true", DATA=str(data), SAVE_DIR=str(save)), tmp_path)
    hint = _hint(proc.stderr, "[train] evaluate with: ")
    assert read_back(hint, tmp_path)[2] == str(save)
    if name == "plain":
        assert f"evaluate.sh {save} " in hint  # a plain path shown as it is


def test_evaluate_sh_s_checkpoint_hint_reads_back_too(env, tmp_path):  # noqa: F811
    """evaluate.sh on a run that saved only checkpoint_last.pt names it as an option to paste."""
    data, run_dir = tmp_path / "data", tmp_path / "run $(touch pwned); x"
    data.mkdir()
    run_dir.mkdir()
    for name in ("test.de-en.de.idx", "test.de-en.en.idx"):
        (data / name).write_text("")
    (run_dir / "checkpoint_last.pt").write_bytes(b"")
    proc = run(["bash", RECIPES / "evaluate.sh", run_dir, data, "iwslt", "--cpu"], env, tmp_path, check=False)
    hint = proc.stderr.rsplit("evaluate with ", 1)[-1].strip()
    assert proc.returncode == 1 and hint.startswith("--checkpoint "), proc.stderr
    assert read_back(hint, tmp_path) == ["--checkpoint", str(run_dir / "checkpoint_last.pt")]
    assert not (tmp_path / "pwned").exists()
