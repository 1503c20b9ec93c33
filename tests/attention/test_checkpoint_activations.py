"""``--checkpoint-activations`` and ``--offload-activations`` for every family: each layer runs
again in the backward pass, with what it reads from the layers before it (previous logits,
value residual's first values, RAN's matrices) as explicit inputs and what it hands on as
explicit outputs, so the loss and every gradient are those of the same model run without
them, within float64's rounding."""
import os
import re
import subprocess

import pytest
import torch

from conftest import REPO, build_model, cli, cpu_autocast_supports, random_batch
from ea_fairseq.models.stack import StackLayer
from support.families import FAMILIES

pytestmark = pytest.mark.usefixtures("one_thread")
# three layers: a middle layer reads what the first handed on and hands on its own
SMALL = ("--encoder-layers", "3", "--decoder-layers", "3", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
         "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32", "--dropout", "0.1",
         "--attention-dropout", "0.1")
#: every family but the variants of another at other option values or sizes
FAMILIES_BUILT = [name for name, f in FAMILIES.items() if not f.variant_of]


def loss_and_grads(model, dictionary, checkpoint: bool):
    """Loss and gradients of one training step (dropout on, the same random draws), with
    every layer checkpointed or none; and how often each layer ran."""
    runs = []
    hooks = [layer.fc1.register_forward_pre_hook(lambda module, args, i=i: runs.append(i))
             for i, layer in enumerate([*model.encoder.layers, *model.decoder.layers])]
    for layer in [*model.encoder.layers, *model.decoder.layers]:
        if isinstance(layer, StackLayer):
            layer.checkpoint = checkpoint
    model.zero_grad()
    src, lengths, prev = random_batch(dictionary, [5, 7, 3], 6)
    torch.manual_seed(11)
    loss = model(src, lengths, prev)[0].pow(2).mean()
    loss.backward()
    for hook in hooks:
        hook.remove()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, runs


@pytest.mark.parametrize("family", FAMILIES_BUILT)
def test_checkpointed_layers_give_the_same_loss_and_gradients(dictionary, family):
    f = FAMILIES[family]
    model, _ = build_model(f.arch, *f.options, *SMALL, "--checkpoint-activations")
    layers = [*model.encoder.layers, *model.decoder.layers]
    ours = all(isinstance(layer, StackLayer) for layer in layers)  # fairseq's own wraps its layers itself
    assert ours or all(hasattr(layer, "precheckpoint_forward") for layer in layers)
    f.perturbed(model, *SMALL)
    model = model.double().train()
    if ours:
        assert all(layer.checkpoint and not layer.offload for layer in layers)
        expected = loss_and_grads(model, dictionary, False)
        got = loss_and_grads(model, dictionary, True)
        assert sorted(got[2]) == sorted(2 * list(range(6)))  # each layer once more in the backward pass
    else:
        plain, _ = build_model(f.arch, *f.options, *SMALL)
        plain = plain.double().train()
        plain.load_state_dict(model.state_dict())
        expected = loss_and_grads(plain, dictionary, False)
        got = loss_and_grads(model, dictionary, True)
    assert expected[1].keys() == got[1].keys() and len(got[1]) == len(list(model.parameters()))
    torch.testing.assert_close(got[0], expected[0], rtol=1e-12, atol=1e-14)
    for name, grad in expected[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=1e-10, atol=1e-13, msg=name)


def test_negative_control_a_value_read_from_outside_the_checkpointed_call_loses_its_gradient(dictionary):
    """Had a layer read the previous logits from the pass (a side object) instead of its
    explicit input, the recomputed layer would hold no gradient path to the layer that made
    them: the earlier layers' gradients would differ."""
    from ea_fairseq.models import stack

    f = FAMILIES["realformer-lite"]
    model, _ = build_model(f.arch, *f.options, *SMALL, "--checkpoint-activations")
    model = model.double().train()
    expected = loss_and_grads(model, dictionary, False)[1]
    body = stack.StackLayer.body

    def detached_inputs(self, stack_pass, names, x, *rest, **kwargs):
        values = rest[len(rest) - len(names):]
        rest = rest[:len(rest) - len(names)] + tuple(v.detach() if torch.is_tensor(v) else v for v in values)
        return body(self, stack_pass, names, x, *rest, **kwargs)

    try:
        stack.StackLayer.body = detached_inputs
        got = loss_and_grads(model, dictionary, True)[1]
    finally:
        stack.StackLayer.body = body
    name = "encoder.layers.0.self_attn.q_proj.weight"  # reaches the loss through the logits handed on
    assert not torch.allclose(got[name], expected[name])


def test_offloaded_activations_give_the_same_gradients(dictionary):
    f = FAMILIES["ea-lite"]
    model, _ = build_model(f.arch, *f.options, *SMALL, "--offload-activations")
    assert all(layer.checkpoint and layer.offload for layer in [*model.encoder.layers, *model.decoder.layers])
    f.perturbed(model, *SMALL)
    model = model.double().train()
    _, expected, _ = loss_and_grads(model, dictionary, False)
    _, got, _ = loss_and_grads(model, dictionary, True)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-10, atol=1e-13, msg=name)


def test_fairseq_train_with_offloaded_checkpointed_activations(tmp_path, tiny_data_bin):
    """fairseq-train with --offload-activations (which sets --checkpoint-activations) on EA
    with the previous layer's logits in every layer trains through fairseq's own entry point
    (the gradients' equality is the tests' above, on models built by fairseq-train's option
    parser)."""
    f = FAMILIES["ea-lite"]
    proc = subprocess.run([
        cli("fairseq-train"), tiny_data_bin, "--user-dir", os.path.join(REPO, "ea_fairseq"), "--arch", f.arch,
        *f.options, *SMALL, "--offload-activations", "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "400",
        "--max-update", "2", "--save-dir", str(tmp_path / "save"), "--no-save", "--cpu", "--num-workers", "0",
        "--no-progress-bar", "--log-format", "json", "--log-interval", "1", "--seed", "3", "--disable-validation",
    ], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # each update's loss and gradient norm, as fairseq logs them
    logged = [float(x) for x in re.findall(r'"(?:loss|gnorm)": "([\d.]+)"', proc.stdout + proc.stderr)]
    assert len(logged) == 4 and all(0 < x < 100 for x in logged)


def autocast_grads(model, dictionary, checkpoint: bool):
    for layer in [*model.encoder.layers, *model.decoder.layers]:
        layer.checkpoint = checkpoint
    model.zero_grad()
    src, lengths, prev = random_batch(dictionary, [5, 7, 3], 6)
    torch.manual_seed(11)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(src, lengths, prev)[0]
    out.float().pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["ea-lite", "realformer-lite"])
def test_a_layer_recomputed_under_the_forwards_autocast(dictionary, family, monkeypatch):
    """A checkpointed layer runs again in the backward pass, outside the forward's autocast
    (fairseq's --amp): it recomputes in the forward's precision, so the gradients are those
    of the run without checkpoints (each within bfloat16's rounding of the largest).
    Negative control: recomputed with autocast off, a layer computes other gradients (or EA's
    fails on float32 logits beside the bfloat16 map it was handed)."""
    from ea_fairseq.models import stack

    if not cpu_autocast_supports(torch.bfloat16):
        pytest.skip("CPU autocast does not run bfloat16 matmuls here")
    f = FAMILIES[family]
    model, _ = build_model(f.arch, *f.options, *SMALL, "--checkpoint-activations")
    f.perturbed(model, *SMALL)
    model.train()
    expected = autocast_grads(model, dictionary, False)

    def close(got):
        return all((got[n] - g).abs().max() <= 2 ** -8 * g.abs().max() for n, g in expected.items())

    assert expected.keys() == autocast_grads(model, dictionary, True).keys()
    assert close(autocast_grads(model, dictionary, True))
    settings = stack.autocast_settings
    monkeypatch.setattr(stack, "autocast_settings",
                        lambda: (tuple((d, False, t) for d, _, t in settings()[0]), True))
    try:
        assert not close(autocast_grads(model, dictionary, True))
    except RuntimeError as err:
        assert "dtype" in str(err)
