"""``ea-fairseq-warm-start`` (``python -m ea_fairseq_cli.warm_start``): the fine-tuning
command it prints reads back, in a shell, as the very words it stands for (hostile file names
included), its output never goes through a planted link, a missing output folder is made, and
``--help`` answers without importing torch or fairseq."""
import os
import shlex
import subprocess
import sys

import pytest

from conftest import REPO
from support.trained_checkpoints import ENV, family_checkpoints

HOSTILE = "a b;$(touch PWNED)`touch PWNED2`'q\"x\\y&|<>*?~#!{c,d}\n$HOME.pt"


def shell_words(command: str, cwd, check=True) -> list:
    """What bash hands a program for ``command`` (its first word swapped for printf)."""
    program, rest = command.split(" ", 1)
    assert program == "fairseq-train"
    out = subprocess.run(["bash", "-c", "printf '%s\\0' " + rest], cwd=cwd, capture_output=True, check=check).stdout
    return [program] + out.decode().split("\0")[:-1]


def test_printed_command_reads_back_as_its_words(tmp_path, tmp_path_factory, tiny_data_bin):
    vanilla = family_checkpoints(tmp_path_factory, tiny_data_bin)["vanilla"]
    out = tmp_path / HOSTILE
    victim = tmp_path / "victim.pt"
    victim.write_bytes(b"keep")
    os.symlink(victim, str(out) + ".tmp")  # the name a naive writer would use
    proc = subprocess.run([sys.executable, "-m", "ea_fairseq_cli.warm_start", str(vanilla), "--arch",
                           "ea_transformer_lite", "--output", str(out), "--ea-alpha", "0.5"],
                          capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    command = proc.stdout.split("fine-tune it with:\n  ", 1)[1].rstrip("\n")
    words = shlex.split(command)
    assert words[:6] == ["fairseq-train", "DATA", "--user-dir", "ea_fairseq", "--arch", "ea_transformer_lite"]
    assert words[-3:] == ["--finetune-from-model", str(out), "..."]
    assert words[words.index("--ea-alpha") + 1] == "0.5"
    assert shell_words(command, tmp_path) == words  # bash reads it as shlex does
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "PWNED2").exists()
    assert out.stat().st_size > 0 and victim.read_bytes() == b"keep"
    assert os.path.islink(str(out) + ".tmp")  # left alone, not followed
    assert sorted(os.listdir(tmp_path)) == sorted([out.name, out.name + ".tmp", "victim.pt"])

    # negative control: such words joined unquoted run the payload in a shell
    shell_words(" ".join(words[:-2] + [str(tmp_path / "a b;$(touch PWNED)`touch PWNED2`.pt")]), tmp_path, check=False)
    assert (tmp_path / "PWNED").exists() and (tmp_path / "PWNED2").exists()


@pytest.mark.parametrize("module", ["ea_fairseq_cli.warm_start"])
def test_help_does_not_import_torch(module):
    def imported(*argv):
        proc = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True,
                              env=ENV, cwd=REPO, timeout=300)
        names = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
        return proc, names

    proc, names = imported("-m", module, "--help")
    assert proc.returncode == 0 and "--arch" in proc.stdout
    assert not {"torch", "fairseq", "numpy"} & names
    _, names = imported("-c", "import ea_fairseq")  # negative control: the package loads fairseq
    assert {"torch", "fairseq"} <= names


def test_a_missing_output_folder_is_made_once_there_is_a_model_to_write(tmp_path, capsys):
    """``--output`` in folders that do not exist yet: they are made, parents included, when the
    checkpoint is written; a warm start refused before that leaves no folder behind."""
    from ea_fairseq_cli.warm_start import main

    vanilla = os.path.join(REPO, "tests", "fixtures", "checkpoints", "vanilla", "checkpoint.pt")
    refused = tmp_path / "refused" / "ea.pt"
    assert main([vanilla, "--arch", "ea_transformer_lite", "--encoder-layers", "3", "--output", str(refused)]) == 1
    assert "the dimensions differ" in capsys.readouterr().err and os.listdir(tmp_path) == []
    out = tmp_path / "runs" / "ea_warm" / "init.pt"
    assert main([vanilla, "--arch", "ea_transformer_lite", "--output", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out and out.stat().st_size > 0
