"""``--task translation_progress`` through fairseq-train's console entry point, in this process on
a tiny model: validation with BLEU says what it translates, how far it has got and how long it
took; the interval throttles the lines; a validation without BLEU stays quiet unless it is slow;
the checkpoints it writes load with the plugin's checks."""
import logging
import re
import sys

import pytest

from ea_fairseq.tasks.translation_progress import progress_line

TINY = ["--arch", "transformer", "--encoder-layers", "1", "--decoder-layers", "1",
        "--encoder-embed-dim", "16", "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
        "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]
BLEU = ["--eval-bleu", "--eval-bleu-args", '{"beam": 2, "max_len_a": 1.2, "max_len_b": 5}']
PROGRESS = "ea_fairseq.tasks.translation_progress"

pytestmark = pytest.mark.usefixtures("one_thread")


def fairseq_train(data, save, caplog, monkeypatch, *options):
    """fairseq-train's ``cli_main`` with this command line: the messages the task logged."""
    from fairseq_cli.train import cli_main

    argv = ["fairseq-train", data, "--user-dir", "ea_fairseq", "--task", "translation_progress", *TINY,
            "--optimizer", "adam", "--lr", "0.001", "--max-tokens", "300", "--max-epoch", "1",
            "--criterion", "label_smoothed_cross_entropy", "--save-dir", str(save), "--no-epoch-checkpoints",
            "--required-batch-size-multiple", "1", "--num-workers", "0", "--log-format", "simple",
            "--no-progress-bar", "--seed", "1", "--cpu", *options]
    monkeypatch.setattr(sys, "argv", argv)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        cli_main()
    return [r.getMessage() for r in caplog.records if r.name == PROGRESS]


def counts(lines):
    return [int(m.group(1)) for m in (re.search(r": (\d+)/40 sentences", line) for line in lines) if m]


def test_validation_bleu_reports_each_batch_and_its_total(tiny_data_bin, tmp_path, caplog, monkeypatch):
    lines = fairseq_train(tiny_data_bin, tmp_path, caplog, monkeypatch, *BLEU, "--valid-progress-seconds", "0",
                          "--max-tokens-valid", "100")
    assert lines[0] == ("[valid BLEU] 'valid': translating 40 sentences with beam 2 for BLEU; progress after "
                        "every batch (--valid-progress-seconds)"), lines
    done = counts(lines[1:])
    # one line a batch (100 tokens: several), the counts growing to the 40 sentences of the split
    assert len(done) == len(lines) - 1 >= 3 and done == sorted(set(done)) and done[-1] == 40, lines
    assert re.fullmatch(r"\[valid BLEU\] 'valid': 40/40 sentences in \d+ s", lines[-1]), lines
    assert all(re.search(r", \d+ s, ~\d+ s left$", line) for line in lines[1:-1]), lines


def test_the_interval_throttles_the_lines(tiny_data_bin, tmp_path, caplog, monkeypatch):
    lines = fairseq_train(tiny_data_bin, tmp_path, caplog, monkeypatch, *BLEU, "--max-tokens-valid", "100")
    assert len(lines) == 2 and "progress every 30 s" in lines[0] and " 40/40 sentences in " in lines[1], lines


def test_validation_without_bleu_reports_only_when_slow(tiny_data_bin, tmp_path, caplog, monkeypatch):
    assert fairseq_train(tiny_data_bin, tmp_path / "quiet", caplog, monkeypatch) == []
    lines = fairseq_train(tiny_data_bin, tmp_path / "each", caplog, monkeypatch, "--valid-progress-seconds", "0",
                          "--max-tokens-valid", "100")
    assert lines and all(line.startswith("[valid] 'valid': ") for line in lines), lines
    assert counts(lines)[-1] == 40 and lines[-1].endswith(tuple(f"40/40 sentences in {n} s" for n in range(60)))


def test_its_checkpoints_load_with_the_plugin(tiny_data_bin, tmp_path, caplog, monkeypatch):
    from fairseq import checkpoint_utils

    from ea_fairseq.tasks.translation_progress import TranslationProgressTask

    fairseq_train(tiny_data_bin, tmp_path, caplog, monkeypatch, "--max-update", "2")
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([str(tmp_path / "checkpoint_last.pt")])
    assert cfg.task._name == "translation_progress" and type(task) is TranslationProgressTask
    assert cfg.task.valid_progress_seconds == 30.0


@pytest.mark.parametrize("done, total, elapsed, shards, expected", [
    (0, 400, 0.2, 1, "[valid BLEU] 'valid': 0/400 sentences, 0 s"),
    (120, 400, 35, 1, "[valid BLEU] 'valid': 120/400 sentences, 35 s, ~82 s left"),
    (400, 400, 95.4, 1, "[valid BLEU] 'valid': 400/400 sentences in 95 s"),
    (100, 400, 300, 1, "[valid BLEU] 'valid': 100/400 sentences, 5 min 00 s, ~15 min 00 s left"),
    (10, 20, 4, 2, "[valid BLEU] 'valid': 10/20 sentences (this process's share; 2 processes), 4 s, ~4 s left"),
    (7, None, 3, 1, "[valid BLEU] 'valid': 7 sentences, 3 s"),
])
def test_progress_line(done, total, elapsed, shards, expected):
    assert progress_line("valid BLEU", "valid", done, total, elapsed, shards) == expected
