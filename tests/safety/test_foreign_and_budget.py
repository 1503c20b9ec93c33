"""fairseq's own model families, trained by plain fairseq-train, load through the plugin and decode
exactly as plain fairseq decodes them; and what fairseq builds from a checkpoint is budgeted by the
checkpoint's weights (principle 3, :mod:`ea_fairseq.safety.budget`): a configuration that sizes a
table the checkpoint does not store, or a directory whose dictionaries size the embeddings, is
refused in one line before anything is allocated, while models of real sizes build within it.

Each attack goes through fairseq-generate with the plugin, beside a control computing on the meta
device (no memory) what the same files make plain fairseq build."""
import copy
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import REPO, cli
from support.trained_checkpoints import ENV, run

USER_DIR = os.path.join(REPO, "ea_fairseq")
DRIVERS = os.path.join(REPO, "tests", "drivers")
GB = 10 ** 9

# -- 1. fairseq's other families, trained without the plugin ----------------------------------------
TINY_TRANSFORMER = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16",
                    "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "16", "--decoder-ffn-embed-dim", "16",
                    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]
FOREIGN = {
    "transformer": ("transformer", TINY_TRANSFORMER),
    "lstm": ("lstm", ["--encoder-embed-dim", "16", "--decoder-embed-dim", "16", "--encoder-hidden-size", "16",
                      "--decoder-hidden-size", "16", "--decoder-out-embed-dim", "16"]),
    "fconv": ("fconv", ["--encoder-embed-dim", "16", "--decoder-embed-dim", "16", "--encoder-layers",
                        "[(16,3)]*2", "--decoder-layers", "[(16,3)]*2", "--decoder-out-embed-dim", "16"]),
    "bart_base": ("bart_base", [*TINY_TRANSFORMER, "--share-all-embeddings"]),
}
SENTENCES = ["s1 s2 s3", "s4 s5 s6 s7 s8", "s11"]
TOOLS = ("generate", "interactive", "hub")


@pytest.fixture(scope="module")
def foreign(tmp_path_factory, tiny_data_bin):
    """family -> checkpoint_last.pt of one update of plain ``fairseq-train`` (no --user-dir; the
    driver imports fairseq only), all trained in one process."""
    root = tmp_path_factory.mktemp("foreign")
    commands = [[tiny_data_bin, "--task", "translation", "--arch", arch, *options, "--optimizer", "adam",
                 "--lr", "1e-3", "--max-tokens", "600", "--max-update", "1", "--save-dir", str(root / family),
                 "--no-epoch-checkpoints", "--disable-validation", "--cpu", "--num-workers", "0", "--seed", "3",
                 "--no-progress-bar"] for family, (arch, options) in FOREIGN.items()]
    run([sys.executable, os.path.join(DRIVERS, "fairseq_train_many.py"), *map(json.dumps, commands)], timeout=600)
    return {family: str(root / family / "checkpoint_last.pt") for family in FOREIGN}


def decode_all(data_bin, checkpoints, user_dir, control=False):
    """tests/drivers/decode_families.py's report: every checkpoint through fairseq-generate,
    fairseq-interactive and the hub, in one process, with the plugin (``user_dir``) or without."""
    spec = {"data": data_bin, "checkpoints": checkpoints, "lines": SENTENCES, "user_dir": user_dir,
            "control": control}
    env = {key: value for key, value in ENV.items() if key != "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"}
    proc = subprocess.run([sys.executable, os.path.join(DRIVERS, "decode_families.py"), json.dumps(spec)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def decoded(foreign, tiny_data_bin):
    """(with the plugin, plain fairseq): plain fairseq first loads each checkpoint as torch now
    defaults (weights only), then decodes with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1."""
    return decode_all(tiny_data_bin, foreign, USER_DIR), decode_all(tiny_data_bin, foreign, None, control=True)


def test_the_plugin_was_loaded_on_one_side_only(decoded):
    plugin, plain = decoded
    assert plugin["plugin_loaded"] == ["ea_fairseq"] and plain["plugin_loaded"] == []


@pytest.mark.parametrize("family", list(FOREIGN))
@pytest.mark.parametrize("tool", TOOLS)
def test_a_foreign_family_decodes_with_the_plugin_as_plain_fairseq_does(decoded, family, tool):
    plugin, plain = decoded
    assert isinstance(plain[family][tool], list), plain[family][tool]  # plain fairseq decoded it
    expected = {"generate": 2 * 24, "interactive": 2 * len(SENTENCES), "hub": len(SENTENCES)}[tool]
    assert len(plain[family][tool]) == expected, plain[family][tool]  # every H- and P- line (or translation)
    assert plugin[family][tool] == plain[family][tool]


@pytest.mark.parametrize("family", list(FOREIGN))
def test_plain_fairseq_refuses_them_under_torchs_weights_only_default(decoded, family):
    """Negative control: without the plugin, torch >= 2.6 refuses fairseq's own checkpoints (their
    configuration is pickled objects); the plugin is what loads them."""
    _, plain = decoded
    assert plain["control"][family].startswith("UnpicklingError: Weights only load failed")
    assert "Unsupported global" in plain["control"][family]


# -- 2 and 3. what a checkpoint or its directory makes fairseq build ----------------------------------
def at_most_3_gib():
    """The child's address space, 3 GiB (fairseq-generate with a tiny model needs under 1): should the
    guard let an attack through, the allocation fails at once instead of filling the machine."""
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


def measured(data_bin, checkpoint, limit_s=300):
    """fairseq-generate with the plugin: (exit status, output, seconds, the process's peak RSS in
    bytes, as ``wait4`` reports it when the process is reaped)."""
    argv = [cli("fairseq-generate"), str(data_bin), "--user-dir", USER_DIR, "--path", str(checkpoint),
            "--beam", "2", "--max-len-b", "5", "--gen-subset", "test", "--required-batch-size-multiple", "1",
            "--cpu", "--num-workers", "0"]
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=ENV, preexec_fn=at_most_3_gib)
    timer = threading.Timer(limit_s, proc.kill)
    timer.start()
    try:
        with proc.stdout:
            out = proc.stdout.read().decode(errors="replace")
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    seconds = time.perf_counter() - start
    peak = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # bytes on macOS, KiB on Linux
    return proc.returncode, out, seconds, peak


def assert_refused_by_the_budget(status, out, seconds, peak):
    assert status == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    refusal = [line for line in out.splitlines() if "would create more than" in line]
    assert len(refusal) == 1 and refusal[0].startswith("fairseq-generate: error: "), out[-3000:]
    assert "nothing was allocated" in refusal[0]
    assert seconds < 60, seconds
    assert peak < 2 * GB, peak


def state_of(checkpoint):
    return torch.load(checkpoint, weights_only=False)  # the tests' own file, written by fairseq-train above


def on_paper(model_cfg, data_bin):
    """The model plain fairseq builds from ``model_cfg`` with the directory's dictionaries, built
    on the meta device by fairseq's own ``build_model`` (the plugin's replacement taken off: no
    budget): {name: bytes} of its parameters and buffers."""
    from fairseq.tasks.translation import TranslationConfig, TranslationTask

    from ea_fairseq.side_effects import original

    task = TranslationTask.setup_task(TranslationConfig(data=str(data_bin), source_lang="src", target_lang="tgt"))
    with torch.device("meta"):
        model = original("fairseq.models:build_model")(copy.deepcopy(model_cfg), task)
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    return {name: t.numel() * t.element_size() for name, t in tensors.items()}


def embeddings_only(checkpoint, path, width, positions):
    """The trained transformer's checkpoint made into one whose configuration describes its weights
    exactly: no layers, embeddings (and the output projection) ``width`` wide, zeros, and
    ``positions`` for both position limits; the configuration's model section is returned."""
    state = state_of(checkpoint)
    model = state["cfg"]["model"]
    model.encoder_layers = model.decoder_layers = 0
    model.max_source_positions = model.max_target_positions = positions
    for field in ("encoder_embed_dim", "decoder_embed_dim", "decoder_input_dim", "decoder_output_dim"):
        setattr(model, field, width)
    state["model"] = {name: torch.zeros(value.shape[0], width) if value.dim() == 2 else value
                      for name, value in state["model"].items() if ".layers." not in name}
    state["last_optimizer_state"] = None
    torch.save(state, path)
    return model


#: a sinusoidal table (which no checkpoint stores) has max_positions + 2 rows (at most 65536 + 2: the
#: plugin's bound on the field) of the embedding's width: 2**14 wide, each table is 65538 x 16384
#: floats, 4.3 GB; the weights, three embeddings of 104 x 16384, 20 MB. (A configuration whose width
#: differs from its weights' is refused by the comparison with the weights as well; these agree, so
#: the budget alone stands between the table and the allocation.)
TABLE_WIDTH = 1 << 14


def test_a_table_the_checkpoint_does_not_store_is_refused_before_it_is_allocated(foreign, tiny_data_bin, tmp_path):
    model = embeddings_only(foreign["transformer"], tmp_path / "wide.pt", TABLE_WIDTH, 1 << 16)
    assert os.path.getsize(tmp_path / "wide.pt") < 25 * 10 ** 6
    # control: the position tables alone that these values make plain fairseq build
    sizes = on_paper(model, tiny_data_bin)
    tables = {name: size for name, size in sizes.items() if "embed_positions" in name}
    assert len(tables) == 2 and min(tables.values()) > 4 * GB, tables
    assert sum(size for name, size in sizes.items() if name not in tables) < 25 * 10 ** 6  # all the rest
    assert_refused_by_the_budget(*measured(tiny_data_bin, tmp_path / "wide.pt"))


def test_parameters_of_torchs_legacy_constructors_are_counted_before_they_are_allocated(
        foreign, tiny_data_bin, tmp_path):
    """fairseq's convolutions (``ConvTBC`` here, fconv's; lightconv's and LSRA's likewise) make their
    weights with ``torch.Tensor(k, in, out)``, which no torch function sees and which ignores the
    ``meta`` device: a kernel width of 750,001 makes the encoder's one 1.5 GB. The budget counts it
    at torch's dispatcher, before it is allocated; the control is the checkpoint as trained."""
    state = state_of(foreign["fconv"])
    state["cfg"]["model"].encoder_layers = "[(16, 750001)]"
    torch.save(state, tmp_path / "wide_kernel.pt")
    control = measured(tiny_data_bin, foreign["fconv"])
    assert control[0] == 0, control[1][-3000:]
    status, out, seconds, peak = measured(tiny_data_bin, tmp_path / "wide_kernel.pt")
    assert_refused_by_the_budget(status, out, seconds, peak)
    assert peak < control[3] + 2 ** 28, (peak, control[3])


ROBERTA = {"_name": "roberta", "encoder_layers": 1, "encoder_embed_dim": 16, "encoder_ffn_embed_dim": 16,
           "encoder_attention_heads": 2, "max_positions": 32}
LOADINGS = {  # what loading a checkpoint builds beyond models.build_model(from_checkpoint=True)
    # nlu_finetuning's build_model takes no from_checkpoint: wav2vec2, 3 layers 2048 wide (1 GB)
    "build-without-from-checkpoint": ({"_name": "wav2vec2", "encoder_layers": 3, "encoder_embed_dim": 2048,
                                       "encoder_ffn_embed_dim": 8192, "encoder_attention_heads": 1,
                                       "conv_feature_layers": "[(8,10,5)]", "conv_pos": 4, "conv_pos_groups": 1,
                                       "final_dim": 8}, {"_name": "nlu_finetuning"}, {}),
    # RoBERTa's upgrade in load_state_dict: a head the shapes of the (empty) stored head weights describe
    "stored-head-shapes": ({**ROBERTA, "load_checkpoint_heads": True}, {"_name": "masked_lm", "tokens_per_sample": 32},
                           {"classification_heads.h.out_proj.weight": torch.empty(8192, 0),
                            "classification_heads.h.dense.weight": torch.empty(4096, 0)}),
    # sentence_prediction's build_model, after the model's: a head of the task's num_classes
    "task-num-classes": (ROBERTA, {"_name": "sentence_prediction", "num_classes": 2_000_000, "regression_target": True,
                                   "max_positions": 32}, {}),
}


@pytest.mark.parametrize("case", sorted(LOADINGS))
def test_everything_loading_builds_from_a_checkpoint_is_under_its_budget(case, tmp_path):
    """``load_model_ensemble_and_task`` (the hub's, fairseq-validate's) builds from a checkpoint
    more than ``models.build_model(from_checkpoint=True)``: a task whose ``build_model`` takes no
    ``from_checkpoint`` (``nlu_finetuning``) builds without saying so, and a classification head is
    registered after the build, in the task's ``build_model`` and in the model's
    ``load_state_dict``. Each is sized by the checkpoint (33 million elements to 1 GB against
    weights of 100) and charged to its budget until the loading returns."""
    from fairseq import checkpoint_utils

    from ea_fairseq.safety.budget import BudgetError

    model, task, stored = LOADINGS[case]
    (tmp_path / "dict.txt").write_text("a 1\nb 1\nc 1\n")
    for sub in ("input0", "label"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "dict.txt").write_text("a 1\nb 1\nc 1\n")
    state = {"cfg": {"model": model, "task": {**task, "data": str(tmp_path)},
                     "criterion": {"_name": "sentence_prediction", "classification_head_name": "h"}},
             "model": {"dummy": torch.zeros(100), **stored}, "extra_state": {},
             "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                                    "lr_scheduler_state": {"best": None}, "num_updates": 0}]}
    torch.save(state, tmp_path / "model.pt")
    with pytest.raises(BudgetError, match="would create more than 16,777,616 elements"):
        checkpoint_utils.load_model_ensemble_and_task([str(tmp_path / "model.pt")])


#: the same construction, 8192 wide, 64 positions (10 MB of weights): its dictionaries then decide
#: what fairseq builds: 50,000 symbols make the two embeddings and the output projection
#: 3 x 50,000 x 8192 floats, 4.9 GB
EMBEDDINGS, SYMBOLS = 1 << 13, 50_000


def test_the_directorys_dictionaries_are_refused_before_they_size_the_model(foreign, tiny_data_bin, tmp_path):
    from fairseq import checkpoint_utils

    model = embeddings_only(foreign["transformer"], tmp_path / "c.pt", EMBEDDINGS, 64)
    large = tmp_path / "large"
    shutil.copytree(tiny_data_bin, large)
    for side in ("src", "tgt"):
        with open(large / f"dict.{side}.txt") as f:
            known = sum(1 for _ in f)
        with open(large / f"dict.{side}.txt", "a") as f:
            f.writelines(f"w{i} 1\n" for i in range(SYMBOLS - known - 4))
    assert sum(f.stat().st_size for f in large.iterdir()) + os.path.getsize(tmp_path / "c.pt") < 20 * 10 ** 6
    # the checkpoint itself is sound: with the dictionaries it was trained with, it loads
    (loaded,), _, _ = checkpoint_utils.load_model_ensemble_and_task(
        [str(tmp_path / "c.pt")], arg_overrides={"data": tiny_data_bin})
    assert loaded.encoder.embed_tokens.weight.shape == (104, EMBEDDINGS)
    # control: what plain fairseq builds with the large directory's dictionaries
    sizes = on_paper(model, large)
    assert sizes["encoder.embed_tokens.weight"] == SYMBOLS * EMBEDDINGS * 4
    assert sum(sizes.values()) > 4 * GB, sum(sizes.values())
    assert_refused_by_the_budget(*measured(large, tmp_path / "c.pt"))


# -- 4. models of real sizes build within their weights' budget ---------------------------------------
def test_a_transformer_of_the_papers_size_builds_within_the_budget_of_its_weights():
    """transformer_wmt_en_de (6 + 6 layers, 512 wide, FFN 2048) with a 32k joined vocabulary, built
    through fairseq's build_model as a checkpoint's load builds it (the plugin's replacement, under the
    budget of weights read), on meta: within the budget, with room; without its weights, refused."""
    from types import SimpleNamespace

    from fairseq import models

    from ea_fairseq.models.building import SizedDictionary, parse_options
    from ea_fairseq.safety import budget

    args = parse_options("transformer_wmt_en_de")
    vocabulary = SizedDictionary(32768)
    task = SimpleNamespace(source_dictionary=vocabulary, target_dictionary=vocabulary)
    with torch.device("meta"):
        weights = models.build_model(copy.deepcopy(args), task).state_dict()
    held = sum(t.numel() for t in weights.values())
    assert held > 60 * 10 ** 6  # the paper's 63M (two embeddings and the output projection of 32k rows)

    allowed = budget.Budget.for_weights(weights, "wmt")
    with allowed, torch.device("meta"):
        models.build_model(copy.deepcopy(args), task)
    assert 0 < allowed.used <= allowed.limit / 2 and allowed.operations > 0, (allowed.used, allowed.limit)

    budget.weights_read("wmt", weights)  # as the plugin's load_checkpoint_to_cpu records them
    with torch.device("meta"):
        model = models.build_model(copy.deepcopy(args), task, from_checkpoint=True)
    assert model.encoder.embed_tokens.weight.shape == (32768, 512)
    assert sum(p.numel() for p in model.parameters()) == sum(weights[name].numel()
                                                             for name, _ in model.named_parameters())

    budget.weights_read("tiny", {"w": torch.zeros(16, 16)})  # the same configuration with far fewer weights
    with pytest.raises(budget.BudgetError, match="would create more than"), torch.device("meta"):
        models.build_model(copy.deepcopy(args), task, from_checkpoint=True)


def test_the_budget_adds_no_warning_to_what_it_counts():
    """Moving parameters under the budget (build_on_meta's ``model.to("meta")``, where a module made
    them on the CPU: LSRA's convolutions) reads each one's ``.grad``; the budget's meta copy of a
    parameter is detached, so that read does not make torch warn about a non-leaf tensor."""
    import warnings

    from ea_fairseq.safety.budget import Budget

    layer = torch.nn.Linear(2, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Budget(1 << 20, 1 << 10, "x"):
            layer.to("meta")
    assert [str(w.message) for w in caught] == [] and layer.weight.is_meta


def test_the_budgets_walk_is_torchs():
    """The budget's own walk of an operation's arguments and outputs reaches the tensors torch's
    ``tree_map`` reaches, in its order, and rebuilds the same containers (plain ones walked by
    itself, their subclasses handed to ``tree_map``), so a tensor it missed could not be allocated
    before it is counted."""
    from collections import OrderedDict

    from torch.utils._pytree import tree_map

    from ea_fairseq.safety.budget import _map

    a, b, c = torch.zeros(1), torch.zeros(2), torch.nn.Parameter(torch.zeros(3))
    for tree in [(a, [b, {"k": c}], 4, None), torch.max(torch.zeros(2, 3), 1), OrderedDict(x=[a, (b,)]),
                 ([a], torch.Size([2, 3]), "s", torch.float16), {"out": (b, c), "size": [1, 2]}]:
        seen, expected = [], []
        mine = _map(lambda t: seen.append(t) or t.to("meta"), tree)
        torchs = tree_map(lambda t: (expected.append(t) or t.to("meta")) if isinstance(t, torch.Tensor) else t, tree)
        assert [id(t) for t in seen] == [id(t) for t in expected] and seen
        assert type(mine) is type(torchs) and repr(mine) == repr(torchs)


def test_weights_that_view_one_storage_count_it_once():
    """A checkpoint's weights are what it stores: 17 tensors viewing one 1 MiB storage give the
    budget (and the hub's dictionary bound) 1 MiB of elements, not 17."""
    from ea_fairseq.safety import budget

    stored = torch.zeros(1 << 20, dtype=torch.uint8)
    weights = {f"w{i}": stored[i:] for i in range(17)}
    assert budget.Budget.for_weights(weights, "c.pt").weights == 1 << 20
    assert budget.Budget.for_weights({"a": torch.zeros(3), "b": torch.zeros(4)}, "c.pt").weights == 7
