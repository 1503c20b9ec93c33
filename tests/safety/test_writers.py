"""Principle 4, every writer is safe (:mod:`ea_fairseq.safety.writers`): what fairseq-train, the
plugin's tools and the recipes write into a directory goes to a new file renamed into place, so
a link someone planted there under an output's name is replaced, never written through. Each
attack plants links to files outside the directory; each negative control shows the same
write without the plugin's writer going through them."""
import os
import subprocess

import pytest
from fairseq import checkpoint_utils, distributed_utils, options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq_cli import train

from ea_fairseq import side_effects

from conftest import cli
from support.recipe_support import RECIPES, env, run as recipe_run  # noqa: F401  (fixture)
from support.trained_checkpoints import USER_DIR

pytestmark = pytest.mark.usefixtures("one_thread")
OUTSIDE = b"an outside file: not the run's to write\n"
TINY = ["--arch", "transformer", "--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16",
        "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "16", "--decoder-ffn-embed-dim", "16",
        "--encoder-attention-heads", "2", "--decoder-attention-heads", "2", "--share-all-embeddings"]
#: what fairseq-train writes in the save dir when it resumes at update 1 and saves at update 2:
#: the directory probe, the first checkpoint's temporary file, a copy of it
WRITTEN = ("dummy", "checkpoint_1_2.pt.tmp", "checkpoint_best.pt")
#: the rows that make fairseq's checkpoint writes the plugin's
ROWS = ("fairseq.checkpoint_utils:PathManager", "fairseq.checkpoint_utils:verify_checkpoint_directory")


def plant(directory, names, outside):
    """A link under each name in ``directory`` to a file of its own in ``outside``."""
    outside.mkdir(exist_ok=True)
    for name in names:
        (outside / name).write_bytes(OUTSIDE)
        os.symlink(outside / name, directory / name)


def overwritten(outside, names):
    return [name for name in names if (outside / name).read_bytes() != OUTSIDE]


def fairseq_train(data, save, *extra):
    """fairseq-train's main on this command line, parsed and converted as the command does."""
    args = options.parse_args_and_arch(options.get_training_parser(), [
        data, "--user-dir", USER_DIR, *TINY, "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "200",
        "--save-dir", str(save), "--no-epoch-checkpoints", "--cpu", "--num-workers", "0", "--no-progress-bar",
        "--seed", "3", *extra])
    if hasattr(checkpoint_utils.save_checkpoint, "best"):  # fairseq keeps the best loss on the function
        del checkpoint_utils.save_checkpoint.best
    distributed_utils.call_main(convert_namespace_to_omegaconf(args), train.main)


@pytest.fixture(scope="module")
def resumable(tmp_path_factory, tiny_data_bin):
    """checkpoint_last.pt of one update: what a received save dir holds to resume from."""
    save = tmp_path_factory.mktemp("first-run")
    fairseq_train(tiny_data_bin, save, "--max-update", "1", "--disable-validation")
    return (save / "checkpoint_last.pt").read_bytes()


def resume_in_received_save_dir(tiny_data_bin, resumable, tmp_path):
    save = tmp_path / "received"
    save.mkdir()
    (save / "checkpoint_last.pt").write_bytes(resumable)
    plant(save, WRITTEN, tmp_path / "outside")
    fairseq_train(tiny_data_bin, save, "--max-update", "2", "--save-interval-updates", "2")
    return save


def test_fairseq_train_resuming_in_a_received_save_dir_writes_through_no_link(tiny_data_bin, resumable, tmp_path):
    save = resume_in_received_save_dir(tiny_data_bin, resumable, tmp_path)
    assert overwritten(tmp_path / "outside", WRITTEN) == []
    for name in ("checkpoint_1_2.pt", "checkpoint_best.pt", "checkpoint_last.pt"):
        assert not (save / name).is_symlink() and (save / name).is_file()
        assert checkpoint_utils.load_checkpoint_to_cpu(str(save / name))["optimizer_history"][-1]["num_updates"] == 2
    assert not os.path.lexists(save / "checkpoint_1_2.pt.tmp")  # renamed into place
    assert sorted(p.name for p in save.iterdir() if p.name.endswith(".tmp")) == []


def test_negative_control_fairseqs_own_saver_writes_through_the_links(tiny_data_bin, resumable, tmp_path):
    with pytest.MonkeyPatch.context() as patch:
        for row in ROWS:
            owner, attribute = side_effects._owner(row)
            patch.setattr(owner, attribute, side_effects.original(row))
        resume_in_received_save_dir(tiny_data_bin, resumable, tmp_path)
    assert overwritten(tmp_path / "outside", WRITTEN) == list(WRITTEN)


@pytest.mark.parametrize("plugin", [True, False])
def test_fairseq_commands_write_their_named_outputs_through_no_link(tiny_data_bin, resumable, tmp_path, plugin):
    """fairseq-train's ``--log-file`` (appended to) and fairseq-generate's ``--results-path``
    output (truncated), through their console scripts, links planted under both names; the
    negative control (``plugin=False``: plain fairseq, its checkpoint read by pickle) writes
    through them."""
    received = tmp_path / "received"
    received.mkdir()
    (received / "checkpoint_last.pt").write_bytes(resumable)
    names = ("train.log", "generate-test.txt")
    plant(received, names, tmp_path / "outside")
    user_dir = ["--user-dir", USER_DIR] if plugin else []
    environ = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="0" if plugin else "1")
    common = ["--cpu", "--num-workers", "0", "--no-progress-bar", *user_dir]
    subprocess.run([cli("fairseq-train"), tiny_data_bin, *TINY, "--optimizer", "adam", "--lr", "1e-3",
                    "--max-tokens", "200", "--max-update", "2", "--disable-validation", "--save-dir", received,
                    "--no-save", "--log-file", received / names[0], *common,
                    "--data-buffer-size", "0"],  # plain fairseq's prefetch thread may abort its exit
                   env=environ, check=True, capture_output=True)
    subprocess.run([cli("fairseq-generate"), tiny_data_bin, "--path", received / "checkpoint_last.pt", "--beam", "2",
                    "--max-len-b", "4", "--results-path", received, "--required-batch-size-multiple", "1", *common],
                   env=environ, check=True, capture_output=True)
    assert overwritten(tmp_path / "outside", names) == ([] if plugin else list(names))
    if plugin:
        assert not any((received / name).is_symlink() for name in names)
        assert "done training" in (received / names[0]).read_text()
        assert (received / names[1]).read_text().count("\nH-") == 24


@pytest.mark.parametrize("async_write", [False, True])
def test_fairseqs_checkpoint_save_and_copy_replace_links(tmp_path, async_write):
    """``torch_persistent_save`` (its asynchronous mode too: on a local path the plugin writes
    synchronously, where fairseq needs iopath) and ``PathManager.copy`` as fairseq's
    ``save_checkpoint`` calls them, links planted at every name they write."""
    names = ("checkpoint_last.pt", "checkpoint_last.pt.tmp", "checkpoint_best.pt")
    plant(tmp_path, names, tmp_path / "outside")
    last, best = str(tmp_path / names[0]), str(tmp_path / names[2])
    checkpoint_utils.torch_persistent_save({"model": {}}, last, async_write=async_write)
    assert checkpoint_utils.PathManager.copy(last, best, overwrite=True)
    assert overwritten(tmp_path / "outside", names) == []
    assert [(tmp_path / name).is_symlink() for name in names[::2]] == [False, False]
    assert (tmp_path / names[0]).read_bytes() == (tmp_path / names[2]).read_bytes()
    assert not checkpoint_utils.PathManager.copy(last, best)  # fairseq's (iopath's) overwrite=False
    left = ["checkpoint_best.pt", "checkpoint_last.pt", *["checkpoint_last.pt.tmp"] * async_write, "outside"]
    assert sorted(os.listdir(tmp_path)) == left  # the synchronous .tmp renamed onto the checkpoint; no other file


def test_evaluate_sh_writes_its_outputs_through_no_link(env, resumable, tiny_data_bin, tmp_path):
    """evaluate.sh's fairseq-generate output and log and its scores, in a received checkpoint
    directory's eval/ where links were planted under their names."""
    received = tmp_path / "received"
    (received / "eval").mkdir(parents=True)
    (received / "checkpoint_last.pt").write_bytes(resumable)
    names = ("generate-test.src-tgt.txt", "generate-test.src-tgt.log", "bleu-test.src-tgt.txt")
    plant(received / "eval", names, tmp_path / "outside")
    proc = recipe_run(["bash", RECIPES / "evaluate.sh", received, tiny_data_bin, "iwslt", "--checkpoint",
                       received / "checkpoint_last.pt", "--cpu", "--", "--max-len-a", "0", "--max-len-b", "4"],
                      env, cwd=tmp_path)
    assert overwritten(tmp_path / "outside", names) == []
    assert "BLEU" in proc.stdout and proc.stdout == (received / "eval" / names[2]).read_text()
    for name in names:
        assert not (received / "eval" / name).is_symlink() and (received / "eval" / name).is_file()
    assert (received / "eval" / names[0]).read_text().count("\nH-") == 24


def test_train_sh_writes_its_records_through_no_link(env, tmp_path):
    """train.sh's train.settings and train.command and the data's subword model, in a received
    SAVE_DIR (fairseq-train itself: ``true`` here; its train.log is fairseq-train's, above)."""
    data = tmp_path / "own"
    data.mkdir()
    for name in ("train.xx-yy.xx.idx", "train.xx-yy.yy.idx", "dict.xx.txt", "dict.yy.txt", "code"):
        (data / name).write_text("a 1\n")
    save = tmp_path / "received"
    save.mkdir()
    (save / "train.command").write_text("# an earlier run\n")
    plant(save, ("train.settings", "code"), tmp_path / "outside")
    train = dict(env, DATA=str(data), SAVE_DIR=str(save), CPU="1", FAIRSEQ_TRAIN="true")
    recipe_run(["bash", RECIPES / "train.sh", "pa_lite", "own"], train, tmp_path)
    assert overwritten(tmp_path / "outside", ("train.settings", "code")) == []
    assert not any((save / name).is_symlink() for name in ("train.settings", "code", "train.command"))
    assert (save / "code").read_text() == "a 1\n"
    assert "--arch pa_transformer_lite" in (save / "train.settings").read_text()
    command = (save / "train.command").read_text()
    assert command.startswith("# an earlier run\n# ") and command.count("--log-file") == 1  # appended
    os.replace(save / "train.command", tmp_path / "train.command")  # a link where train.sh appends: refused
    plant(save, ("train.command",), tmp_path / "outside")
    proc = recipe_run(["bash", RECIPES / "train.sh", "pa_lite", "own"], train, tmp_path, check=False)
    assert proc.returncode == 1 and overwritten(tmp_path / "outside", ("train.command",)) == []
    assert proc.stderr.strip().endswith(f"safe_write.py: error: {save}/train.command: a link: not appended to")


def test_negative_control_a_plain_redirection_writes_through_the_links(tmp_path):
    """What the recipes did: ``> FILE`` and ``>> FILE`` write through a link under FILE's name."""
    plant(tmp_path, ("generate-test.src-tgt.txt", "train.command"), tmp_path / "outside")
    subprocess.run(["bash", "-c", 'echo plain > "$1"; echo plain >> "$2"', "_", *(
        tmp_path / name for name in ("generate-test.src-tgt.txt", "train.command"))], check=True)
    assert overwritten(tmp_path / "outside", ("generate-test.src-tgt.txt", "train.command")) == [
        "generate-test.src-tgt.txt", "train.command"]
