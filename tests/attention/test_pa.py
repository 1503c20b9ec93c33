"""PA-Transformer (predictive attention): Eq. 4, the encoder only. (Padding, the decoding
properties, the reduction to fairseq's transformer at α = 0 and the prediction
convolutions' parameters: test_decoding_properties.py, test_families.py.)"""
import pytest
import torch
import torch.nn.functional as F
from fairseq.modules import MultiheadAttention

from conftest import build_model
from ea_fairseq.modules import PredictiveAttention, layer_maps


def test_eq4_on_a_single_module():
    torch.manual_seed(0)
    attn = PredictiveAttention(8, 2, self_attention=True,
                               alpha=0.3, conv_layers=1, predict=True)
    prev, cur = torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4)
    masked = torch.zeros(1, 2, 4, 4, dtype=torch.bool)
    with layer_maps(attn, previous={"self": prev}, wanted=("self",)) as maps:
        out = attn.transform_logits(cur, masked, None, None)
        conv = attn.predictor[0]
        expected = 0.3 * F.relu(F.conv2d(prev, conv.weight, conv.bias, padding=1)) + 0.7 * cur
        assert torch.allclose(out, expected, atol=1e-6)
        assert torch.allclose(maps.outgoing["self"], expected, atol=1e-6)  # handed on


def test_transformer_with_rc_is_plain_residual_of_logits():
    attn = PredictiveAttention(8, 2, self_attention=True,
                               alpha=0.25, conv_layers=0, predict=True)
    prev, cur = torch.randn(1, 2, 3, 3), torch.randn(1, 2, 3, 3)
    with layer_maps(attn, previous={"self": prev}):
        out = attn.transform_logits(cur, torch.zeros_like(cur, dtype=torch.bool), None, None)
    assert torch.allclose(out, 0.25 * prev + 0.75 * cur)


def test_pa_is_encoder_only(capsys):
    with pytest.raises(SystemExit):
        build_model("pa_transformer_lite", "--decoder-attention", "pa")
    assert "invalid choice" in capsys.readouterr().err
