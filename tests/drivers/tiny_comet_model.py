"""Write a tiny, randomly initialised COMET regression model (unbabel-comet's
``RegressionMetric`` over a 2-layer XLM-R encoder with a SentencePiece vocabulary trained
here) laid out as ``comet.download_model`` lays out a real one, so that
``comet.load_from_checkpoint`` and ``predict`` run offline:

  OUT/hparams.yaml  OUT/checkpoints/model.ckpt  OUT/encoder/ (config, tokenizer)

Run with the Python of a venv that has the comet extra (constraints-comet.txt):
``python tests/drivers/tiny_comet_model.py OUT``. Its scores mean nothing; it proves the
pinned set loads and scores."""
import os
import sys
import warnings

warnings.simplefilter("ignore")


def main(out: str) -> None:
    import pytorch_lightning
    import sentencepiece as spm
    import torch
    import yaml
    from comet.models import RegressionMetric
    from transformers import XLMRobertaConfig, XLMRobertaTokenizer, XLMRobertaTokenizerFast

    encoder = os.path.join(out, "encoder")
    os.makedirs(encoder, exist_ok=True)
    os.makedirs(os.path.join(out, "checkpoints"), exist_ok=True)
    text = os.path.join(out, "corpus.txt")
    words = "the a cat dog sat ran on under mat house green big small today die katze hund".split()
    with open(text, "w", encoding="utf-8") as f:
        for i in range(400):
            f.write(" ".join(words[(i * k) % len(words)] for k in range(1, 9)) + "\n")
    spm.SentencePieceTrainer.train(input=text, model_prefix=os.path.join(out, "spm"), vocab_size=40, hard_vocab_limit=False,
                                   model_type="unigram", bos_id=0, pad_id=1, eos_id=2, unk_id=3)
    slow = XLMRobertaTokenizer(vocab_file=os.path.join(out, "spm.model"))
    XLMRobertaTokenizerFast.from_pretrained  # noqa: B018 (the class COMET loads it with)
    slow.save_pretrained(encoder)
    XLMRobertaTokenizerFast(vocab_file=os.path.join(out, "spm.model")).save_pretrained(encoder)
    XLMRobertaConfig(vocab_size=len(slow), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=130).save_pretrained(encoder)

    torch.manual_seed(0)
    hparams = dict(encoder_model="XLM-RoBERTa", pretrained_model=encoder, load_pretrained_weights=False,
                   hidden_sizes=[8], layer="mix", pool="avg", dropout=0.0, batch_size=2)
    model = RegressionMetric(**hparams)
    ckpt = os.path.join(out, "checkpoints", "model.ckpt")
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams),
                "pytorch-lightning_version": pytorch_lightning.__version__, "epoch": 0, "global_step": 0}, ckpt)
    with open(os.path.join(out, "hparams.yaml"), "w") as f:
        yaml.safe_dump({"class_identifier": "regression_metric", **hparams}, f)
    print(ckpt)


if __name__ == "__main__":
    main(sys.argv[1])
