"""Values of a checkpoint that fairseq turns into file names, directories, downloads or deep
tracebacks: each refused in one line (or not taken from the file) through the real entry
points, with a negative control showing what fairseq does with it unguarded."""
import argparse
import os
import time

import pytest
import torch
from fairseq import checkpoint_utils

from conftest import cli
from ea_fairseq.safety import no_code as safety
from test_checkpoint_schema import hub, saved, trusted_state, unguarded_load, vanilla  # noqa: F401  (fixture)
from support.trained_checkpoints import USER_DIR, run, train_command

SECRET_LINE = "TOPSECRET-LINE-1 not-a-count"


def _one_line(error) -> str:
    text = str(error.value if hasattr(error, "value") else error)
    assert "\n" not in text and "Nothing in the checkpoint was run" in text, text
    return text


def _secret_beside(directory):
    """A model directory whose ``dict.x/../../secret.txt`` names a file outside it."""
    (directory / "dict.x").mkdir(parents=True)
    (directory.parent / "secret.txt").write_text(SECRET_LINE + "\n")
    return "x/../../secret"


@pytest.fixture
def dictionaries_unguarded(monkeypatch):
    """For a negative control: fairseq's own dictionary reader, without the data files' check
    (which refuses a dictionary outside its directory whatever name reached it)."""
    from fairseq.data import Dictionary

    from ea_fairseq import side_effects

    monkeypatch.setattr(Dictionary, "add_from_file",
                        side_effects.original("fairseq.data.dictionary:Dictionary.add_from_file"))


# -- languages and split names are put in file names ----------------------------------------
def test_a_language_path_reads_a_file_without_the_guard(tmp_path, vanilla, dictionaries_unguarded):  # noqa: F811
    state = trusted_state(vanilla)
    state["cfg"]["task"].update(source_lang=_secret_beside(tmp_path / "model"), target_lang="tgt",
                                data=str(tmp_path / "model"))
    path = saved(state, tmp_path / "model")
    with pytest.raises(Exception, match=SECRET_LINE.split()[0]):  # fairseq echoes the file's first line
        checkpoint_utils.load_model_ensemble_and_task([str(path)], arg_overrides={"data": str(tmp_path / "model")},
                                                      state=unguarded_load(path))


@pytest.mark.parametrize("layout", ["dict", "legacy"])
@pytest.mark.parametrize("field", ["source_lang", "target_lang"])
def test_a_language_that_leaves_the_directory_is_refused_where_it_is_opened_in_every_layout(tmp_path, vanilla, tiny_data_bin, layout, field):  # noqa: F811
    state = trusted_state(vanilla)
    hostile = _secret_beside(tmp_path / "model")
    if layout == "dict":
        state["cfg"]["task"][field] = hostile
    else:
        args = argparse.Namespace(**vars(state["cfg"]["model"]))
        args.task, args.data, args.source_lang, args.target_lang = "translation", "bin", "src", "tgt"
        setattr(args, field, hostile)
        state["args"], state["cfg"] = args, None
    saved(state, tmp_path / "model")
    with pytest.raises(Exception) as refusal:  # the file fairseq names from it is confined, not the name
        hub(tmp_path / "model", str(tmp_path / "model"))
    assert SECRET_LINE.split()[0] not in str(refusal.value)


# -- task families ---------------------------------------------------------------------------
OTHER_TASKS = {
    "hubert_pretraining": {"labels": ["s"], "label_dir": "/etc", "fine_tuning": True},
    "audio_finetuning": {"labels": "x/../../../secret"},
    "translation_lev": {"noise": "random_delete"},
    "language_modeling": {},
}


@pytest.mark.parametrize("layout", ["dict", "legacy"])
@pytest.mark.parametrize("task", sorted(OTHER_TASKS))
def test_other_task_families_load_with_their_paths_not_honoured(tmp_path, vanilla, task, layout):  # noqa: F811
    """By use, not by a list of tasks: a task's section is generated from its dataclass, and a
    field naming a file elsewhere (which the task would open when it is set up) takes its default,
    in the legacy ``args`` layout too."""
    state = trusted_state(vanilla)
    if layout == "dict":
        state["cfg"]["task"] = dict(OTHER_TASKS[task], _name=task, data=str(tmp_path))
    else:
        state["args"] = argparse.Namespace(**{**vars(state["cfg"]["model"]), **OTHER_TASKS[task], "task": task,
                                              "data": str(tmp_path)})
        state["cfg"] = None
    generated = safety.sanitize(state, "c.pt", build_check=False)["cfg"]["task"]  # (a translation model)
    assert generated["_name"] == task and generated["data"] == str(tmp_path)
    for key, value in OTHER_TASKS[task].items():
        named_elsewhere = type(value) is str and ("/" in value or ".." in value)
        assert (generated[key] != value) == named_elsewhere, (key, generated[key])


def test_a_task_family_s_paths_are_not_opened_with_the_guard(tmp_path, vanilla):  # noqa: F811
    state = trusted_state(vanilla)
    state["cfg"]["task"] = dict(OTHER_TASKS["audio_finetuning"], _name="audio_finetuning",
                                data=str(tmp_path / "model"))
    state["cfg"]["task"]["labels"] = _secret_beside(tmp_path / "model")
    path = saved(state, tmp_path / "model")
    try:
        checkpoint_utils.load_model_ensemble_and_task([str(path)], arg_overrides={"data": str(tmp_path / "model")})
    except Exception as error:  # noqa: BLE001  (the audio task has no audio to set up: whatever it says,)
        assert SECRET_LINE.split()[0] not in str(error)  # not the secret's line


def test_a_task_family_s_paths_are_opened_without_the_guard(tmp_path, vanilla, dictionaries_unguarded):  # noqa: F811
    state = trusted_state(vanilla)
    state["cfg"]["task"] = dict(OTHER_TASKS["audio_finetuning"], _name="audio_finetuning",
                                data=str(tmp_path / "model"))
    state["cfg"]["task"]["labels"] = _secret_beside(tmp_path / "model")
    path = saved(state, tmp_path / "model")
    with pytest.raises(Exception, match=SECRET_LINE.split()[0]):
        checkpoint_utils.load_model_ensemble_and_task([str(path)], arg_overrides={"data": str(tmp_path / "model")},
                                                      state=unguarded_load(path))


def test_restore_file_refuses_a_task_that_cannot_build_its_model_in_one_line(tmp_path, vanilla,  # noqa: F811
                                                                            tiny_data_bin):
    """Not by a list of tasks: language_modeling is generated from its dataclass, and then cannot
    build the translation model the checkpoint holds (fairseq's own error, in one line)."""
    state = trusted_state(vanilla)
    state["cfg"]["task"] = {"_name": "language_modeling", "data": tiny_data_bin}
    path = saved(state, tmp_path)
    code, out = run(train_command(tiny_data_bin, "transformer_lite", tmp_path / "save", "--restore-file", path),
                    expect_ok=False, cwd=tmp_path, timeout=120)
    assert code == 1 and "Traceback" not in out and "fairseq cannot build the model" in out, out[-3000:]
