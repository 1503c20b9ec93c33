"""Principle 2 for the checkpoint itself: a checkpoint read from a directory (a model directory
for the hub and fairseq-generate, a save dir resumed, the inputs of averaging) is read inside
that directory, links followed; a file that is not a checkpoint is reported without quoting it.
A red team linked ``model.pt`` to a checkpoint elsewhere (it loaded) and ``checkpoint_last.pt``
to a private key (the refusal printed its first 16 bytes)."""
import os
import shutil

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.models.transformer import TransformerModel

from ea_fairseq.safety.no_code import CheckpointError
from test_confined_reads import built  # noqa: F401  (fixture: a model directory, the fixtures' dictionaries)
from support.trained_checkpoints import USER_DIR

KEY = b"-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n"


@pytest.fixture
def model(built, tmp_path):  # noqa: F811
    shutil.copytree(built[0], tmp_path / "model")
    shutil.move(tmp_path / "model" / "c.pt", tmp_path / "elsewhere.pt")
    (tmp_path / "key").write_bytes(KEY)
    return tmp_path / "model"


def test_a_checkpoint_linked_out_of_its_directory_is_refused(model):
    os.symlink(model.parent / "elsewhere.pt", model / "c.pt")
    assert torch.load(model / "c.pt", weights_only=False)["model"]  # the control: the link leads to a checkpoint
    with pytest.raises(CheckpointError, match="outside"):
        checkpoint_utils.load_checkpoint_to_cpu(str(model / "c.pt"))
    with pytest.raises(CheckpointError, match="outside"):
        TransformerModel.from_pretrained(str(model), checkpoint_file="c.pt", data_name_or_path=str(model),
                                         user_dir=USER_DIR)


def test_a_link_that_stays_inside_loads(model):
    os.replace(model.parent / "elsewhere.pt", model / "checkpoint_1.pt")
    os.symlink("checkpoint_1.pt", model / "c.pt")
    assert checkpoint_utils.load_checkpoint_to_cpu(str(model / "c.pt"))["model"]


def test_a_file_that_is_not_a_checkpoint_is_not_quoted(model):
    shutil.copy(model.parent / "key", model / "c.pt")  # inside: read, found not to be a checkpoint
    with pytest.raises(CheckpointError) as refusal:
        checkpoint_utils.load_checkpoint_to_cpu(str(model / "c.pt"))
    assert "not a torch checkpoint" in str(refusal.value) and "OPENS" not in str(refusal.value)
