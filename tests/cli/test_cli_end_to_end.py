"""The architectures through the real command-line tools, as a user runs them: a
representative few (fairseq's transformer, EA, RAN: ``Family.cli`` in tests/support/families.py)
through fairseq-train (--user-dir) -> ea-fairseq-average-checkpoints (its main, in process:
its console script runs as a process in test_average_checkpoints.py) -> fairseq-generate
--beam 5; every other family (not a mere variant at other option values) built as
fairseq-train builds it, saved as a fairseq checkpoint and loaded by the hub (fairseq's
checkpoint loader with the plugin's guards) in process."""
import dataclasses
import os
import re
import subprocess

import pytest
import torch
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.models.transformer import TransformerModel
from omegaconf import OmegaConf

from ea_fairseq_cli import average_checkpoints

from conftest import REPO, build_model, cli, decoder_out, random_batch
from support.families import CLI, FAMILIES, ROUND_TRIP

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = ["--encoder-layers", "2", "--decoder-layers", "2"]


def run(cmd):
    """A command in a process of one thread (a tiny model's update spends a second thread
    synchronising, on a busy machine spinning)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("family", CLI)
def test_train_average_generate(tmp_path, tiny_data_bin, family):
    save = str(tmp_path / "ckpt")
    user_dir = os.path.join(REPO, "ea_fairseq")
    log = run([
        cli("fairseq-train"), tiny_data_bin, "--user-dir", user_dir, "--arch", FAMILIES[family].arch, *TINY,
        *FAMILIES[family].options,
        "--share-all-embeddings", "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--lr", "1e-3",
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--max-tokens", "600", "--max-update", "4", "--save-interval-updates", "2",
        "--no-epoch-checkpoints", "--save-dir", save, "--cpu", "--num-workers", "0",
        "--no-progress-bar", "--log-interval", "1", "--seed", "3",
    ])
    assert "done training" in log
    avg = str(tmp_path / "averaged.pt")
    assert average_checkpoints.main(["--inputs", save, "--num-update-checkpoints", "2", "--output", avg]) == 0
    out = run([
        cli("fairseq-generate"), tiny_data_bin, "--user-dir", user_dir, "--path", avg,
        "--beam", "5", "--max-tokens", "2000", "--cpu", "--num-workers", "0",
        "--max-len-a", "1", "--max-len-b", "4",  # a 4-update model's output is long otherwise
    ])
    assert re.search(r"Generate test with beam=5: BLEU4 = \d+\.\d+", out), out[-2000:]
    assert len(re.findall(r"^H-\d+", out, flags=re.M)) == 24  # every test sentence translated


@pytest.mark.parametrize("family", ROUND_TRIP)
def test_saved_and_loaded_through_the_hub(tmp_path, dictionary, family):
    """Built with fairseq-train's options parser, saved as fairseq-train saves (its config as a
    plain container), loaded
    by ``from_pretrained``: the same parameters, bitwise the same outputs, and beam 5 through
    the hub translates every sentence with finite scores."""
    model, args = build_model(*FAMILIES[family].args(), *TINY, "--source-lang", "src", "--target-lang", "tgt",
                              dictionary=dictionary)
    # its saved tensors moved; its settings (α, β, ...) and unsaved buffers (HC-SA's offsets) come from
    # the saved configuration, not the state dict: held
    unsaved = {n: b.clone() for n, b in model.named_buffers() if n not in model.state_dict()}
    dataclasses.replace(FAMILIES[family], held=("*",)).perturbed(model, *TINY)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n in unsaved:
                b.copy_(unsaved[n])
    for lang in ("src", "tgt"):
        dictionary.save(os.path.join(tmp_path, f"dict.{lang}.txt"))
    cfg = OmegaConf.to_container(convert_namespace_to_omegaconf(args), resolve=True, enum_to_str=True)
    torch.save({"cfg": cfg, "model": model.state_dict(), "extra_state": {"train_iterator": None},
                "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "none",
                                       "lr_scheduler_state": {}, "num_updates": 0}]},
               os.path.join(tmp_path, "model.pt"))
    hub = TransformerModel.from_pretrained(str(tmp_path), checkpoint_file="model.pt",
                                           data_name_or_path=str(tmp_path))
    loaded = hub.models[0]
    assert type(loaded) is type(model)
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    src, lengths, prev = random_batch(dictionary, [7, 4, 9], 6)
    assert torch.equal(decoder_out(model, src, lengths, prev), decoder_out(loaded, src, lengths, prev))
    sentences = ["w5 w6 w7 w8 w9", "w1 w2"]
    hypos = hub.generate([hub.encode(s) for s in sentences], beam=5, max_len_a=0, max_len_b=10)
    assert [len(sentence) for sentence in hypos] == [5, 5]
    assert all(torch.isfinite(h["positional_scores"]).all() for sentence in hypos for h in sentence)


def test_weights_not_of_the_configured_model_are_refused(tmp_path, dictionary):
    """A checkpoint whose weights do not fit the model its configuration describes (one
    matrix of another shape; the same file unchanged loads, as in the round trip above) is
    refused by the hub's loader with a one-line reason, before any weight is copied."""
    model, args = build_model("transformer_lite", *TINY, "--source-lang", "src", "--target-lang", "tgt",
                              dictionary=dictionary)
    for lang in ("src", "tgt"):
        dictionary.save(os.path.join(tmp_path, f"dict.{lang}.txt"))
    weights = model.state_dict()
    weights["encoder.layers.0.fc1.weight"] = torch.zeros(3, 3)
    cfg = OmegaConf.to_container(convert_namespace_to_omegaconf(args), resolve=True, enum_to_str=True)
    torch.save({"cfg": cfg, "model": weights, "extra_state": {"train_iterator": None},
                "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "none",
                                       "lr_scheduler_state": {}, "num_updates": 0}]},
               os.path.join(tmp_path, "model.pt"))
    with pytest.raises(Exception, match="weights are not those of the model its configuration describes") as err:
        TransformerModel.from_pretrained(str(tmp_path), checkpoint_file="model.pt", data_name_or_path=str(tmp_path))
    assert "\n" not in str(err.value).strip()
