"""fairseq-hydra-train builds the model fairseq-train builds, for every recipe config
(examples/translation/config), and refuses a model configuration it cannot read."""
import os
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from fairseq import checkpoint_utils, models
from fairseq.models import ARCH_MODEL_REGISTRY
from fairseq.data import Dictionary
from fairseq.dataclass.initialize import add_defaults, hydra_init
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import REPO, cli, make_dictionary
from ea_fairseq.hydra_checks import check_keys, job_config
from ea_fairseq.models import building
from ea_fairseq.models.ea_transformer import EATransformerModel
from ea_fairseq.modules import EvolvingAttention, RecurrentAttention

# fairseq-hydra-train validates a config against the schema fairseq stores under the config's
# name, a composition hydra deprecates (with a warning at every composition)
pytestmark = pytest.mark.filterwarnings(r"ignore:\s*'[^']*' is validated against ConfigStore schema:UserWarning")

CONFIG_DIR = os.path.join(REPO, "examples", "translation", "config")

# each recipe config: the fairseq-train --arch and model options of the same paper setting
# (examples/translation/train.sh FAMILY PAIR prints them with DRY_RUN=1)
EQUIVALENT = {
    "transformer_lite_iwslt14": ("transformer_lite", "--share-decoder-input-output-embed --dropout 0.2"),
    "ea_transformer_lite_iwslt14": ("ea_transformer_lite",
                                    "--share-decoder-input-output-embed --dropout 0.2 --ea-alpha 0.1 --ea-beta 0.1"),
    "transformer_lite_pa_iwslt14": ("transformer_lite", "--share-decoder-input-output-embed --dropout 0.2"),
    "pa_transformer_lite_iwslt14": ("pa_transformer_lite", "--share-decoder-input-output-embed --dropout 0.2 --pa-alpha 0.1"),
    "transformer_base_wmt14_en_de": ("transformer", "--share-all-embeddings --dropout 0.3"),
    "ea_transformer_base_wmt14_en_de": ("ea_transformer_base",
                                        "--share-all-embeddings --dropout 0.3 --ea-alpha 0.5 --ea-beta 0.1"),
    "transformer_ran_wmt14_en_de": ("transformer", "--share-all-embeddings --dropout 0.1 --attention-dropout 0.0"),
    "ran_e_wmt14_en_de": ("ran_e", "--share-all-embeddings --dropout 0.1 --attention-dropout 0.2"),
    "ran_d_wmt14_en_de": ("ran_d", "--share-all-embeddings --dropout 0.1 --attention-dropout 0.2"),
    "ran_all_wmt14_en_de": ("ran_all", "--share-all-embeddings --dropout 0.1 --attention-dropout 0.2"),
    "transformer_dropattn_wmt14_en_de": ("transformer", "--share-all-embeddings --dropout 0.1"),
    "dropattn_wmt14_en_de": ("transformer", "--share-all-embeddings --dropout 0.1 --drop-attention element "
                                            "--drop-attention-p 0.2 --drop-attention-window 2"),
}


def hydra_config(name: str, *overrides: str):
    """``cfg`` as fairseq-hydra-train composes it (``--config-dir examples/translation/config
    --config-name name overrides...``) and hands it to fairseq's training."""
    hydra_init(name)
    # fairseq-hydra-train leaves hydra's version base unspecified (1.1 behaviour), and
    # fairseq's own loader relies on it (hydra.experimental.initialize refuses to run once a
    # base >= 1.2 was set in the process): compose with that base, as the command does
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.1"):
        cfg = compose(config_name=name, overrides=list(overrides))
    add_defaults(cfg)
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    OmegaConf.set_struct(cfg, True)
    return cfg


def hydra_model(name: str, *overrides: str, meta: bool = False, seed: int = 1):
    """The model fairseq's training builds from that configuration (``models.build_model``)."""
    cfg = hydra_config(name, *overrides)
    d = make_dictionary()
    torch.manual_seed(seed)
    with torch.device("meta") if meta else torch.device("cpu"):
        return models.build_model(cfg.model, SimpleNamespace(source_dictionary=d, target_dictionary=d)), cfg


def train_model(arch: str, options: str, meta: bool = False, seed: int = 1):
    """The model fairseq-train builds for ``--arch arch options``."""
    return building.build_model(arch, *options.split(), dictionary=make_dictionary(), seed=seed, meta=meta)[0]


def signature(model):
    """Every module's name, class and scalar settings (α, β, dropout p, ...), and every
    parameter's and buffer's name and shape."""
    modules = [(name, type(m).__name__,
                {k: v for k, v in vars(m).items() if not k.startswith("_") and isinstance(v, (bool, int, float, str))})
               for name, m in model.named_modules()]
    return modules, [(k, tuple(v.shape)) for k, v in model.state_dict().items()]


def attention_classes(model):
    return {role: {type(getattr(layer, attr)).__name__ for layer in stack.layers}
            for role, stack, attr in (("encoder", model.encoder, "self_attn"),
                                      ("decoder", model.decoder, "self_attn"),
                                      ("cross", model.decoder, "encoder_attn"))}


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_every_recipe_config_has_its_fairseq_train_equivalent():
    names = sorted(f[:-len(".yaml")] for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml"))
    assert names == sorted(EQUIVALENT)


# each family's attention (encoder self, decoder self, cross), as the config builds it
ATTENTION = {
    "transformer_lite_iwslt14": ("MultiheadAttention", "MultiheadAttention", "MultiheadAttention"),
    "ea_transformer_lite_iwslt14": ("EvolvingAttention", "EvolvingAttention", "EvolvingAttention"),
    "pa_transformer_lite_iwslt14": ("PredictiveAttention", "MultiheadAttention", "MultiheadAttention"),
    "ran_e_wmt14_en_de": ("RecurrentAttention", "MultiheadAttention", "MultiheadAttention"),
    "ran_d_wmt14_en_de": ("MultiheadAttention", "RecurrentAttention", "LogitMapAttention"),
    "ran_all_wmt14_en_de": ("RecurrentAttention", "RecurrentAttention", "LogitMapAttention"),
    "dropattn_wmt14_en_de": ("LogitMapAttention", "LogitMapAttention", "LogitMapAttention"),
}


@pytest.mark.parametrize("name", sorted(EQUIVALENT))
def test_hydra_builds_the_model_fairseq_train_builds(name):
    """Same classes, settings, parameter names and shapes; the Lite models (built for real)
    also the same initial weights under the same seed; each family its attention."""
    arch, options = EQUIVALENT[name]
    meta = "lite" not in arch
    hydra, cfg = hydra_model(name, meta=meta)
    train = train_model(arch, options, meta=meta)
    assert cfg.model._name == arch
    check_keys(cfg)  # every key of the configuration fairseq receives passes the key check
    assert type(hydra) is type(train)
    assert signature(hydra) == signature(train)
    assert n_params(hydra) == n_params(train)
    if not meta:
        for (k, a), b in zip(hydra.state_dict().items(), train.state_dict().values()):
            assert torch.equal(a, b), k
    if name in ATTENTION:
        encoder, decoder, cross = ATTENTION[name]
        assert attention_classes(hydra) == {"encoder": {encoder}, "decoder": {decoder}, "cross": {cross}}
    if name == "dropattn_wmt14_en_de":
        drops = {repr(m.weight_dropout) for m in hydra.modules() if hasattr(m, "weight_dropout")}
        assert drops == {"DropAttention(mode=element, p=0.2, window=2, rescale=normalized)"}


PLUGIN_ARCHS = sorted(arch for arch, model in ARCH_MODEL_REGISTRY.items() if model is EATransformerModel)


@pytest.mark.parametrize("arch", PLUGIN_ARCHS)
def test_every_plugin_arch_builds_through_hydra(arch):
    """Any arch of the plugin as ``model._name`` on a recipe config: fairseq-train's model."""
    hydra, _ = hydra_model("transformer_lite_iwslt14", f"model._name={arch}", meta=True)
    train = train_model(arch, "--share-decoder-input-output-embed --dropout 0.2", meta=True)
    assert type(hydra) is EATransformerModel
    assert signature(hydra) == signature(train)


def test_overrides_on_the_command_line_change_the_model():
    # a vanilla-encoder config gets an EA encoder, as --encoder-attention ea would give it
    # (options the config lists are overridden as they are, others added with '+')
    hydra, _ = hydra_model("ran_d_wmt14_en_de", "model._name=ran_d_lite", "model.encoder_attention=ea",
                           "+model.ea_alpha=0.3", "+model.ea_beta=0.1")
    train = train_model("ran_d_lite", "--share-all-embeddings --dropout 0.1 --attention-dropout 0.2 "
                        "--encoder-attention ea --ea-alpha 0.3 --ea-beta 0.1")
    assert attention_classes(hydra)["encoder"] == {"EvolvingAttention"}
    assert {m.alpha for m in hydra.encoder.modules() if isinstance(m, EvolvingAttention)} == {0.3}
    assert signature(hydra) == signature(train)
    # and an option the config lists, overridden
    vanilla, _ = hydra_model("ea_transformer_lite_iwslt14", "model.encoder_attention=vanilla")
    ea, _ = hydra_model("ea_transformer_lite_iwslt14")
    assert attention_classes(vanilla)["encoder"] == {"MultiheadAttention"}
    assert n_params(vanilla) < n_params(ea)
    assert signature(vanilla) == signature(train_model(
        "ea_transformer_lite", "--share-decoder-input-output-embed --dropout 0.2 --ea-alpha 0.1 --ea-beta 0.1 "
        "--encoder-attention vanilla"))


@pytest.mark.parametrize("name, overrides, message", [
    ("ea_transformer_lite_iwslt14", ["+model.ea_alpah=0.3"],
     r"model\.ea_alpah: not an option of --arch ea_transformer_lite \(did you mean model\.ea_alpha\?\)"),
    ("ea_transformer_lite_iwslt14", ["model.ea_alpha=abc"], r"argument --ea-alpha: invalid float value: 'abc'"),
    ("ea_transformer_lite_iwslt14", ["model.cross_attention=ran"],
     r"argument --cross-attention: invalid choice: 'ran' \(choose from 'vanilla', 'ea', "),
    ("ea_transformer_lite_iwslt14", ["+model.ran_max_positions=0"], r"argument --ran-max-positions: must be at least 1"),
    ("ea_transformer_lite_iwslt14", ["+model.ea_no_encoder_conv=maybe"], r"model\.ea_no_encoder_conv: 'maybe': a flag takes true or false"),
    ("transformer_lite_iwslt14", ["+model.encoder_attention=ea"],
     r"model\.encoder_attention: not an option of --arch transformer_lite.*option of the plugin's own archs"),
    ("transformer_lite_iwslt14", ["+model.encoder.embed_dim=64"], r"model\.encoder: fairseq's legacy transformer reads flat options"),
    ("transformer_base_wmt14_en_de", ["+model.drop_attention_p=0.3"], r"--drop-attention-p given without --drop-attention"),
])
def test_a_config_the_model_cannot_read_is_refused(name, overrides, message):
    with pytest.raises(ValueError, match=message):
        hydra_model(name, *overrides, meta=True)


def composed(name: str, *overrides: str):
    """The configuration as hydra composes it and hands the run's callbacks (hydra's own
    section included), before fairseq adds its defaults."""
    hydra_init(name)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.1"):
        return compose(config_name=name, overrides=list(overrides), return_hydra_config=True)


@pytest.mark.parametrize("override, message", [
    ("+optimization.lrr=0.1", "optimization.lrr: not an option of fairseq's optimization (did you mean "
                              "optimization.lr?); `fairseq-train --help` lists them (option --a-b is key a_b)"),
    ("+task.eval_bleuu=true", "task.eval_bleuu: not an option of fairseq's task translation (did you mean "
                              "task.eval_bleu?); `ea-fairseq-options ea_transformer_lite --all --task translation` "
                              "lists them (option --a-b is key a_b)"),
    ("+criterion.label_smoothin=0.2", "criterion.label_smoothin: not an option of fairseq's criterion "
                                      "label_smoothed_cross_entropy (did you mean criterion.label_smoothing?)"),
    ("+optimisation.lr=[0.1]", "optimisation: not a section of fairseq's configuration (did you mean optimization?)"),
])
def test_a_typo_outside_the_model_stops_the_run(override, message):
    """The run's callback (in-process: the real command takes seconds to start) refuses a key
    no section of fairseq's configuration defines, in one line naming the key."""
    from ea_fairseq.hydra_checks import RunChecks

    config = composed("ea_transformer_lite_iwslt14", override)
    with pytest.raises(SystemExit) as refused:
        RunChecks().on_run_start(config)
    assert str(refused.value).split(": error: ", 1)[1].startswith(message), refused.value


def test_negative_control_fairseq_receives_a_typo_in_a_fixed_section_silently():
    """Without the key check the value reaches fairseq's training unread: the run would train
    with optimization.lr as the config gives it."""
    cfg = job_config(composed("ea_transformer_lite_iwslt14", "+optimization.lrr=0.1"))
    assert cfg.optimization.lrr == 0.1 and list(cfg.optimization.lr) == [0.001]


def test_fairseq_hydra_train_trains_and_its_checkpoint_reloads(tiny_data_bin, tmp_path, monkeypatch):
    """A real ``fairseq-hydra-train`` run of a recipe config (1 update on tiny data): the model
    it trains is fairseq-train's, and its checkpoint rebuilds the same model with the options
    it was trained with (also through fairseq-generate)."""
    save = tmp_path / "ckpt"
    proc = subprocess.run(
        [cli("fairseq-hydra-train"), "--config-dir", CONFIG_DIR, "--config-name", "ea_transformer_lite_iwslt14",
         f"task.data={tiny_data_bin}", "task.source_lang=src", "task.target_lang=tgt",
         f"common.user_dir={os.path.join(REPO, 'ea_fairseq')}", "common.fp16=false", "common.cpu=true",
         "optimization.max_update=1", "dataset.max_tokens=512", "dataset.num_workers=0", f"checkpoint.save_dir={save}",
         "checkpoint.patience=-1", "model.ea_alpha=0.3", "+model.encoder_layers=3"],
        cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = int(re.search(r"num\. shared model params: ([\d,]+)", proc.stderr + proc.stdout).group(1).replace(",", ""))
    dictionary = Dictionary.load(os.path.join(tiny_data_bin, "dict.src.txt"))
    train = building.build_model("ea_transformer_lite", "--share-decoder-input-output-embed", "--dropout", "0.2", "--ea-alpha", "0.3",
                                 "--encoder-layers", "3", dictionary=dictionary)[0]
    assert logged == n_params(train)
    assert (save / "hydra_train.log").exists() and not (tmp_path / "outputs").exists()

    (model,), saved = checkpoint_utils.load_model_ensemble([str(save / "checkpoint_last.pt")])
    assert saved.model.encoder_attention == "ea" and saved.model.ea_alpha == 0.3 and saved.model.ea_beta == 0.1
    # options the config does not list are recorded with the values the model took
    assert saved.model.ea_kernel_size == 3 and saved.model.drop_attention == "none"
    assert signature(model) == signature(train)
    assert {m.alpha for m in model.encoder.modules() if isinstance(m, EvolvingAttention)} == {0.3}
    assert not any(isinstance(m, RecurrentAttention) for m in model.modules())

    # the plugin's tools read its configuration too: a warm start names what it holds
    from ea_fairseq_cli.warm_start import WarmStartError, warm_start

    with pytest.raises(WarmStartError, match="is a checkpoint of --arch ea_transformer_lite with "
                                             "--encoder-attention ea, --decoder-attention ea, --cross-attention ea"):
        warm_start(str(save / "checkpoint_last.pt"), "ea_transformer_lite")

    # fairseq-generate's console entry point, in-process (a fresh fairseq-generate process
    # loading a checkpoint through --user-dir: test_cli_end_to_end.py)
    from fairseq_cli import generate

    results = tmp_path / "generated"
    monkeypatch.setattr(sys, "argv", [
        "fairseq-generate", tiny_data_bin, "--user-dir", os.path.join(REPO, "ea_fairseq"),
        "--path", str(save / "checkpoint_last.pt"), "--gen-subset", "valid", "--beam", "2",
        "--max-len-b", "5", "--required-batch-size-multiple", "1", "--cpu", "--results-path", str(results)])
    generate.cli_main()
    assert len(re.findall(r"^H-\d+", (results / "generate-valid.txt").read_text(), re.M)) == 40


# ------------------------------------------------------------ refusals through fairseq-hydra-train
HYDRA_TRAIN_SH = os.path.join(REPO, "examples", "translation", "hydra-train.sh")
NO_CUDA = not torch.cuda.is_available()
TORCH_SEEN = f"torch sees 0 here (torch {torch.__version__}, built for CUDA: {torch.version.cuda or 'none'})"


def hydra_train(name, data, save, *overrides, script=False, env=None, cwd=None):
    """fairseq-hydra-train on a recipe config (or examples/translation/hydra-train.sh with
    ``script``), the tiny data as the task's, every other value the config's."""
    base = ([cli("fairseq-hydra-train"), "--config-dir", CONFIG_DIR, "--config-name", name]
            if not script else ["bash", HYDRA_TRAIN_SH, name])
    run_env = {k: v for k, v in os.environ.items() if k != "EA_FAIRSEQ_SHOW_WARNINGS"}
    run_env.update(PATH=f"{os.path.dirname(cli('python'))}{os.pathsep}{os.environ['PATH']}",
                   OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(
        [*base, f"task.data={data}", "task.source_lang=src", "task.target_lang=tgt",
         f"common.user_dir={os.path.join(REPO, 'ea_fairseq')}", f"checkpoint.save_dir={save}",
         "dataset.num_workers=0", *overrides],
        cwd=cwd or os.path.dirname(str(save)), capture_output=True, text=True, env=run_env, timeout=300)


# the README's example (examples/translation/README.md), as printed
ALPAH = ("fairseq-hydra-train: error: model.ea_alpah: not an option of --arch ea_transformer_lite (did you "
         "mean model.ea_alpha?); `ea-fairseq-options ea_transformer_lite` lists them (option --a-b is key "
         "model.a_b)")


# the plugin's config errors and the CPU cases (fp16, a world size above the GPUs here), each
# message as the run's callback gives it (in-process: the real command takes seconds to start);
# the real command's refusal (one line, exit status 1, no traceback, nothing written) is the
# README's examples (test_the_readme_examples_print_what_the_readme_shows: a model option, and
# a fp16 and world-size refusal), the failed runs below and the unknown key of test_hydra_train_command.py
REFUSALS = [
    ("ea_transformer_lite_iwslt14", ["model.ea_alpha=2"], "--ea-alpha must lie in [0, 1], got 2.0"),
    pytest.param("ea_transformer_lite_iwslt14", [],
                 f"common.fp16=true needs a CUDA GPU, and {TORCH_SEEN}: run with common.fp16=false, or on a CUDA GPU",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="a CUDA GPU is visible")),
    pytest.param("ran_d_wmt14_en_de", ["common.fp16=false"],
                 "distributed_training.distributed_world_size=8 needs 8 CUDA GPUs, "
                 f"and {TORCH_SEEN}: run with distributed_training.distributed_world_size=1 "
                 "(optimization.update_freq=[8] keeps the config's batch), or on 8 CUDA GPUs",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="a CUDA GPU is visible")),
    ("ea_transformer_lite_iwslt14", ["common.cpu=true"],
     "common.fp16=true needs a CUDA GPU, and common.cpu=true trains on the CPU: "
     "run with common.fp16=false, or on a CUDA GPU"),
]


@pytest.mark.parametrize("name, overrides, message", REFUSALS)
def test_the_run_callback_refuses_in_one_line(name, overrides, message, tiny_data_bin, tmp_path):
    from ea_fairseq.hydra_checks import RunChecks

    config = composed(name, f"task.data={tiny_data_bin}", "task.source_lang=src", "task.target_lang=tgt",
                      f"checkpoint.save_dir={tmp_path / 'ckpt'}", *overrides)
    with pytest.raises(SystemExit) as refused:
        RunChecks().on_run_start(config)
    assert str(refused.value).split(": error: ", 1)[1] == message, refused.value
    assert "\n" not in str(refused.value) and not (tmp_path / "ckpt").exists()


@pytest.mark.skipif(not NO_CUDA, reason="a CUDA GPU is visible: the config runs")
def test_without_the_checks_fairseq_asserts_and_leaves_a_directory(tiny_data_bin, tmp_path):
    """Negative control: the same config with the plugin's callback removed from it reaches
    fairseq's own assertion (a traceback), after hydra made the run directory; and
    fairseq-hydra-train itself, without hydra-train.sh's filter, prints the known warnings the
    script leaves out (the README's examples print the refusal alone)."""
    save = tmp_path / "ckpt"
    proc = hydra_train("ran_d_wmt14_en_de", tiny_data_bin, save, "common.fp16=false", "~hydra.callbacks.ea_fairseq")
    assert proc.returncode == 1
    assert "Hydra14MigrationWarning" in proc.stderr, proc.stderr[-3000:]
    assert "world size is 8 but have 0 available devices" in proc.stderr and "Traceback" in proc.stderr
    assert save.is_dir() and not any(p.name.startswith("checkpoint") for p in save.iterdir())


def test_a_failed_run_leaves_no_directory_and_the_script_prints_only_the_refusal(tiny_data_bin, tmp_path):
    """hydra-train.sh: hydra's and torch's known warnings filtered, so the plugin's refusal
    is the only line on stderr; a job that fails inside fairseq (no data) leaves no directory
    holding only hydra's files, and the filter keeps its traceback."""
    # filtered, the refusal is all it prints: the README's examples (test below); unfiltered
    # the warnings are there: the negative control above
    # hydra makes the run directory's parents too (parents=True): they go with it; a data
    # directory that is not there is the plugin's one line, a missing split fairseq's traceback
    nested = tmp_path / "runs" / "iwslt" / "ckpt"
    missing = hydra_train("ea_transformer_lite_iwslt14", str(tmp_path / "no-data"), nested, "common.fp16=false",
                          "common.cpu=true", script=True, cwd=tmp_path)
    assert missing.returncode == 1 and missing.stderr.splitlines() == [
        f"fairseq-hydra-train: error: {tmp_path}/no-data: no such data directory: give the directory "
        "fairseq-preprocess wrote (its --destdir), e.g. data-bin/NAME of the recipes' "
        "examples/translation/prepare-*.sh"], missing.stderr
    assert not (tmp_path / "runs").exists() and tmp_path.is_dir()
    dictionaries = tmp_path / "dictionaries-only"
    dictionaries.mkdir()
    for name in ("dict.src.txt", "dict.tgt.txt"):
        shutil.copy(os.path.join(tiny_data_bin, name), dictionaries)
    no_split = hydra_train("ea_transformer_lite_iwslt14", str(dictionaries), nested, "common.fp16=false",
                           "common.cpu=true", script=True, cwd=tmp_path)
    assert no_split.returncode == 1 and re.search(r"Dataset not found: (valid|train)", no_split.stderr), no_split.stderr
    assert "Traceback" in no_split.stderr and "Warning" not in no_split.stderr
    assert not (tmp_path / "runs").exists()


def test_a_failed_runs_parents_go_only_while_empty(tmp_path):
    """The parents hydra made for a failed run are removed up to the outermost one it made,
    and only while empty: a file another job wrote beside the run keeps its folder."""
    from ea_fairseq.hydra_checks import _outermost_missing, _remove_run_directory

    run_dir = tmp_path / "runs" / "a" / "b" / "ckpt"
    created = _outermost_missing(str(run_dir))
    assert created == str(tmp_path / "runs") and _outermost_missing(str(tmp_path)) is None
    (run_dir / ".hydra").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "other.log").write_text("another job's")
    _remove_run_directory(str(run_dir), created)
    assert sorted(p.name for p in (tmp_path / "runs").rglob("*")) == ["a", "other.log"]


def test_the_readme_examples_print_what_the_readme_shows():
    """examples/translation/README.md's two hydra-train.sh examples, run as written from the
    repository root: stderr is exactly the line the README shows (torch's version as
    installed), and nothing is written."""
    readme = open(os.path.join(REPO, "examples", "translation", "README.md"), encoding="utf-8").read()
    command = re.search(r"```bash\n(bash examples/translation/hydra-train\.sh [^\n]*)\n```\n\n```\n([^\n]*)\n```",
                        readme)
    cpu = re.search(r"without a CUDA GPU, `(bash examples/translation/hydra-train\.sh [^`]*)`\nprints[^\n]*\n\n```\n"
                    r"([^\n]*)\n```", readme)
    assert command.group(2) == ALPAH
    examples = [(command.group(1), command.group(2))]
    if NO_CUDA:
        examples.append((cpu.group(1), re.sub(r"\(torch [^,]*, built for CUDA: [^)]*\)", TORCH_SEEN[len("torch sees 0 here "):],
                                              cpu.group(2))))
    before = set(os.listdir(REPO))
    # the configs' save directories (checkpoints/NAME...), where a checkpoints folder is there already
    checkpoints = os.path.join(REPO, "checkpoints")
    saved_before = set(os.listdir(checkpoints)) if os.path.isdir(checkpoints) else None
    env = {k: v for k, v in os.environ.items() if k != "EA_FAIRSEQ_SHOW_WARNINGS"}
    env["PATH"] = f"{os.path.dirname(cli('python'))}{os.pathsep}{env['PATH']}"
    for line, shown in examples:
        proc = subprocess.run(["bash", "-c", line], cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 1 and proc.stderr.splitlines() == [shown], (line, proc.stderr[-3000:])
    # the test tools' own files, which another pytest-xdist worker may write meanwhile
    tools = {".hypothesis"}
    assert {name for name in set(os.listdir(REPO)) - before
            if name not in tools and not name.startswith(".coverage")} == set()
    if saved_before is not None:
        assert set(os.listdir(checkpoints)) == saved_before
