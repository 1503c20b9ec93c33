"""On a CUDA device: the exactness suite in float32, float16 and bfloat16 (cast models) for
EA-Lite, PA and RAN-ALL-Lite, EA's map convolution through public ops only, and every
architecture through fairseq-train (--fp16, --bf16) and fairseq-generate --fp16."""
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from fairseq.sequence_generator import SequenceGenerator

from conftest import (randomize_convs, REPO, batch_invariance_gap, beam_reorder_gap, build_model, causality_gap, cli,
                      decoder_out, incremental_logprobs, random_batch)
from ea_fairseq.modules import AttentionMapConv

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device: the GPU suite (exactness in fp32/fp16/bf16, "
                              "fairseq-train --fp16/--bf16, fairseq-generate --fp16) needs one"),
]

DEVICE = "cuda"
SMALL = ("--encoder-layers", "2", "--decoder-layers", "2", "--dropout", "0.0",
         "--attention-dropout", "0.0")
# every mechanism strong enough that a leak or a stale cache visibly moves the output
ARCHS = {
    "ea": ("ea_transformer_lite", ("--ea-alpha", "0.5", "--ea-beta", "0.5", "--ea-decoder-alpha", "0.3")),
    "pa": ("pa_transformer_lite", ("--pa-alpha", "0.5")),
    "ran-all": ("ran_all_lite", ("--ran-max-positions", "32")),
    "hcsa": ("hcsa_lite", ()),
    "syn-r": ("syn_r_lite", ("--synthesizer-max-positions", "32")),
}
# Largest |difference| between two computations of the same logits or log-probs.
# float32: TF32 is switched off below; GPU kernels still pick a reduction order per shape
# (one decoding step vs a full pass, one sentence vs a padded batch), which moves float32
# logits by ~1e-6 -- 1e-4 leaves room and still catches any cache or reorder bug (~1).
# bfloat16/float16: the bounds of test_precision.py, not measured on a GPU; these very
# models cast on CPU gave at most 0.031 (bf16) and 0.0039 (fp16) in every check below
# (incremental, reorders, batch invariance, reduction to vanilla), and GPU matmuls round
# to the same formats and accumulate in float32 as well.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 0.02, torch.bfloat16: 0.1}
# positions before t do not depend on later tokens at all: 0 up to float32 noise
CAUSAL = {torch.float32: 1e-6, torch.float16: 0.02, torch.bfloat16: 0.1}
# EA/PA switched off vs fairseq's transformer: float64 as on CPU (test_ea_exactness.py)
REDUCTION = {torch.float64: 1e-6, **TOLERANCE}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                                 ids=["fp32", "fp16", "bf16"])
ARCH = pytest.mark.parametrize("arch", list(ARCHS))


@pytest.fixture(autouse=True)
def exact_float32():
    """float32 means float32: no TF32 in matmuls or in cuDNN's (EA's, PA's) convolutions."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = matmul
    torch.backends.cudnn.allow_tf32 = cudnn


def cuda_model(arch, dtype, *extra):
    name, options = ARCHS[arch]
    model, _ = build_model(name, *SMALL, *options, *extra)
    randomize_convs(model)
    return model.to(device=DEVICE, dtype=dtype).eval()


# -- exactness --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp64", "fp32", "fp16", "bf16"])
@pytest.mark.parametrize("arch,off", [
    ("ea", ("--ea-alpha", "0", "--ea-beta", "0", "--ea-decoder-alpha", "0", "--ea-no-encoder-conv",
            "--ea-no-decoder-conv", "--ea-no-cross-conv")),
    ("pa", ("--pa-alpha", "0")),
], ids=["ea", "pa"])  # RAN has no query/key projections: no vanilla model to reduce to
def test_switched_off_equals_fairseq_transformer(dictionary, arch, off, dtype):
    """Same weights, same output as fairseq's own TransformerModel on the GPU (whose
    self-attention takes torch's fused attention kernels there)."""
    name, _ = ARCHS[arch]
    model, _ = build_model(name, *SMALL, *off)
    vanilla, _ = build_model("transformer_lite", *SMALL)
    missing, unexpected = model.load_state_dict(vanilla.state_dict(), strict=False)
    assert not unexpected and all(".predictor." in k for k in missing)
    model.to(device=DEVICE, dtype=dtype), vanilla.to(device=DEVICE, dtype=dtype)
    src, lengths, prev = random_batch(dictionary, [7, 4, 9], 6, device=DEVICE)
    gap = (decoder_out(model, src, lengths, prev) - decoder_out(vanilla, src, lengths, prev)).abs().max().item()
    assert gap <= REDUCTION[dtype], gap


@DTYPES
@ARCH
def test_decoder_is_causal(dictionary, arch, dtype):
    model = cuda_model(arch, dtype)
    for t in (1, 4, 9):
        before, at = causality_gap(model, dictionary, t, device=DEVICE)
        assert before <= CAUSAL[dtype], f"positions before {t} saw the future ({before})"
        assert at > max(1e-3, 5 * TOLERANCE[dtype]), f"position {t} did not see itself ({at})"


@DTYPES
@ARCH
def test_incremental_equals_full_pass_with_beam_reorders(dictionary, arch, dtype):
    model = cuda_model(arch, dtype)
    src, lengths, prev = random_batch(dictionary, [5, 9, 3, 7], 8, device=DEVICE)
    full = decoder_out(model, src, lengths, prev)
    steps, _ = incremental_logprobs(model, src, lengths, prev)
    gaps = {"in order": (steps.float() - full.float()).abs().max().item()}
    for name, order in (("reorder", [1, 1, 3, 2]), ("sentence-finished", [3, 2]),
                        ("two-reorders-before-a-step", [[1, 1, 3, 2], [1, 0, 2, 2]])):
        gaps[name] = beam_reorder_gap(model, dictionary, order, device=DEVICE)
    assert all(gap <= TOLERANCE[dtype] for gap in gaps.values()), gaps


@DTYPES
@ARCH
def test_batch_invariance_with_left_padding(dictionary, arch, dtype):
    model = cuda_model(arch, dtype)
    assert batch_invariance_gap(model, dictionary, device=DEVICE) <= TOLERANCE[dtype]


def beam_search_equals_teacher_forcing(model, dictionary, tolerance, autocast_dtype=None):
    """Beam 5 through fairseq's SequenceGenerator; every hypothesis' per-token scores must
    be a teacher-forced full pass's (under the same autocast, if any)."""
    def context():
        if autocast_dtype is None:
            return torch.no_grad()
        return torch.autocast(DEVICE, dtype=autocast_dtype)

    src, lengths, _ = random_batch(dictionary, [6, 9, 4], 1, device=DEVICE)
    generator = SequenceGenerator([model], dictionary, beam_size=5, max_len_b=12)
    with torch.no_grad(), context():
        hypos = generator.forward({"net_input": {"src_tokens": src, "src_lengths": lengths}})
        checked = 0
        for i, sentence in enumerate(hypos):
            assert len(sentence) == 5
            n = lengths[i].item()
            for h in sentence:
                assert torch.isfinite(h["positional_scores"]).all()
                tokens = h["tokens"].unsqueeze(0)
                prev = torch.cat([tokens.new_tensor([[dictionary.eos()]]), tokens[:, :-1]], 1)
                logits = model(src[i : i + 1, -n:], lengths[i : i + 1], prev)[0]
                lprobs = F.log_softmax(logits.float(), -1).gather(-1, tokens.unsqueeze(-1))[0, :, 0]
                assert (lprobs - h["positional_scores"]).abs().max().item() <= tolerance
                checked += 1
    assert checked == 15


@DTYPES
@ARCH
def test_beam_search_scores_equal_teacher_forcing(dictionary, arch, dtype):
    beam_search_equals_teacher_forcing(cuda_model(arch, dtype), dictionary, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_ea_beam_search_under_autocast(dictionary, dtype):
    """A float32 EA model decoding under CUDA autocast (on CPU this raised 'expected
    scalar type BFloat16 but found Float' in the incremental map convolution)."""
    beam_search_equals_teacher_forcing(cuda_model("ea", torch.float32), dictionary, TOLERANCE[dtype],
                                       autocast_dtype=dtype)


@DTYPES
def test_ea_map_convolution_is_one_public_conv2d_per_attention_and_step(dictionary, monkeypatch, dtype):
    """EA's map convolutions on CUDA go through ``F.conv2d`` (cuDNN, autocast-aware), one
    call per attention in a full pass and per attention and step in decoding; ATen's
    private direct convolutions (``torch._C._nn.thnn_conv2d`` and kin: slow im2col kernels
    on CUDA, outside autocast) are never called."""
    from ea_fairseq.modules import attention_map_conv

    def refuse(name):
        def private(*args, **kwargs):
            raise AssertionError(f"EA's map convolution called the private ATen op {name} on CUDA")
        return private

    private_ops = {name: getattr(torch._C._nn, name) for name in dir(torch._C._nn)
                   if "conv" in name and name.startswith(("thnn_", "slow_"))}
    for name, op in private_ops.items():
        monkeypatch.setattr(torch._C._nn, name, refuse(name))
    for name, value in list(vars(attention_map_conv).items()):  # an op bound at import
        if any(value is op for op in private_ops.values()):
            monkeypatch.setattr(attention_map_conv, name, refuse(f"{name} (torch._C._nn)"))

    model = cuda_model("ea", dtype)
    active, calls = [], []  # the AttentionMapConv running now; F.conv2d's calls

    def enter(module, inputs):
        active.append(module)

    def leave(module, inputs, output):
        active.pop()

    for m in model.modules():
        if isinstance(m, AttentionMapConv):
            m.register_forward_pre_hook(enter)
            m.register_forward_hook(leave)
    public = F.conv2d

    def counted(input, weight, *args, **kwargs):
        calls.append((active[-1] if active else None, input.device.type, input.dtype))
        return public(input, weight, *args, **kwargs)

    monkeypatch.setattr(F, "conv2d", counted)

    def callers():
        assert all(device == DEVICE and dt == dtype for _, device, dt in calls), calls
        found = sorted(id(m) for m, _, _ in calls)
        calls.clear()
        return found

    encoder_convs = sorted(id(m) for m in model.encoder.modules() if isinstance(m, AttentionMapConv))
    decoder_convs = sorted(id(m) for m in model.decoder.modules() if isinstance(m, AttentionMapConv))
    assert len(encoder_convs) == 2 and len(decoder_convs) == 4
    src, lengths, prev = random_batch(dictionary, [5, 9], 6, device=DEVICE)
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=lengths)
        assert callers() == encoder_convs
        state = {}
        for t in range(prev.size(1)):
            if t == 3:  # a beam reorder between steps
                order = torch.tensor([1, 0], device=DEVICE)
                model.decoder.reorder_incremental_state_scripting(state, order)
                encoder_out = model.encoder.reorder_encoder_out(encoder_out, order)
                prev = prev.index_select(0, order)
            model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
            assert callers() == decoder_convs, f"decoding step {t}"


# -- command-line tools -----------------------------------------------------------------
TINY = ["--encoder-layers", "2", "--decoder-layers", "2"]
CASES = {
    "transformer_lite": [],
    "ea_transformer_lite": [],
    "ea_transformer_lite+dropattention": ["--drop-attention", "element", "--drop-attention-p", "0.3"],
    "pa_transformer_lite": [],
    "ran_e_lite": [],
    "ran_d_lite": [],
    "ran_all_lite": [],
    "hcsa_lite": [],
    "syn_r_lite": [],
}
# fairseq's parser makes --bf16 imply --tpu (torch_xla); this driver runs fairseq-train's
# own --bf16 path on the GPU instead (see its docstring)
BF16_TRAIN = [sys.executable, os.path.join(REPO, "tests", "drivers", "train_bf16_without_tpu.py")]


def run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_train_and_generate_in_low_precision(tmp_path, tiny_data_bin, case, precision):
    arch = case.split("+")[0]
    save = str(tmp_path / "ckpt")
    user_dir = os.path.join(REPO, "ea_fairseq")
    train = [cli("fairseq-train")] if precision == "fp16" else BF16_TRAIN
    log = run([
        *train, tiny_data_bin, "--user-dir", user_dir, "--arch", arch, *TINY, *CASES[case],
        "--share-all-embeddings", "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--lr", "1e-3",
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--max-tokens", "600", "--max-update", "3", "--no-epoch-checkpoints", "--save-dir", save,
        "--num-workers", "0", "--no-progress-bar", "--log-format", "simple", "--log-interval", "1",
        "--seed", "3", f"--{precision}",
    ])
    assert "done training" in log
    losses = re.findall(r"\bloss[= ]([-+]?(?:\d[\d.e+-]*|nan|inf))", log)  # not "loss scale"
    assert losses and all(math.isfinite(float(x)) for x in losses), losses
    out = run([
        cli("fairseq-generate"), tiny_data_bin, "--user-dir", user_dir,
        "--path", os.path.join(save, "checkpoint_last.pt"), "--fp16", "--beam", "5",
        "--required-batch-size-multiple", "1", "--max-tokens", "2000", "--num-workers", "0",
    ])
    assert re.search(r"Generate test with beam=5: BLEU4 = \d+\.\d+", out), out[-2000:]
    scores = re.findall(r"^H-\d+\t(\S+)\t", out, flags=re.M)
    assert len(scores) == 24  # every test sentence translated
    assert all(math.isfinite(float(s)) for s in scores), scores
