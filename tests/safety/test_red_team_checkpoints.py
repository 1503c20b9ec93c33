"""Checkpoints an outsider would hand the loader, through fairseq's real entry points: layouts
fairseq reads that the guard must accept, and values fairseq acts on that it must refuse.

One tiny ``fairseq-train --fp16`` run (in process, one update) is the source of every file:
its state is rewritten the way an older fairseq wrote it (the legacy ``args`` layout, which
fairseq's ``_upgrade_state_dict`` renames before it converts it) or with a hostile value.
"""
import numpy as np
import pytest
import torch
from fairseq import options
from fairseq.models.transformer import TransformerModel

from ea_fairseq.safety.no_code import CheckpointError
from ea_fairseq_cli import warm_start
from test_trainer_checkpoints import fairseq_train, train_argv
from support.trained_checkpoints import USER_DIR

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory, tiny_data_bin):
    """(checkpoint_last.pt of ``fairseq-train --fp16`` with Adam, its training argv)."""
    save = tmp_path_factory.mktemp("red_team") / "fp16"
    argv = train_argv(tiny_data_bin, save, "transformer", "fp16", "adam")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "current_device", lambda: None)  # (test_trainer_checkpoints' docstring)
        fairseq_train(argv)
    return save / "checkpoint_last.pt", argv


def legacy(path, argv, dst, change):
    """The checkpoint as an older fairseq wrote it: ``args`` (the parsed Namespace), no ``cfg``."""
    state = torch.load(path, weights_only=False)
    state.pop("cfg", None)
    state["args"] = options.parse_args_and_arch(options.get_training_parser(), argv)
    change(state["args"])
    dst.mkdir()
    torch.save(state, dst / "model.pt")
    return dst


def _no_task(args):  # fairseq's upgrade: a checkpoint without a task is a translation one
    del args.task


def _data_list(args):  # fairseq's upgrade: an older list of data directories is its first
    args.data = [args.data]


def _max_positions(args):  # fairseq's upgrade: max_positions is both position limits
    vars(args).pop("max_source_positions", None)
    vars(args).pop("max_target_positions", None)
    args.max_positions = 512


@pytest.mark.parametrize("change", [_no_task, _data_list, _max_positions])
def test_legacy_args_layouts_fairseq_upgrades_load_through_the_hub(fp16_run, tiny_data_bin, tmp_path, change):
    path, argv = fp16_run
    directory = legacy(path, argv, tmp_path / "old", change)
    hub = TransformerModel.from_pretrained(str(directory), checkpoint_file="model.pt",
                                           data_name_or_path=tiny_data_bin, user_dir=USER_DIR)
    assert hub.cfg.task._name == "translation"
    assert hub.cfg.task.max_source_positions == (512 if change is _max_positions else 1024)
    assert all(hub.translate(["s1 s2 s3"], beam=2, max_len_a=0, max_len_b=4))


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -128.0, "128"])
def test_a_loss_scale_fairseq_cannot_train_with_is_refused_by_restore_file(fp16_run, tmp_path, scale):
    """fairseq's FP16Optimizer sets the stored loss scale as it is: with NaN every update is
    skipped as an overflow (NaN halved is NaN, and NaN is never below the minimum scale)."""
    path, argv = fp16_run
    state = torch.load(path, weights_only=False)
    state["last_optimizer_state"]["loss_scale"] = scale
    torch.save(state, tmp_path / "hostile.pt")
    resumed = [a if a != str(path.parent) else str(tmp_path / "run") for a in argv]
    with pytest.raises(CheckpointError, match=r"refused: last_optimizer_state\['loss_scale'\] = .*: not a loss "
                                              r"scale \(a finite number above 0\)"):
        fairseq_train([*resumed, "--restore-file", str(tmp_path / "hostile.pt"), "--max-update", "2"])
    assert not (tmp_path / "run" / "checkpoint_last.pt").exists()


def _best(state):  # fairseq's save_checkpoint compares every validation score with it (min/max)
    state["extra_state"]["best"] = "0"


def _scheduler_best(state):  # fairseq's schedulers (ReduceLROnPlateau: torch's) compare losses with it
    state["optimizer_history"][-1]["lr_scheduler_state"] = {"best": [1.0], "last_epoch": 1}


def _criterion_name(state):  # fairseq's trainer prints it in its mismatch message
    state["optimizer_history"][-1]["criterion_name"] = "X\nINFO | fairseq_cli.train | done"


def _meter_name(state):  # fairseq logs a restored meter's name and value in its progress lines
    state["extra_state"]["metrics"]["train_inner"] = [
        (10, "zz\nINFO | fairseq_cli.train | done training", "AverageMeter", {"val": 1.0, "sum": 1.0, "count": 1})]


def _meter_value(state):
    state["extra_state"]["metrics"]["train_inner"] = [
        (10, "zz", "AverageMeter", {"val": "1\nINFO | fairseq_cli.train | done training", "sum": 1.0, "count": 1})]


@pytest.mark.parametrize("change,field", [
    (_meter_name, r"extra_state.metrics\['train_inner'\]\[0\]: meter name 'zz\\nINFO.*: not a metric name"),
    (_meter_value, r"extra_state.metrics\['train_inner'\]\[0\]: meter state .*: not a meter's numbers"),
    (_best, r"extra_state\['best'\] = '0': not a number"),
    (_scheduler_best, r"optimizer_history\[-1\].lr_scheduler_state = .*: not a learning-rate scheduler's state"),
    (_criterion_name, r"optimizer_history\[-1\].criterion_name = 'X\\nINFO.*: not a class name"),
], ids=["meter-name", "meter-value", "best", "scheduler-best", "criterion-name"])
def test_training_state_fairseq_compares_or_prints_is_refused_by_restore_file(fp16_run, tmp_path, change, field):
    path, argv = fp16_run
    state = torch.load(path, weights_only=False)
    change(state)
    torch.save(state, tmp_path / "hostile.pt")
    resumed = [a if a != str(path.parent) else str(tmp_path / "run") for a in argv]
    with pytest.raises(CheckpointError, match=field):
        fairseq_train([*resumed, "--restore-file", str(tmp_path / "hostile.pt"), "--max-update", "2"])


def test_the_training_state_fairseq_writes_resumes(fp16_run, tmp_path):
    """Negative control: the file as fairseq wrote it (a loss scale of 128, an int, or a float),
    with the best scores and --eval-bleu's meters as numpy and tensor numbers, resumes."""
    path, argv = fp16_run
    state = torch.load(path, weights_only=False)
    assert type(state["last_optimizer_state"]["loss_scale"]) in (int, float)
    state["extra_state"]["best"] = np.float64(21.5)
    state["optimizer_history"][-1]["lr_scheduler_state"] = {"best": torch.tensor(3.5), "last_epoch": 1}
    state["extra_state"]["metrics"]["valid"] = [  # --eval-bleu's meters, as fairseq writes them
        (0, "loss", "AverageMeter", {"val": torch.tensor(7.5), "sum": torch.tensor(7.5), "count": 1, "round": 3}),
        (1, "_bleu_counts", "AverageMeter", {"val": np.arange(4), "sum": np.arange(4), "count": 1, "round": None}),
        (2, "wps", "TimeMeter", {"init": 0.5, "n": 12, "round": 1})]
    torch.save(state, tmp_path / "written.pt")
    resumed = [a if a != str(path.parent) else str(tmp_path / "run") for a in argv]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "current_device", lambda: None)
        fairseq_train([*resumed, "--restore-file", str(tmp_path / "written.pt"), "--max-update", "2"])
    assert torch.load(tmp_path / "run" / "checkpoint_last.pt", weights_only=False)["optimizer_history"][-1][
        "num_updates"] == 2


@pytest.mark.parametrize("change,message", [
    (lambda s: {"cfg": s["cfg"], "model": s["model"]}, r"refused: no optimizer_history \(nor the oldest layout's"),
    (lambda s: {**s, "optimizer_history": []}, r"refused: optimizer_history = \[\]: not fairseq's optimizer history"),
    (lambda s: {key: value for key, value in s.items() if key != "extra_state"}, r"refused: no extra_state"),
    (lambda s: {**s, "extra_state": [1]}, r"refused: extra_state = \[1\]: not a dict"),
], ids=["no-history", "empty-history", "no-extra-state", "extra-state-list"])
def test_a_layout_fairseqs_loader_cannot_upgrade_is_refused_in_one_line_by_the_hub(fp16_run, tiny_data_bin, tmp_path,
                                                                                   change, message):
    """fairseq's ``_upgrade_state_dict`` indexes these in every checkpoint (a KeyError, IndexError
    or AttributeError deep in its loader otherwise); the file as written loads (the tests above)."""
    path, _ = fp16_run
    (tmp_path / "model").mkdir()
    torch.save(change(torch.load(path, weights_only=False)), tmp_path / "model" / "model.pt")
    with pytest.raises(CheckpointError, match=message):
        TransformerModel.from_pretrained(str(tmp_path / "model"), checkpoint_file="model.pt",
                                         data_name_or_path=tiny_data_bin, user_dir=USER_DIR)


@pytest.mark.parametrize("rows,shape", [(10 ** 6, (0,)), (2 * 10 ** 6, (1,))], ids=["no-data", "one-byte-rows"])
def test_the_rows_of_an_embedding_cost_the_meta_build_no_symbols(fp16_run, tiny_data_bin, tmp_path, monkeypatch,
                                                                  rows, shape):
    """The meta build's placeholder dictionaries take their size from the weights' embedding:
    a (10**6, 0) tensor is stored in no bytes, a (2*10**6, 1) int8 one in 2 MB; a dictionary
    made symbol by symbol would cost ~100 bytes and ~1 us a row (10**9 rows: ~100 GB)."""
    from fairseq.data import Dictionary

    path, _ = fp16_run
    state = torch.load(path, weights_only=False)
    state["model"]["encoder.embed_tokens.weight"] = torch.zeros(rows, *shape, dtype=torch.int8)
    (tmp_path / "model").mkdir()
    torch.save(state, tmp_path / "model" / "model.pt")
    added = []
    original = Dictionary.add_symbol
    monkeypatch.setattr(Dictionary, "add_symbol", lambda self, *a, **k: added.append(1) or original(self, *a, **k))
    with pytest.raises(CheckpointError, match=r"refused: (its weights are not those of the model|fairseq cannot "
                                              r"build the model)"):
        TransformerModel.from_pretrained(str(tmp_path / "model"), checkpoint_file="model.pt",
                                         data_name_or_path=tiny_data_bin, user_dir=USER_DIR)
    assert 0 < len(added) < 10 ** 4  # the specials of the placeholders and of the data directory's dictionaries


def test_the_warm_start_builds_its_vanilla_model_without_a_symbol_per_row(fp16_run, tmp_path, monkeypatch):
    """``python -m ea_fairseq_cli.warm_start`` builds the new model with stand-in dictionaries
    of the vanilla embedding's rows: int8 rows of a joined embedding (which the loader takes:
    it copies them into the model) cost no symbol each."""
    from fairseq.data import Dictionary

    path, _ = fp16_run
    state = torch.load(path, weights_only=False)
    rows = torch.zeros(2 * 10 ** 5, 16, dtype=torch.int8)
    for key in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "decoder.output_projection.weight"):
        state["model"][key] = rows
    torch.save(state, tmp_path / "vanilla.pt")
    added = []
    original = Dictionary.add_symbol
    monkeypatch.setattr(Dictionary, "add_symbol", lambda self, *a, **k: added.append(1) or original(self, *a, **k))
    code = warm_start.main([str(tmp_path / "vanilla.pt"), "--arch", "ea_transformer_lite",
                            "--output", str(tmp_path / "warm.pt")])
    assert code == 0 and (tmp_path / "warm.pt").exists()
    assert len(added) < 10 ** 4


def test_an_ema_copy_that_is_not_the_models_is_refused_by_restore_file(fp16_run, tmp_path, monkeypatch):
    """``--store-ema`` resumes by loading ``extra_state['ema']`` into a copy of the model (a
    RuntimeError deep in fairseq's EMA otherwise)."""
    path, argv = fp16_run
    state = torch.load(path, weights_only=False)
    state["extra_state"]["ema"] = {**state["model"], "encoder.embed_tokens.weight": torch.zeros(3, 3)}
    torch.save(state, tmp_path / "hostile.pt")
    resumed = [a if a != str(path.parent) else str(tmp_path / "run") for a in argv]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # (unguarded, fairseq reaches its EMA)
    with pytest.raises(CheckpointError, match=r"refused: extra_state\['ema'\]\[.*\]: not a weight of the model"):
        fairseq_train([*resumed, "--store-ema", "--restore-file", str(tmp_path / "hostile.pt"), "--max-update", "2"])


@pytest.mark.parametrize("field,value,message", [
    ("conv_feature_layers", "__import__('pathlib').Path({marker!r}).touch() or [(512, 10, 5)]", "calls a function"),
    ("override_encoder_layers", "[(lambda: __import__('pathlib').Path({marker!r}).touch())()]", "calls a function"),
    ("conv_feature_layers", "[(512, 10, 5)] * 1000000000", "would hold more than"),
], ids=["wav2vec2-call", "multires-hubert-lambda", "wav2vec2-size"])
def test_a_field_another_family_evaluates_runs_nothing_and_allocates_nothing(fp16_run, tiny_data_bin, tmp_path,
                                                                             field, value, message):
    """A model section naming a family that ``eval()``s a string field the plugin does not list
    (wav2vec2's ``conv_feature_layers``, multires HuBERT's ``override_encoder_layers``), with the
    transformer's weights so that the model is built to compare them: refused by the hub before
    any model is built, the marker never written; fairseq's own default of that field (a literal
    expression) passes, and what stops that checkpoint is its model's budget."""
    path, _ = fp16_run
    marker = tmp_path / "ran"
    state = torch.load(path, weights_only=False)
    state["cfg"]["model"] = {"_name": "wav2vec2", field: value.format(marker=str(marker))}
    (tmp_path / "model").mkdir()
    torch.save(state, tmp_path / "model" / "model.pt")
    with pytest.raises(CheckpointError, match=f"refused: cfg.model.{field}: .*{message}"):
        TransformerModel.from_pretrained(str(tmp_path / "model"), checkpoint_file="model.pt",
                                         data_name_or_path=tiny_data_bin, user_dir=USER_DIR)
    assert not marker.exists()
    state["cfg"]["model"][field] = "[(512, 10, 5)] + [(512, 3, 2)] * 4 + [(512,2,2)] + [(512,2,2)]"  # its default
    torch.save(state, tmp_path / "model" / "model.pt")
    with pytest.raises(CheckpointError) as refused:  # a wav2vec2 model is no transformer's weights
        TransformerModel.from_pretrained(str(tmp_path / "model"), checkpoint_file="model.pt",
                                         data_name_or_path=tiny_data_bin, user_dir=USER_DIR)
    assert field not in str(refused.value) and "refused: the model its configuration describes" in str(refused.value)
