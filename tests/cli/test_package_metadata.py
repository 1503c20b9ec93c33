"""What a newcomer expects of the package: every console tool answers ``--version`` with the
plugin's version (and fairseq's and torch's) and exits 0, without importing fairseq or torch;
the license, changelog and citation file agree with the package's metadata."""
import importlib
import os
import subprocess
import sys
import tomllib

import fairseq
import pytest
import torch
import yaml

import ea_fairseq
from conftest import REPO

with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    PROJECT = tomllib.load(f)["project"]
SCRIPTS = PROJECT["scripts"]


def test_every_tool_is_a_console_script():
    assert set(SCRIPTS) == {"ea-fairseq-average-checkpoints", "ea-fairseq-bleu", "ea-fairseq-compare",
                            "ea-fairseq-analysis", "ea-fairseq-options", "ea-fairseq-hydra-train",
                            "ea-fairseq-warm-start"}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_version(name, monkeypatch, capsys):
    """The console script's function as its wrapper calls it (``sys.argv``, no arguments)."""
    module, function = SCRIPTS[name].split(":")
    main = getattr(importlib.import_module(module), function)
    monkeypatch.setattr(sys, "argv", [name, "--version"])
    with pytest.raises(SystemExit) as stop:
        main()
    assert stop.value.code == 0
    line = f"{name} {ea_fairseq.__version__} (fairseq {fairseq.__version__}, torch {torch.__version__}"
    assert capsys.readouterr().out.startswith(line)  # (ea-fairseq-hydra-train: hydra's after them)


def test_version_imports_neither_fairseq_nor_torch():
    """Where neither can be imported (the metric tools' COMET environment), the version is read
    from the plugin's source without loading it. ``ea-fairseq-options --version`` listed the
    architectures: its unknown words go to fairseq-train, which ignores them without an arch."""
    code = ("import sys\nsys.modules['fairseq'] = sys.modules['torch'] = None\n"
            "from ea_fairseq_cli import options\n"
            "try:\n    options.main(['--version'])\nexcept SystemExit as stop:\n    print(stop.code)\n"
            "print('ea_fairseq' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.stdout.splitlines() == [
        f"ea-fairseq-options {ea_fairseq.__version__} (fairseq {fairseq.__version__}, torch {torch.__version__})",
        "0", "False"], proc.stderr[-2000:]


def test_license_changelog_and_citation_agree_with_the_package():
    with open(os.path.join(REPO, "LICENSE"), encoding="utf-8") as f:
        license_text = f.read()
    assert license_text.startswith("MIT License") and PROJECT["license"] == "MIT"
    with open(os.path.join(REPO, "CHANGELOG.md"), encoding="utf-8") as f:
        assert f"\n## [{ea_fairseq.__version__}] - " in f.read()
    with open(os.path.join(REPO, "CITATION.cff"), encoding="utf-8") as f:
        citation = yaml.safe_load(f)
    assert citation["cff-version"] == "1.2.0" and citation["type"] == "software"
    assert citation["version"] == ea_fairseq.__version__ and citation["license"] == "MIT"
    titles = [reference["title"] for reference in citation["references"]]
    assert [t.split(":")[0].split(" ")[0] for t in titles] == ["Evolving", "Predictive", "Recurrent", "DropAttention"]
    assert all(reference["authors"] for reference in citation["references"])
