"""--no-encoder-positional-embeddings / --no-decoder-positional-embeddings (RAN Table 2) on
every architecture, fairseq's transformer included: each removes its own side's
positional embeddings, and nothing else."""
import pytest
import torch
from fairseq.models import ARCH_MODEL_REGISTRY

from conftest import build_model, decoder_out, random_batch
from ea_fairseq.analysis.flops import plugin_architectures
from ea_fairseq.models.baseline import BaselineTransformerModel

TINY = ("--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32",
        "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
        "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--dropout", "0.0",
        "--attention-dropout", "0.0", "--ran-max-positions", "16", "--synthesizer-max-positions", "16")
ARCHS = sorted(set(plugin_architectures()) | {"transformer_lite", "transformer_iwslt_de_en"})
SIDES = ("encoder", "decoder")


def options(arch):
    """TINY, less the plugin's own options on fairseq's transformer (which does not take them)."""
    if ARCH_MODEL_REGISTRY[arch] is BaselineTransformerModel:
        return TINY[:-4]
    return TINY


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("arch", ARCHS)
def test_each_option_removes_its_sides_positions_only(dictionary, arch, side):
    plain, _ = build_model(arch, *options(arch))
    without, _ = build_model(arch, *options(arch), f"--no-{side}-positional-embeddings")
    other = "decoder" if side == "encoder" else "encoder"
    assert getattr(without, side).embed_positions is None
    assert getattr(without, other).embed_positions is not None
    # sinusoidal positions have no parameters: the same parameters, drawn the same
    assert plain.state_dict().keys() == without.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), without.state_dict().values()))
    src, lengths, prev = random_batch(dictionary, [5, 9, 3], 6)
    with_positions = decoder_out(plain, src, lengths, prev)
    output = decoder_out(without, src, lengths, prev)
    assert (output - with_positions).abs().max() > 1e-3  # the positions mattered
    getattr(plain, side).embed_positions = None  # the same model with that side's removed
    assert (output - decoder_out(plain, src, lengths, prev)).abs().max() <= 1e-6


@pytest.mark.parametrize("arch", ["transformer", "ran_all_lite"])
def test_learned_positions_lose_their_sides_parameters(arch):
    learned = ("--encoder-learned-pos", "--decoder-learned-pos")
    plain, _ = build_model(arch, *options(arch), *learned)
    for side in SIDES:
        without, _ = build_model(arch, *options(arch), *learned, f"--no-{side}-positional-embeddings")
        removed = set(plain.state_dict()) - set(without.state_dict())
        assert removed == {f"{side}.embed_positions.weight"}
        assert set(without.state_dict()) <= set(plain.state_dict())


def test_fairseq_transformer_stays_fairseqs_class_without_the_options():
    from fairseq.models.transformer import TransformerModel

    assert type(build_model("transformer", *options("transformer"))[0]) is TransformerModel
    model, _ = build_model("transformer", *options("transformer"), "--no-decoder-positional-embeddings")
    assert isinstance(model, BaselineTransformerModel)
