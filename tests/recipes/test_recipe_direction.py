"""The recipes' one reading of a binarized directory's direction (common.sh ea_direction), as
train.sh and evaluate.sh call it: the one direction, or a one-line refusal."""
import subprocess

import pytest

from conftest import REPO

COMMON = f"{REPO}/examples/translation/common.sh"


def direction(data, subset="train"):
    script = (f'EA_NAME=t; source "{COMMON}"; die() {{ echo "error: $*" >&2; exit 1; }}; '
              f'ea_direction "$1" "$2" "SRC=.. TGT=.."; printf "%s|%s" "$ea_src" "$ea_tgt"')
    return subprocess.run(["bash", "-c", script, "direction", str(data), subset],
                          capture_output=True, text=True)


def files(tmp_path, *names):
    for n in names:
        (tmp_path / n).write_bytes(b"")
    return tmp_path


def test_one_direction_is_read_from_the_index_files(tmp_path):
    done = direction(files(tmp_path, "train.de-en.de.idx", "train.de-en.en.idx", "valid.xx-yy.xx.idx"))
    assert (done.returncode, done.stdout) == (0, "de|en")
    done = direction(tmp_path, "valid")
    assert (done.returncode, done.stdout) == (0, "xx|yy")
    # a language fairseq-preprocess takes with a locale modifier
    done = direction(files(tmp_path, "test.sr@latin-en.sr@latin.idx"), "test")
    assert (done.returncode, done.stdout) == (0, "sr@latin|en")


@pytest.mark.parametrize("names, message", [
    ((), "no train.SRC-TGT.SRC.idx in"),
    (("train.de-en.de.idx", "train.en-de.en.idx"), "holds several directions (de en en de): give SRC=.. TGT=.."),
    (("train.$(touch x)-en.$(touch x).idx",), "not a language code"),
    (("train.d e-en.d e.idx",), "not a language code"),
])
def test_no_or_several_directions_or_odd_names_are_refused(tmp_path, names, message):
    done = direction(files(tmp_path, *names))
    assert done.returncode == 1 and done.stdout == ""
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()
