"""The plugin's beam reorder over a listed set of state holders (models/fairseq_speedups.py)
decodes exactly as fairseq's walk over every module, lists each decoding run afresh, and
can be given to a fairseq decoder (a benchmark's twin)."""
import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from conftest import build_model, make_dictionary, random_batch
from support.families import FAMILIES
from ea_fairseq.models import fairseq_speedups
from ea_fairseq.models.fairseq_speedups import LISTED_RUN, ListedStateHolders

SMALL = ("--encoder-layers", "2", "--decoder-layers", "2")


def beam_search(model, dictionary, beam=3):
    src, lengths, _ = random_batch(dictionary, [6, 4, 5], 2, seed=4)
    generator = SequenceGenerator([model], dictionary, beam_size=beam, max_len_b=8)
    with torch.no_grad():
        hypos = generator.forward({"net_input": {"src_tokens": src, "src_lengths": lengths}})
    return [[(h["tokens"].tolist(), round(float(h["score"]), 5)) for h in sent] for sent in hypos]


@pytest.mark.parametrize("family", ["ea-lite", "ran-all-lite", "vanilla"])
def test_listed_reorder_decodes_as_fairseqs_walk(family, monkeypatch):
    d = make_dictionary()
    model, _ = build_model(*FAMILIES[family].args(), *SMALL, dictionary=d)
    model.eval()
    if not isinstance(model.decoder, ListedStateHolders):  # fairseq's own decoder class
        fairseq_speedups.list_state_holders(model.decoder)
    listed = beam_search(model, d)
    assert model.decoder._state_holders  # the listed path ran
    monkeypatch.setattr(ListedStateHolders, "walk_every_module", True)
    assert beam_search(model, d) == listed


def test_each_decoding_run_lists_its_modules_afresh():
    d = make_dictionary()
    model, _ = build_model("ea_transformer_lite", *SMALL, dictionary=d)
    model.eval()
    beam_search(model, d)
    first = model.decoder._state_holders
    # a module swapped in between runs must be reordered by the next run
    layer = model.decoder.layers[1]
    layer.self_attn = build_model("ea_transformer_lite", *SMALL, dictionary=d, seed=7)[0].decoder.layers[1].self_attn
    beam_search(model, d)
    assert layer.self_attn in model.decoder._state_holders and layer.self_attn not in first
    state = {}
    model.decoder.reorder_incremental_state_scripting(state, torch.arange(2))
    assert LISTED_RUN in state  # the marker that tells a run's later steps it is listed
