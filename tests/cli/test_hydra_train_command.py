"""``ea-fairseq-hydra-train`` (``python -m ea_fairseq_cli.hydra_train``): fairseq-hydra-train with the
plugin loaded first, so a recipe config with a typo prints the plugin's one line and nothing
before it; EA_FAIRSEQ_SHOW_WARNINGS=1 shows the warnings it leaves out (hydra's, printed before
fairseq-hydra-train itself loads the plugin; hydra's DEBUG lines stay out, the root logger
at its level as the plugin's import leaves it)."""
import os
import subprocess
import sys

import pytest

from conftest import REPO

CONFIG_DIR = os.path.join(REPO, "examples", "translation", "config")


def hydra_train(tmp_path, *overrides, show=""):
    env = {k: v for k, v in os.environ.items() if k != "EA_FAIRSEQ_SHOW_WARNINGS"}
    env.update(OMP_NUM_THREADS="1", EA_FAIRSEQ_SHOW_WARNINGS=show)
    return subprocess.run(
        [sys.executable, "-m", "ea_fairseq_cli.hydra_train", "--config-dir", CONFIG_DIR,
         "--config-name", "ea_transformer_lite_iwslt14", f"task.data={tmp_path}",
         f"common.user_dir={os.path.join(REPO, 'ea_fairseq')}", f"checkpoint.save_dir={tmp_path / 'ck'}",
         *overrides], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("show", ["", "1"])
def test_a_typo_is_the_only_line(show, tmp_path):
    proc = hydra_train(tmp_path, "+optimization.lrr=0.1", show=show)
    error = ("ea-fairseq-hydra-train: error: optimization.lrr: not an option of fairseq's optimization "
             "(did you mean optimization.lr?)")
    lines = proc.stderr.splitlines()
    assert proc.returncode == 1 and proc.stdout == "" and lines[-1].startswith(error), proc.stderr
    if show:  # the negative control: what fairseq-hydra-train prints before the plugin is loaded
        assert "version_base parameter is not specified" in proc.stderr
        assert "validated against ConfigStore schema" in proc.stderr
    else:
        assert len(lines) == 1, proc.stderr
    assert not (tmp_path / "ck").exists() and not (tmp_path / "outputs").exists()
