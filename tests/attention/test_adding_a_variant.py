"""docs/adding-a-variant.md works as written: its three blocks (the module, the registry
entry, the family line) add a variant that the real option parser builds in every role and
that decodes as a full pass computes, and a mutant of it that skips its mechanism while
decoding is caught."""
import os
import re
import sys
import types

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from ea_fairseq.models import attention_variants
from ea_fairseq.modules.attention_protocol import AttentionModule
from ea_ops.masks import fill_masked_

from conftest import REPO, build_model, random_batch
from support.families import FAMILIES, added_parameters, twin_model
from test_decoding_properties import assert_incremental_equals_full

DOC = os.path.join(REPO, "docs", "adding-a-variant.md")
MODULE = "ea_fairseq.modules.talking_heads_attention"
SIZES = ("--encoder-layers", "2", "--decoder-layers", "2")
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest)


def doc_blocks():
    with open(DOC, encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


@pytest.fixture
def talking_heads():
    """The variant, added by running the doc's module and registry blocks."""
    module_code, registry_code, family_line = doc_blocks()
    module = types.ModuleType(MODULE)
    exec(compile(module_code, MODULE, "exec"), module.__dict__)
    sys.modules[MODULE] = module
    registry = dict(vars(attention_variants), TalkingHeadsAttention=module.TalkingHeadsAttention)
    try:
        exec(compile(registry_code, "attention_variants", "exec"), registry)
        yield module.TalkingHeadsAttention, family_of(family_line)
    finally:
        attention_variants.VARIANTS.pop("talking_heads", None)
        sys.modules.pop(MODULE, None)


def family_of(line: str):
    """The family line's ``Family``, read with the family table's own names."""
    from support import families

    return eval(line.split(":", 1)[1].strip().rstrip(","), vars(families))


def test_the_doc_names_three_places_and_its_blocks_are_them():
    module_code, registry_code, family_line = doc_blocks()
    assert "class TalkingHeadsAttention(LogitMapAttention)" in module_code
    assert registry_code.lstrip().startswith('@register_variant("talking_heads"')
    assert family_line.lstrip().startswith('"talking-heads-lite": Family(')


def test_the_documented_variant_builds_in_every_role_and_decodes(talking_heads, dictionary):
    cls, family = talking_heads
    model, args = build_model(*family.args(), *SIZES, dictionary=dictionary)
    twin, _ = build_model(family.twin, *SIZES, dictionary=dictionary)
    added = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in twin.parameters())
    assert added == added_parameters(args, [*FAMILIES.values(), family]) == 3 * 2 * 4 * 4  # its line's formula
    with pytest.raises(KeyError, match="no family line states the parameters the talking_heads attention adds"):
        added_parameters(args)  # (without its line)
    layers = list(model.encoder.layers) + list(model.decoder.layers)
    built = [m for m in model.modules() if isinstance(m, cls)]
    assert len(built) == len(model.encoder.layers) + 2 * len(model.decoder.layers)
    assert all(isinstance(m, AttentionModule) for m in built)
    assert {"self_attn.mix", "self_attn.q_proj.weight"} <= {k.split(".", 3)[-1] for k in model.state_dict()}
    assert all(layer.self_attn.mix.shape == (4, 4) for layer in layers)
    initial = [m.mix.detach().clone() for m in built]
    family.perturb(model, twin_model(family.twin, *SIZES), torch.Generator().manual_seed(0))  # as the family tests do
    assert all((m.mix != mix).all() for m, mix in zip(built, initial))
    src, lengths, prev = random_batch(dictionary, [7, 4, 9], 6)
    model.eval()
    assert_incremental_equals_full(model, dictionary, 1e-5)
    with torch.no_grad():
        full = model.get_normalized_probs(model(src, lengths, prev), log_probs=True)
        hypos = SequenceGenerator([model], dictionary, beam_size=3, max_len_b=5)._generate(
            {"net_input": {"src_tokens": src, "src_lengths": lengths}})
    assert len(hypos) == 3 and all(len(h) == 3 for h in hypos)
    # a mutant that skips the mechanism while decoding (plain attention in its steps) fails the same check
    transform = cls.transform_logits

    def skipping(self, logits, masked, query_padding_mask, incremental_state):
        if incremental_state is None:
            return transform(self, logits, masked, query_padding_mask, incremental_state)
        return fill_masked_(logits, masked, float("-inf"))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cls, "transform_logits", skipping)
        with pytest.raises(AssertionError):
            assert_incremental_equals_full(model, dictionary, 1e-5)
    # negative control: the mixing acts (the identity mix, plain attention, gives another output)
    with torch.no_grad():
        for m in built:
            m.mix.copy_(torch.eye(4))
        assert not torch.allclose(model.get_normalized_probs(model(src, lengths, prev), log_probs=True), full)
