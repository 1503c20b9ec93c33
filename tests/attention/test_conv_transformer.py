"""PA Table 1's Conv-Transformer and PA-Conv-Transformer (LSRA blocks): each block held to
Lite Transformer's multi-branch equation (and PA Eq. 4 on the attention half), re-implemented
here from the modules' parameters, on models built by fairseq's path; parameter counts by
formula; refused combinations. (Causality, incremental decoding, batch invariance, alone and
combined with other mechanisms: test_decoding_properties.py.)"""
import pytest
import torch
import torch.nn.functional as F

from conftest import build_model, decoder_out, random_batch
from ea_fairseq.analysis.flops import count_model, non_embedding_params
from ea_fairseq.modules.long_short_range_attention import LITE_KERNEL_SIZES, LongShortRangeAttention
from support.attention_calls import recorded_attention_calls
from support.families import FAMILIES
from support.paper_equations import attend, dot_product_logits, heads, masked_softmax

TINY = ("--encoder-layers", "2", "--decoder-layers", "2", "--dropout", "0.0", "--attention-dropout", "0.0",
        "--lsra-weight-dropout", "0.0")
THREE = TINY + ("--encoder-layers", "3", "--decoder-layers", "3")
LENGTHS = [4, 9, 6]
#: LSRA's archs (families.py), each at its arch's defaults here
LSRA_ARCHS = [FAMILIES[name].arch for name in ("conv-transformer-lite", "pa-conv-transformer-lite")]
# fairseq's attention and its lightweight convolution take their softmax (of the attention
# weights, of the kernels) in float32 even in a float64 model: ~1e-7 from the float64
# reference; a wrong tap, split or mask moves outputs by ~0.1.
GAP = 1e-6


def lightweight_conv(branch, x, causal):
    """Lite Transformer's conv branch on one unpadded sentence x (T, 1, C): input linear,
    depthwise convolution over time with one softmax-normalised kernel per head (zero border;
    centred, or causal in the decoder), output linear."""
    y = x @ branch.linear_in.weight.T + branch.linear_in.bias  # (T, 1, C)
    channels, k, h = y.size(-1), branch.kernel_size, branch.num_heads
    kernel = branch.weight.view(h, k).softmax(-1).repeat_interleave(channels // h, 0)  # (C, K)
    left = k - 1 if causal else k // 2
    seq = F.pad(y.permute(1, 2, 0), (left, k - 1 - left))  # (1, C, T + K - 1)
    out = F.conv1d(seq, kernel.unsqueeze(1), groups=channels).permute(2, 0, 1)
    return out @ branch.linear_out.weight.T + branch.linear_out.bias


def pa_logits(attn, query, key, previous, alpha):
    """PA Eq. 4 on one unpadded sentence: α·ReLU(Conv3x3(previous)) + (1−α)·QK^T/sqrt(d)."""
    current = dot_product_logits(attn, query, key)
    if previous is None:
        return current
    conv = attn.predictor[0]
    prediction = F.relu(F.conv2d(previous, conv.weight, conv.bias, padding=1))
    return alpha * prediction + (1 - alpha) * current


@pytest.mark.parametrize("arch", LSRA_ARCHS)
def test_blocks_follow_the_multi_branch_equation(dictionary, arch):
    """LSRA(X) = [Attention(X[:, :d/2]) ; W_out LightConv(W_in X[:, d/2:])], each sentence
    alone (no padding); PA-Conv: the encoder's attention half follows PA Eq. 4 with the
    previous block's logits (α = 0.1, the arch's default)."""
    model, _ = build_model(arch, *THREE)
    model.double()
    stacks = [("encoder.self", [l.self_attn for l in model.encoder.layers], False),
              ("decoder.self", [l.self_attn for l in model.decoder.layers], True)]
    assert all(isinstance(b, LongShortRangeAttention) for _, chain, _ in stacks for b in chain)
    src, lengths, prev = random_batch(dictionary, LENGTHS, 7)
    with recorded_attention_calls(model) as calls:
        decoder_out(model, src, lengths, prev)
    pa = arch.startswith("pa_")
    worst = 0.0
    for kind, chain, causal in stacks:
        for i, n in enumerate(lengths.tolist()):
            previous = None
            for index, block in enumerate(chain):
                assert block.conv.kernel_size == LITE_KERNEL_SIZES[index]
                query, _, _, output = calls[kind][index]
                rows = slice(None) if causal else slice(-n, None)
                x, out = query[rows, i:i + 1], output[rows, i:i + 1]
                half, attn = x.size(-1) // 2, block.attention
                if pa and not causal:
                    logits = pa_logits(attn, x[..., :half], x[..., :half], previous, 0.1)
                    previous = logits
                else:
                    logits = dot_product_logits(attn, x[..., :half], x[..., :half])
                weights = masked_softmax(logits, causal=causal)
                expected = torch.cat([
                    attend(attn, weights, heads(x[..., :half], attn.v_proj, attn.num_heads)),
                    lightweight_conv(block.conv, x[..., half:], causal),
                ], dim=-1)
                worst = max(worst, (expected - out).abs().max().item())
    assert worst <= GAP


def attention_parameters(width):
    return 4 * (width * width + width)  # q, k, v, out projections with biases


@pytest.mark.parametrize("arch", LSRA_ARCHS)
def test_parameter_count_is_lite_transformers_formula(arch):
    """Per block, LSRA replaces the d-wide self-attention (4(d²+d)) by a d/2-wide one
    (4((d/2)²+d/2)) plus the conv branch: two d/2 x d/2 linears with biases and one kernel of
    size k per head (H·k); PA-Conv adds 5 predictors (4x4 heads, 3x3, biases)."""
    model, _ = build_model(arch)
    vanilla, _ = build_model("transformer_lite")
    d, h, half = 160, 4, 80
    per_kernel = [attention_parameters(half) + 2 * (half * half + half) + h * k for k in LITE_KERNEL_SIZES]
    expected = non_embedding_params(vanilla) - 12 * attention_parameters(d) + 2 * sum(per_kernel)
    if arch.startswith("pa_"):
        expected += 5 * (h * h * 9 + h)
    assert non_embedding_params(model) == expected
    assert non_embedding_params(model) == (1_713_584 if arch == "conv_transformer_lite" else 1_714_324)


@pytest.mark.parametrize("arch", LSRA_ARCHS + [FAMILIES["resformer-lite"].arch])
def test_flops_counter_covers_the_archs(arch):
    """Every module with parameters is counted; the convolution branch is k MACs per channel
    and position, its linears d/2 x d/2 each; ResFormer's mix two products per value element
    in every layer but the first."""
    full = count_model(build_model(arch)[0], 30, 30)
    assert not full.uncounted
    if arch == "resformer_lite":
        plain = count_model(build_model("transformer_lite")[0], 30, 30)
        assert full.total["elementwise"] - plain.total["elementwise"] == 2 * 5 * 2 * 30 * 160
    else:
        assert full.total["sequence_conv"] == 2 * 30 * 80 * sum(LITE_KERNEL_SIZES)


def test_kernel_size_list_is_extended_with_its_last(dictionary):
    model, _ = build_model("conv_transformer_lite", "--encoder-layers", "3", "--lsra-kernel-sizes", "5", "9")
    assert [l.self_attn.conv.kernel_size for l in model.encoder.layers] == [5, 9, 9]
    assert model.decoder.layers[0].self_attn.conv.padding_l == 4  # causal: k - 1


@pytest.mark.parametrize("options, message", [
    (("--encoder-attention", "ran"), "does not build at half the width"),
    (("--encoder-embed-dim", "164"), "divisible by twice the heads"),
    (("--cross-self-attention",), "--cross-self-attention"),
])
def test_impossible_combinations_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        build_model("conv_transformer_lite", *options)


def test_lsra_is_for_self_attention(capsys):
    with pytest.raises(SystemExit):
        build_model("conv_transformer_lite", "--lsra-on", "cross")
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("sizes", [[], [0, 3]])
def test_a_checkpoints_kernel_sizes_are_checked(sizes):
    """argparse refuses these; a checkpoint's configuration gets the same clear error."""
    from types import SimpleNamespace

    from fairseq.models import ARCH_MODEL_REGISTRY

    from conftest import make_dictionary, parse

    args = parse("conv_transformer_lite", "--encoder-layers", "1", "--decoder-layers", "1")
    args.lsra_kernel_sizes = sizes
    d = make_dictionary()
    with pytest.raises(ValueError, match="--lsra-kernel-sizes must list positive sizes"):
        ARCH_MODEL_REGISTRY[args.arch].build_model(args, SimpleNamespace(source_dictionary=d, target_dictionary=d))
