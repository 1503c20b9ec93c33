"""DropAttention on fairseq's own transformer in one flag; without it, fairseq's class."""
import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.models.transformer import TransformerModel

from conftest import build_model, decoder_out, random_batch
from ea_fairseq.modules import DropAttention
from support.trained_checkpoints import train_command, train_many

TINY = ("--encoder-layers", "1", "--decoder-layers", "1")


@pytest.mark.parametrize("arch", ["transformer_lite", "transformer", "transformer_iwslt_de_en"])
def test_without_the_flag_it_is_fairseqs_transformer(arch):
    """What the benchmark builds as every mechanism's twin (by arch name) and what every
    vanilla run trains: fairseq's TransformerModel itself, not a subclass."""
    model, _ = build_model(arch, *TINY)
    assert type(model) is TransformerModel
    model, _ = build_model(arch, *TINY, "--drop-attention", "none")
    assert type(model) is TransformerModel


def test_stray_drop_attention_options_are_refused():
    with pytest.raises(ValueError, match="--drop-attention-p given without --drop-attention"):
        build_model("transformer_lite", *TINY, "--drop-attention-p", "0.3")


def test_on_fairseqs_transformer_dims(dictionary):
    model, args = build_model("transformer", *TINY, "--drop-attention", "column", "--dropout", "0",
                              "--attention-dropout", "0")
    assert args.encoder_embed_dim == 512
    drops = [m for m in model.modules() if isinstance(m, DropAttention)]
    assert len(drops) == 3 and all(d.mode == "column" for d in drops)
    src, lengths, prev = random_batch(dictionary, [5, 7], 4)
    model.train()
    torch.manual_seed(0)
    with torch.no_grad():
        trained = model(src, lengths, prev)[0]
    assert not torch.allclose(trained, decoder_out(model, src, lengths, prev))


def test_cli_trains_and_differs_from_plain_training_only_in_training_mode(tmp_path, tiny_data_bin, dictionary):
    common = ("--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0")
    plain = train_command(tiny_data_bin, "transformer_lite", tmp_path / "plain", *common, updates=2)
    dropped = train_command(tiny_data_bin, "transformer_lite", tmp_path / "drop", *common, "--drop-attention",
                            "element", "--drop-attention-p", "0.3", "--drop-attention-window", "2", updates=2)
    log = train_many(plain, dropped)
    assert log.count("done training") == 2

    (fairseq_model,), _, task = checkpoint_utils.load_model_ensemble_and_task([str(tmp_path / "plain" / "checkpoint_last.pt")])
    (drop_model,), cfg, _ = checkpoint_utils.load_model_ensemble_and_task([str(tmp_path / "drop" / "checkpoint_last.pt")])
    assert type(fairseq_model) is TransformerModel and cfg.model.arch == "transformer_lite"
    assert sum(isinstance(m, DropAttention) for m in drop_model.modules()) == 6  # 2 layers x 3 roles
    # training differed (same seed, same data): DropAttention acted in fairseq-train
    assert not torch.equal(fairseq_model.state_dict()["encoder.layers.0.self_attn.k_proj.weight"],
                           drop_model.state_dict()["encoder.layers.0.self_attn.k_proj.weight"])

    # same weights: the same model as fairseq's in eval mode, a different one in training
    fairseq_model.load_state_dict(drop_model.state_dict(), strict=True)
    fairseq_model.double(), drop_model.double()
    src, lengths, prev = random_batch(task.source_dictionary, [7, 4, 9], 6)
    gap = (decoder_out(drop_model, src, lengths, prev) - decoder_out(fairseq_model, src, lengths, prev)).abs().max()
    assert gap <= 1e-6
    with torch.no_grad():
        fairseq_model.train(), drop_model.train()
        torch.manual_seed(0)
        train_out = drop_model(src, lengths, prev)[0]
        assert torch.equal(fairseq_model(src, lengths, prev)[0], decoder_out(fairseq_model, src, lengths, prev))
    assert (train_out - decoder_out(drop_model, src, lengths, prev)).abs().max() > 1e-3
