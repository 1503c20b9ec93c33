"""Every checkpoint fairseq's trainer writes loads and translates through every entry point.

The checkpoints are written by fairseq-train's own ``main`` (in process, one update of tiny
models, the options parsed and converted as the command line does): each precision layout
with Adam, each optimizer fairseq ships that runs on a CPU in float32 and in ``--fp16``'s
layout, ``--store-ema``, a resumed run (``--restore-file``, optimizer state read back by
fairseq) and one resumed with ``--reset-optimizer``, no optimizer state; fairseq's
``transformer`` beside the plugin's EA and RAN. Each goes through fairseq-generate,
fairseq-interactive, the hub, ``ea-fairseq-average-checkpoints``, the warm start and
``ea-fairseq-analysis dump``; the fp16 layout that a GPU run writes goes through the real
``fairseq-generate`` command as well. What generation does not use (the optimizer state) is
only bounded: the negative controls are refused in one line through fairseq-generate's loader.

``--fp16`` keeps one flat float32 master copy of the parameters, and its Adam state is then one
flat tensor (``FP16Optimizer.build_fp32_params``). fairseq builds it on
``torch.cuda.current_device()``; here that call answers the CPU's device index (None, what
``p.device.index`` is for the CPU parameters it flattens), so that fairseq's own code builds the
layout it builds on a GPU: one flat tensor per device, the optimizer's state indexed 0, the
loss scale beside it. Adafactor and Adagrad do not take flat parameters (fairseq refuses
``--fp16`` with them unless ``--fp16-no-flatten-grads``), so their fp16 layout is that one.
"""
import copy
import os
import re
import subprocess

import pytest
import torch
from fairseq import distributed_utils, options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.models.transformer import TransformerModel
from fairseq.optim import OPTIMIZER_REGISTRY
from fairseq_cli import generate, interactive, train

from ea_fairseq.safety.no_code import CheckpointError
from ea_fairseq.safety.no_code.consistency import LIMIT_OPTIMIZER_FACTOR, LIMIT_OPTIMIZER_SLACK
from ea_fairseq_cli import analysis, average_checkpoints, warm_start

from conftest import cli
from support.trained_checkpoints import ENV, USER_DIR

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
        "--encoder-ffn-embed-dim", "16", "--decoder-ffn-embed-dim", "16", "--encoder-attention-heads", "2",
        "--decoder-attention-heads", "2", "--share-all-embeddings"]
ARCHS = {"transformer": ("transformer",), "ea": ("ea_transformer_lite",),
         "ran": ("ran_all_lite", "--ran-max-positions", "32")}
PRECISIONS = {"fp32": (), "fp16": ("--fp16",), "fp16-no-flatten": ("--fp16", "--fp16-no-flatten-grads"),
              "memory-efficient-fp16": ("--memory-efficient-fp16",), "bf16": ("--bf16",), "amp": ("--amp",)}
OPTIMIZER_OPTIONS = {"sgd": ("--momentum", "0.9")}  # (without momentum, SGD keeps no state)
FLAT = ("adam", "nag", "sgd", "adadelta", "adamax")  # the optimizers that take fp16's flat parameters
#: name -> (arch, precision, optimizer, more options)
CASES = {
    **{f"{p}-adam-transformer": ("transformer", p, "adam", ()) for p in PRECISIONS},
    **{f"fp32-{o}-transformer": ("transformer", "fp32", o, ())
       for o in ("adafactor", "nag", "sgd", "adagrad", "adadelta", "adamax")},
    **{f"fp16-{o}-transformer": ("transformer", "fp16", o, ()) for o in FLAT[1:]},
    **{f"fp16-no-flatten-{o}-transformer": ("transformer", "fp16-no-flatten", o, ()) for o in ("adafactor", "adagrad")},
    "fp16-adam-transformer-ema": ("transformer", "fp16", "adam", ("--store-ema", "--ema-fp32")),
    "fp32-adam-transformer-no-optimizer-state": ("transformer", "fp32", "adam", ("--no-save-optimizer-state",)),
    "fp16-adam-ea": ("ea", "fp16", "adam", ()),
    "fp32-adafactor-ea": ("ea", "fp32", "adafactor", ()),
    "bf16-adam-ea": ("ea", "bf16", "adam", ()),
    "fp16-adam-ran": ("ran", "fp16", "adam", ()),
}
#: resumed (--restore-file) from the fp16 Adam run: fairseq reads its optimizer state back, or
#: (--reset-optimizer) starts another optimizer in another precision
RESUMED = {"fp16-adam-transformer-resumed": ("transformer", "fp16", "adam", ()),
           "fp32-adafactor-transformer-reset-optimizer": ("transformer", "fp32", "adafactor", ("--reset-optimizer",))}
ALL = list(CASES) + list(RESUMED)


def train_argv(data, save, arch, precision, optimizer, *extra):
    return [data, "--user-dir", USER_DIR, "--arch", *ARCHS[arch], *TINY, *PRECISIONS[precision], "--optimizer",
            optimizer, *OPTIMIZER_OPTIONS.get(optimizer, ()), *extra, "--lr", "1e-3", "--max-tokens", "200",
            "--max-update", "1", "--save-dir", str(save), "--no-epoch-checkpoints", "--disable-validation", "--cpu",
            "--num-workers", "0", "--no-progress-bar", "--seed", "3"]


def fairseq_train(argv):
    """fairseq-train's main on ``argv``, parsed and converted as its command line does."""
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    if args.bf16:
        args.tpu = False  # fairseq's parser makes --bf16 imply --tpu (tests/drivers/train_bf16_without_tpu.py)
    distributed_utils.call_main(convert_namespace_to_omegaconf(args), train.main)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_data_bin):
    """case -> checkpoint_last.pt written by fairseq-train's main."""
    root = tmp_path_factory.mktemp("trainer")
    paths = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "current_device", lambda: None)  # the CPU's device index (module docstring)
        for name, (arch, precision, optimizer, extra) in CASES.items():
            fairseq_train(train_argv(tiny_data_bin, root / name, arch, precision, optimizer, *extra))
            paths[name] = root / name / "checkpoint_last.pt"
        for name, (arch, precision, optimizer, extra) in RESUMED.items():
            fairseq_train(train_argv(tiny_data_bin, root / name, arch, precision, optimizer, *extra, "--restore-file",
                                     str(paths["fp16-adam-transformer"]), "--max-update", "2"))
            paths[name] = root / name / "checkpoint_last.pt"
    return paths


def flat_master(optim) -> bool:
    """The optimizer holds one parameter: fp16's flat float32 master copy of all of them."""
    return [p for group in optim["param_groups"] for p in group["params"]] == [0]


def optimizer_named(precision, optimizer) -> str:
    wrapper = {"fp32": None, "amp": "AMPOptimizer", "memory-efficient-fp16": "MemoryEfficientFP16Optimizer"}
    return wrapper.get(precision, "FP16Optimizer") or OPTIMIZER_REGISTRY[optimizer].__name__


@pytest.mark.parametrize("case", ALL)
def test_the_layouts_are_fairseqs(checkpoints, case):
    """What each case wrote is the layout it stands for (so the matrix covers what it names)."""
    arch, precision, optimizer, extra = CASES.get(case) or RESUMED[case]
    state = torch.load(checkpoints[case], weights_only=False)  # written here, by fairseq
    history = [h["optimizer_name"] for h in state["optimizer_history"]]
    assert history == ["FP16Optimizer"] * (case in RESUMED) + [optimizer_named(precision, optimizer)]
    assert state["optimizer_history"][-1]["num_updates"] >= 1
    assert state["model"]["encoder.embed_tokens.weight"].dtype == torch.float32  # (fairseq saves 16-bit ones so)
    if "--no-save-optimizer-state" in extra:
        assert "last_optimizer_state" not in state
        return
    optim = state["last_optimizer_state"]
    assert optim["state"], "no optimizer state: the updates did not run"
    assert ("loss_scale" in optim) == (precision in ("fp16", "fp16-no-flatten", "memory-efficient-fp16"))
    assert flat_master(optim) == (precision == "fp16" and optimizer in FLAT)
    if flat_master(optim) and optimizer == "adam" and arch == "transformer":  # one tensor: all of fp32's
        fp32 = torch.load(checkpoints["fp32-adam-transformer"], weights_only=False)["last_optimizer_state"]["state"]
        assert optim["state"][0]["exp_avg"].shape == (sum(slots["exp_avg"].numel() for slots in fp32.values()),)
    if optimizer == "adafactor":
        assert any("exp_avg_sq_row" in slots for slots in optim["state"].values())  # factored moments
    if "--store-ema" in extra:
        assert set(state["extra_state"]["ema"]) == set(state["model"]) and state["extra_state"]["ema_fp32_params"]


@pytest.fixture(scope="module")
def configurations(tiny_data_bin):
    """fairseq-generate's and fairseq-interactive's configurations, converted once as their
    command lines convert them; each test sets the checkpoint (and the output or input file)."""
    decode = ["--user-dir", USER_DIR, "--path", "-", "--beam", "2", "--max-len-a", "0", "--max-len-b", "4", "--cpu"]
    return {
        "generate": convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_generation_parser(), [
            tiny_data_bin, *decode, "--batch-size", "24", "--num-workers", "0"])),
        "interactive": convert_namespace_to_omegaconf(options.parse_args_and_arch(
            options.get_interactive_generation_parser(), [tiny_data_bin, *decode, "--source-lang", "src",
                                                          "--target-lang", "tgt"]))}


def fairseq_generate(configurations, path, results):
    """fairseq-generate's main on ``path``: the scores of its hypotheses."""
    cfg = copy.deepcopy(configurations["generate"])
    cfg.common_eval.path, cfg.common_eval.results_path = str(path), str(results)
    generate.main(cfg)
    with open(os.path.join(results, "generate-test.txt")) as f:
        return re.findall(r"^H-\d+\t(\S+)\t", f.read(), flags=re.M)


@pytest.mark.parametrize("case", ALL)
def test_fairseq_generate(checkpoints, configurations, tmp_path, case):
    scores = fairseq_generate(configurations, checkpoints[case], tmp_path)
    assert len(scores) == 24 and all(float(s) < 0 for s in scores)  # every test sentence translated


@pytest.mark.parametrize("case", ALL)
def test_fairseq_interactive(checkpoints, configurations, tmp_path, capsys, case):
    (tmp_path / "in.txt").write_text("s1 s2 s3\ns4 s5\n")
    cfg = copy.deepcopy(configurations["interactive"])
    cfg.common_eval.path, cfg.interactive.input = str(checkpoints[case]), str(tmp_path / "in.txt")
    capsys.readouterr()
    interactive.main(cfg)
    assert sorted(re.findall(r"^H-(\d+)\t", capsys.readouterr().out, flags=re.M)) == ["0", "1"]


@pytest.mark.parametrize("case", ALL)
def test_hub(checkpoints, tiny_data_bin, case):
    path = checkpoints[case]
    hub = TransformerModel.from_pretrained(str(path.parent), checkpoint_file=path.name,
                                           data_name_or_path=tiny_data_bin, user_dir=USER_DIR)
    assert all(hub.translate(["s1 s2 s3", "s4 s5"], beam=2, max_len_a=0, max_len_b=4))


@pytest.mark.parametrize("case", ALL)
def test_averaging_warm_start_and_analysis(checkpoints, tiny_data_bin, tmp_path, capsys, case):
    """The plugin's tools: averaged (the optimizer state carried over, as fairseq's script does),
    warm-started (a vanilla checkpoint; the plugin's own archs are told they are not one, after
    they loaded) and dumped by the analysis tool."""
    path = checkpoints[case]
    assert average_checkpoints.main(["--inputs", str(path), "--output", str(tmp_path / "avg.pt")]) == 0
    averaged, written = (torch.load(p, weights_only=False) for p in (tmp_path / "avg.pt", path))
    assert averaged.get("last_optimizer_state", {}).keys() == written.get("last_optimizer_state", {}).keys()
    vanilla = (CASES.get(case) or RESUMED[case])[0] == "transformer"
    code = warm_start.main([str(path), "--arch", "ea_transformer_lite", "--output", str(tmp_path / "warm.pt")])
    assert code == (0 if vanilla else 1) and (tmp_path / "warm.pt").exists() == vanilla
    assert vanilla or "a warm start takes a vanilla checkpoint" in capsys.readouterr().err
    assert analysis.main(["dump", str(path), "--data", tiny_data_bin, "--split", "test", "--ids", "0",
                          "--out", str(tmp_path / "maps.npz")]) == 0
    assert (tmp_path / "maps.npz").stat().st_size > 0


def test_gpu_failure_replayed_through_the_fairseq_generate_command(checkpoints, tiny_data_bin):
    """``fairseq-train --fp16`` on a GPU, then ``fairseq-generate``: the checkpoint's Adam state
    is one flat tensor over all the parameters, and the command translates with it."""
    path = checkpoints["fp16-adam-transformer"]
    assert flat_master(torch.load(path, weights_only=False)["last_optimizer_state"])
    proc = subprocess.run([cli("fairseq-generate"), tiny_data_bin, "--user-dir", USER_DIR, "--path", str(path),
                           "--beam", "2", "--max-len-a", "0", "--max-len-b", "4", "--batch-size", "24", "--cpu",
                           "--num-workers", "0"], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(re.findall(r"^H-\d+\t", proc.stdout, flags=re.M)) == 24


def hostile(src, dst, change):
    state = torch.load(src, weights_only=False)
    change(state["last_optimizer_state"], state)
    torch.save(state, dst)
    return dst


def larger_than_any_optimizer_keeps(optim, state):
    weights = sum(v.numel() for v in state["model"].values())
    optim["state"][0]["exp_avg_sq"] = torch.zeros(LIMIT_OPTIMIZER_FACTOR * weights + LIMIT_OPTIMIZER_SLACK)


@pytest.mark.parametrize("change,message", [
    (larger_than_any_optimizer_keeps, r"last_optimizer_state holds more than \d+ numbers \(4 x the \d+ of its "
                                      r"weights \+ 1048576\); fairseq's optimizers keep at most 3 per weight"),
    (lambda optim, state: optim["state"][0].update(exp_avg=torch.zeros(3, dtype=torch.complex64)),
     r"last_optimizer_state\['state'\]\[0\]\['exp_avg'\] is a torch.complex64 tensor; an optimizer's state "
     "holds real numbers"),
    (lambda optim, state: optim["state"][0].update(exp_avg=torch.empty(1 << 40, device="meta")),
     r"\['last_optimizer_state'\]\['state'\]\[0\]\['exp_avg'\]: a tensor on the meta device"),
], ids=["larger-than-any-optimizer-keeps", "not-real-numbers", "a-shape-without-data"])
def test_unsafe_optimizer_state_is_refused_by_fairseq_generate(checkpoints, configurations, tmp_path, change,
                                                               message):
    """Negative controls: the bound bites, in one line, before fairseq builds anything; the same
    file with its optimizer state as fairseq wrote it translates (test_fairseq_generate)."""
    path = hostile(checkpoints["fp16-adam-transformer"], tmp_path / "c.pt", change)
    with pytest.raises(CheckpointError, match=message) as refused:
        fairseq_generate(configurations, path, tmp_path)
    assert "\n" not in str(refused.value) and str(refused.value).startswith(f"{path}: refused: ")
