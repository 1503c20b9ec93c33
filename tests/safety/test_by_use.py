"""Principle 5 (refuse by use, not by pattern): a checkpoint whose configuration names a text
processing that downloads its files (``--bpe gpt2``) loads where no tool builds it:
``fairseq-generate`` and ``fairseq-interactive`` apply their own ``--bpe``, never the
checkpoint's. It used to be refused by name ("only byte_bpe, bytes, ... need no download")."""
import shutil

import torch

from conftest import REPO, cli
from test_confined_reads import built  # noqa: F401  (fixture: a model directory, the fixtures' dictionaries)
from support.trained_checkpoints import USER_DIR, run


def test_a_checkpoint_naming_gpt2_loads_where_no_tool_builds_its_bpe(built, tmp_path):  # noqa: F811
    model, _ = built
    state = torch.load(model / "c.pt", weights_only=False)
    state["cfg"]["bpe"] = {"_name": "gpt2", "gpt2_encoder_json": "https://example.invalid/encoder.json",
                           "gpt2_vocab_bpe": "https://example.invalid/vocab.bpe"}
    shutil.copytree(model, tmp_path / "model")
    torch.save(state, tmp_path / "model" / "c.pt")
    common = ["--user-dir", USER_DIR, "--path", str(tmp_path / "model" / "c.pt"), "--beam", "2", "--cpu",
              "--source-lang", "src", "--target-lang", "tgt", "--max-len-b", "5"]
    _, out = run([cli("fairseq-generate"), str(tmp_path / "model"), "--gen-subset", "test", "--required-batch-size-multiple", "1", *common],
                 cwd=REPO)
    assert "H-0\t" in out and "gpt2" in out  # translated; the log names the checkpoint's text processing
    _, out = run([cli("fairseq-interactive"), str(tmp_path / "model"), *common], input="s1 s2 s3\n",
                 cwd=REPO)
    assert "H-0\t" in out
