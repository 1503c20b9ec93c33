"""Every family through fairseq's hub (``from_pretrained`` + ``translate``) and
``fairseq-interactive`` (stdin; batched and one line at a time give the same hypotheses),
both through the safe loader; an over-long line in a RAN session is reported and skipped."""
import io
import re
import sys

import pytest
from fairseq import distributed_utils, options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.models.transformer import TransformerModel
from fairseq_cli import interactive

from conftest import cli
from support.families import TRAINED
from support.trained_checkpoints import USER_DIR, family_checkpoints, run

SENTENCES = ["s1 s2 s3", "s4 s5 s6 s7 s8 s9 s10", "s11", "s12 s13 s14 s15"]
DECODE = ["--beam", "5", "--max-len-a", "0", "--max-len-b", "6", "--cpu", "--source-lang", "src",
          "--target-lang", "tgt"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_data_bin):
    return family_checkpoints(tmp_path_factory, tiny_data_bin)


def interactive_session(data, checkpoint, lines, *extra, monkeypatch, capsys):
    """fairseq-interactive's main on ``lines`` as stdin; {line id: (hypothesis, score)}, output."""
    args = options.parse_args_and_arch(options.get_interactive_generation_parser(), [
        data, "--user-dir", USER_DIR, "--path", str(checkpoint), *DECODE, *extra])
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    capsys.readouterr()
    distributed_utils.call_main(convert_namespace_to_omegaconf(args), interactive.main)
    out = capsys.readouterr().out
    hyps = {int(i): (h, float(s)) for i, s, h in re.findall(r"^H-(\d+)\t(\S+)\t(.*)$", out, flags=re.M)}
    return hyps, out


@pytest.mark.parametrize("family", list(TRAINED))
def test_hub_and_interactive_agree(family, checkpoints, tiny_data_bin, monkeypatch, capsys):
    path = checkpoints[family]
    hub = TransformerModel.from_pretrained(str(path.parent), checkpoint_file=path.name,
                                           data_name_or_path=tiny_data_bin, user_dir=USER_DIR)
    batch = hub.translate(SENTENCES, beam=5, max_len_a=0, max_len_b=6)
    assert len(batch) == len(SENTENCES) and all(isinstance(t, str) and t for t in batch)
    assert [hub.translate(s, beam=5, max_len_a=0, max_len_b=6) for s in SENTENCES] == batch

    together, _ = interactive_session(tiny_data_bin, path, SENTENCES, "--buffer-size", "4",
                                      "--batch-size", "4", monkeypatch=monkeypatch, capsys=capsys)
    alone, _ = interactive_session(tiny_data_bin, path, SENTENCES, monkeypatch=monkeypatch, capsys=capsys)
    assert sorted(together) == sorted(alone) == list(range(len(SENTENCES)))
    for i, sentence in enumerate(SENTENCES):
        assert together[i][0] == alone[i][0] == batch[i], (i, sentence)
        assert together[i][1] == pytest.approx(alone[i][1], abs=1e-4)


def test_interactive_ran_session_survives_an_overlong_line(checkpoints, tiny_data_bin, monkeypatch, capsys,
                                                          caplog):
    """The RAN checkpoint takes at most 16 tokens (--ran-max-positions 16)."""
    lines = ["s1 s2 s3", " ".join(["s4"] * 30), "s5 s6"]
    code, out = run([cli("fairseq-interactive"), tiny_data_bin, "--user-dir", USER_DIR, "--task",
                     "translation_lines", "--path", checkpoints["ran"], *DECODE, "--buffer-size", "3",
                     "--batch-size", "3"], input="".join(line + "\n" for line in lines))
    assert code == 0
    assert re.search(r"input line 2: 31 tokens .*more than the 16 this model takes .*--ran-max-positions", out)
    assert "Warning" not in out and "DEBUG:" not in out  # fairseq's stack's known ones (ea_fairseq.known_warnings)
    assert sorted(re.findall(r"^H-(\d+)\t", out, flags=re.M)) == ["0", "2"]
    with caplog.at_level("WARNING", logger="ea_fairseq"):  # one line at a time
        hyps, _ = interactive_session(tiny_data_bin, checkpoints["ran"], lines, "--task", "translation_lines",
                                      monkeypatch=monkeypatch, capsys=capsys)
    assert sorted(hyps) == [0, 2]
    assert [r.getMessage()[:30] for r in caplog.records if "input line" in r.getMessage()] == [
        "input line 2: 31 tokens with <"]
    # control: fairseq's translation task ends the session at that line
    with pytest.raises(Exception, match="Size of sample #1 is invalid"):
        interactive_session(tiny_data_bin, checkpoints["ran"], lines, "--buffer-size", "3", "--batch-size", "3",
                            monkeypatch=monkeypatch, capsys=capsys)


def test_ran_max_positions_below_one_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit):
        options.parse_args_and_arch(options.get_training_parser(), [
            "/nonexistent", "--arch", "ran_e_lite", "--ran-max-positions", "0"])
    assert "argument --ran-max-positions: must be at least 1, got 0" in capsys.readouterr().err


def test_lowered_max_positions_is_logged_once(checkpoints, caplog):
    from conftest import build_model
    from fairseq import checkpoint_utils

    with caplog.at_level("INFO", logger="ea_fairseq"):
        build_model("ran_e_lite", "--max-source-positions", "1024", "--encoder-layers", "1", "--decoder-layers", "1")
    lowered = [r.getMessage() for r in caplog.records if "lowered" in r.getMessage()]
    assert len(lowered) == 1 and lowered[0].startswith("--max-source-positions 1024 lowered to 256")
    caplog.clear()
    with caplog.at_level("INFO", logger="ea_fairseq"):  # a RAN checkpoint holds the lowered value
        checkpoint_utils.load_model_ensemble_and_task([str(checkpoints["ran"])])
    assert not [r for r in caplog.records if "lowered" in r.getMessage()]


def test_the_hub_names_the_subword_model_it_was_not_given(checkpoints, tiny_data_bin, tmp_path):
    """``bpe="sentencepiece"`` for a run whose checkpoint directory holds no
    sentencepiece.bpe.model (a plain fairseq-train run: train.sh copies it there): one line
    naming the argument, instead of omegaconf's MissingMandatoryValue from inside fairseq; given
    it, the model loads."""
    from ea_fairseq.safety.data_files import DataFileError

    path = next(iter(checkpoints.values()))
    with pytest.raises(DataFileError, match=r"^the sentencepiece BPE needs its file: pass sentencepiece_model=PATH"):
        TransformerModel.from_pretrained(str(path.parent), checkpoint_file=path.name, data_name_or_path=tiny_data_bin,
                                         user_dir=USER_DIR, bpe="sentencepiece")
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "text"
    corpus.write_text("\n".join(SENTENCES * 20) + "\n")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=17,
                                   minloglevel=2)
    hub = TransformerModel.from_pretrained(str(path.parent), checkpoint_file=path.name, data_name_or_path=tiny_data_bin,
                                           user_dir=USER_DIR, bpe="sentencepiece",
                                           sentencepiece_model=str(tmp_path / "sp.model"))
    assert hub.bpe is not None
