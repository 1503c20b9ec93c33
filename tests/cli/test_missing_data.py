"""The quickstart run before its data is prepared, or with another pair's languages: fairseq's
FileNotFoundError (its callers see that type) with a message that says what to give, printed by
fairseq-train as one line; through fairseq-train's entry point."""
import os
import subprocess
import sys

import pytest

from conftest import REPO, cli
from ea_fairseq.safety.data_files import MissingDataFile

TRAIN = ["--user-dir", "ea_fairseq", "--arch", "transformer", "--optimizer", "adam", "--lr", "0.001",
         "--max-tokens", "300", "--cpu", "--no-save"]


def fairseq_train(monkeypatch, tmp_path, data, *options):
    from fairseq_cli.train import cli_main

    monkeypatch.setattr(sys, "argv", ["fairseq-train", str(data), *TRAIN, "--save-dir", str(tmp_path), *options])
    with pytest.raises(FileNotFoundError) as raised:
        cli_main()
    return raised


def test_a_data_directory_that_is_not_there(monkeypatch, tmp_path):
    raised = fairseq_train(monkeypatch, tmp_path, tmp_path / "data-bin" / "iwslt14.tokenized.de-en")
    assert raised.type is MissingDataFile and str(raised.value) == (
        f"{tmp_path}/data-bin/iwslt14.tokenized.de-en: no such data directory: give the directory "
        "fairseq-preprocess wrote (its --destdir), e.g. data-bin/NAME of the recipes' "
        "examples/translation/prepare-*.sh")
    # with the languages given, fairseq opens the dictionary first: the same answer
    raised = fairseq_train(monkeypatch, tmp_path, tmp_path / "nothere", "--source-lang", "de", "--target-lang", "en")
    assert raised.type is MissingDataFile and str(raised.value).startswith(f"{tmp_path}/nothere: no such data directory")


def test_languages_the_data_does_not_have(monkeypatch, tmp_path, tiny_data_bin):
    raised = fairseq_train(monkeypatch, tmp_path, tiny_data_bin, "--source-lang", "de", "--target-lang", "en")
    assert raised.type is MissingDataFile and str(raised.value) == (
        f"{tiny_data_bin}/dict.de.txt: no such dictionary: the languages of {tiny_data_bin} are src, tgt: give them "
        "as --source-lang/--target-lang (source_lang=/target_lang= in the hub)")


def test_fairseq_train_prints_it_as_one_line(tmp_path):
    missing = tmp_path / "data-bin" / "x"
    proc = subprocess.run([cli("fairseq-train"), str(missing), *TRAIN, "--save-dir", str(tmp_path / "ck")],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 1 and proc.stderr.splitlines() == [
        f"fairseq-train: error: {missing}: no such data directory: give the directory fairseq-preprocess wrote "
        "(its --destdir), e.g. data-bin/NAME of the recipes' examples/translation/prepare-*.sh"], proc.stderr
