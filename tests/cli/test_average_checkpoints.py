"""ea-fairseq-average-checkpoints (ea_fairseq_cli.average_checkpoints): exact averages, checkpoint selection, errors, and a real
fairseq checkpoint (the averaged file loads in fairseq like the inputs)."""
import argparse
import collections
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BIN = Path(sys.executable).parent

from ea_fairseq_cli import average_checkpoints as avg


def fake_checkpoint(path: Path, seed: int, *, epoch: int = 1, extra_key: str = None,
                    shape=(3, 4), step: int = 7, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    model = collections.OrderedDict(
        [("encoder.w", torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)),
         ("encoder.h", torch.randn(5, generator=g).half()),
         ("decoder.b", torch.randn(2, generator=g).to(torch.bfloat16)),
         ("decoder.version", torch.tensor([3.0])),
         ("decoder.step", torch.tensor([step], dtype=torch.int64))])
    if extra_key:
        model[extra_key] = torch.zeros(1)
    state = {"args": None,
             "cfg": {"model": argparse.Namespace(arch="transformer", dropout=0.1), "common": {"seed": seed}},
             "model": model,
             "optimizer_history": [{"num_updates": 10 * epoch}],
             "extra_state": {"epoch": epoch}}
    torch.save(state, path)
    return state


def average(*argv):
    return avg.main([str(a) for a in argv])


def load(path):
    from ea_fairseq.safety.no_code import load_checkpoint

    return load_checkpoint(str(path), build_check=False)  # toy weights: no model to build


def test_explicit_inputs_exact_average(tmp_path):
    states = [fake_checkpoint(tmp_path / f"c{i}.pt", seed=i, epoch=i) for i in range(3)]
    assert average("--inputs", *(tmp_path / f"c{i}.pt" for i in range(3)), "--output", tmp_path / "avg.pt") == 0
    out = load(tmp_path / "avg.pt")
    for key in ("encoder.w", "encoder.h", "decoder.b"):
        expected = (sum(s["model"][key].double() for s in states) / 3).to(states[0]["model"][key].dtype)
        assert out["model"][key].dtype == states[0]["model"][key].dtype
        assert torch.equal(out["model"][key], expected), key
    assert torch.equal(out["model"]["decoder.step"], torch.tensor([7]))
    assert list(out["model"]) == list(states[0]["model"])  # key order kept
    # everything but the model is the first input's; the Namespace survives weights-only loading
    assert out["extra_state"] == {"epoch": 0} and out["cfg"]["common"]["seed"] == 0
    assert isinstance(out["cfg"]["model"], argparse.Namespace) and out["cfg"]["model"].arch == "transformer"


def test_average_is_computed_in_float64(tmp_path):
    # 1 + 2**-24 is not a float32 sum of float32 halves; float64 accumulation keeps it exact
    a = {"model": {"w": torch.tensor([1.0, 3.0], dtype=torch.float32)}}
    b = {"model": {"w": torch.tensor([1.0 + 2**-23, 3.0], dtype=torch.float32)}}
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    state = avg.average([str(tmp_path / "a.pt"), str(tmp_path / "b.pt")])
    expected = ((a["model"]["w"].double() + b["model"]["w"].double()) / 2).float()
    assert torch.equal(state["model"]["w"], expected)


def test_last_epoch_checkpoints_sorted_numerically(tmp_path):
    states = {e: fake_checkpoint(tmp_path / f"checkpoint{e}.pt", seed=e, epoch=e) for e in (1, 2, 3, 10)}
    fake_checkpoint(tmp_path / "checkpoint_best.pt", seed=99)
    fake_checkpoint(tmp_path / "checkpoint_last.pt", seed=98)
    fake_checkpoint(tmp_path / "checkpoint_3_500.pt", seed=97)
    assert avg.last_checkpoints(str(tmp_path), 2, by_update=False) == [
        str(tmp_path / "checkpoint10.pt"), str(tmp_path / "checkpoint3.pt")]
    assert average("--inputs", tmp_path, "--num-epoch-checkpoints", "2", "--output", tmp_path / "a.pt") == 0
    out = load(tmp_path / "a.pt")
    expected = (states[10]["model"]["encoder.w"].double() + states[3]["model"]["encoder.w"].double()) / 2
    assert torch.equal(out["model"]["encoder.w"], expected.float())
    assert out["extra_state"] == {"epoch": 10}  # the newest checkpoint's state
    assert avg.last_checkpoints(str(tmp_path), 2, by_update=False, upper_bound=2) == [
        str(tmp_path / "checkpoint2.pt"), str(tmp_path / "checkpoint1.pt")]


def test_last_update_checkpoints_with_upper_bound(tmp_path):
    for e, u in ((1, 100), (1, 200), (2, 300), (2, 1000)):
        fake_checkpoint(tmp_path / f"checkpoint_{e}_{u}.pt", seed=u)
    fake_checkpoint(tmp_path / "checkpoint9.pt", seed=9)
    assert avg.last_checkpoints(str(tmp_path), 2, by_update=True) == [
        str(tmp_path / "checkpoint_2_1000.pt"), str(tmp_path / "checkpoint_2_300.pt")]
    assert avg.last_checkpoints(str(tmp_path), 2, by_update=True, upper_bound=250) == [
        str(tmp_path / "checkpoint_1_200.pt"), str(tmp_path / "checkpoint_1_100.pt")]
    assert average("--inputs", tmp_path, "--num-update-checkpoints", "3", "--checkpoint-upper-bound",
                   "300", "--output", tmp_path / "u.pt") == 0


def test_errors_name_the_problem(tmp_path, capsys):
    def error(*argv):
        assert average(*argv) == 1
        return capsys.readouterr().err

    out = tmp_path / "out.pt"
    assert "no epoch checkpoints" in error("--inputs", tmp_path, "--num-epoch-checkpoints", "2", "--output", out)
    fake_checkpoint(tmp_path / "checkpoint1.pt", seed=1)
    fake_checkpoint(tmp_path / "checkpoint2.pt", seed=2)
    err = error("--inputs", tmp_path, "--num-epoch-checkpoints", "3", "--output", out)
    assert "only 2" in err and "checkpoint1.pt, checkpoint2.pt" in err
    assert err.rstrip().endswith("average those with --num-epoch-checkpoints 2")  # what to do
    assert "at or below 1" in error("--inputs", tmp_path, "--num-epoch-checkpoints", "2",
                                    "--checkpoint-upper-bound", "1", "--output", out)
    assert "no update checkpoints" in error("--inputs", tmp_path, "--num-update-checkpoints", "1", "--output", out)
    assert "no such checkpoint" in error("--inputs", tmp_path / "nope.pt", "--output", out)

    ref = tmp_path / "checkpoint1.pt"
    fake_checkpoint(tmp_path / "extra.pt", seed=3, extra_key="decoder.new")
    assert "'decoder.new'" in error("--inputs", ref, tmp_path / "extra.pt", "--output", out)
    lacking = load(ref)
    lacking["model"] = {k: v for k, v in lacking["model"].items() if k != "encoder.h"}
    torch.save(lacking, tmp_path / "lack.pt")
    assert "lacks ['encoder.h']" in error("--inputs", ref, tmp_path / "lack.pt", "--output", out)
    fake_checkpoint(tmp_path / "shape.pt", seed=4, shape=(4, 3))
    err = error("--inputs", ref, tmp_path / "shape.pt", "--output", out)
    assert "'encoder.w'" in err and "(4, 3)" in err and "(3, 4)" in err
    fake_checkpoint(tmp_path / "step.pt", seed=5, step=8)
    err = error("--inputs", ref, tmp_path / "step.pt", "--output", out)
    assert "'decoder.step'" in err and "torch.int64" in err
    fake_checkpoint(tmp_path / "dtype.pt", seed=6, dtype=torch.float64)
    assert "dtype" in error("--inputs", ref, tmp_path / "dtype.pt", "--output", out)
    assert not out.exists()


class NotAllowListed:
    pass


def test_refuses_arbitrary_pickles(tmp_path):
    """Loading stays weights-only: a checkpoint holding any other class is refused."""
    torch.save({"model": {"w": torch.zeros(1)}, "extra": NotAllowListed()}, tmp_path / "bad.pt")
    with pytest.raises(Exception, match="(?i)weights.only|Unsupported global"):
        load(tmp_path / "bad.pt")


def test_command_line_exit_codes(tmp_path):
    fake_checkpoint(tmp_path / "checkpoint1.pt", seed=1)
    proc = subprocess.run([str(BIN / "ea-fairseq-average-checkpoints"), "--inputs", str(tmp_path), "--num-epoch-checkpoints",
                           "2", "--output", str(tmp_path / "o.pt")], capture_output=True, text=True)
    assert proc.returncode == 1 and "average_checkpoints: error:" in proc.stderr and "only 1" in proc.stderr


def test_real_fairseq_checkpoints(tmp_path):
    """Two epochs of a tiny fairseq transformer; the average loads back into fairseq."""
    for tool in ("fairseq-preprocess", "fairseq-train"):
        if not (BIN / tool).exists():
            pytest.skip(f"{tool} not installed next to {sys.executable}")
    words = "a b c d e f g h i j k l".split()
    for split, n in (("train", 64), ("valid", 8)):
        for lang, f in (("x", str), ("y", str.upper)):
            (tmp_path / f"{split}.{lang}").write_text(
                "".join(" ".join(f(words[(i + j) % 12]) for j in range(2 + i % 5)) + "\n" for i in range(n)))
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    subprocess.run([BIN / "fairseq-preprocess", "-s", "x", "-t", "y", "--trainpref", tmp_path / "train",
                    "--validpref", tmp_path / "valid", "--destdir", tmp_path / "bin", "--joined-dictionary",
                    "--workers", "1"], check=True, capture_output=True, env=env)
    subprocess.run([BIN / "fairseq-train", tmp_path / "bin", "--arch", "transformer", "--encoder-layers", "1",
                    "--decoder-layers", "1", "--encoder-embed-dim", "8", "--decoder-embed-dim", "8",
                    "--encoder-ffn-embed-dim", "16", "--decoder-ffn-embed-dim", "16",
                    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
                    "--optimizer", "adam", "--lr", "1e-2", "--max-tokens", "200", "--max-epoch", "2",
                    "--save-dir", tmp_path / "ckpt", "--cpu", "--no-progress-bar", "--num-workers", "0",
                    "--required-batch-size-multiple", "1"], check=True, capture_output=True, env=env)
    assert average("--inputs", tmp_path / "ckpt", "--num-epoch-checkpoints", "2",
                   "--output", tmp_path / "avg.pt") == 0
    c1, c2, out = (load(tmp_path / "ckpt" / "checkpoint1.pt"), load(tmp_path / "ckpt" / "checkpoint2.pt"),
                   load(tmp_path / "avg.pt"))
    assert set(out["model"]) == set(c1["model"])
    for key, value in out["model"].items():
        expected = ((c1["model"][key].double() + c2["model"][key].double()) / 2).to(value.dtype)
        assert torch.equal(value, expected), key
    assert not torch.equal(c1["model"]["encoder.embed_tokens.weight"], c2["model"]["encoder.embed_tokens.weight"])
    assert out["cfg"]["model"].arch == "transformer"
    assert out["optimizer_history"] == c2["optimizer_history"]  # the newest input's state

    from fairseq import checkpoint_utils

    models, cfg = checkpoint_utils.load_model_ensemble([str(tmp_path / "avg.pt")],
                                                       arg_overrides={"data": str(tmp_path / "bin")})
    weight = models[0].state_dict()["encoder.embed_tokens.weight"]
    assert torch.equal(weight, out["model"]["encoder.embed_tokens.weight"])


def test_output_equal_to_an_input_is_refused(tmp_path, capsys):
    fake_checkpoint(tmp_path / "checkpoint1.pt", seed=1)
    fake_checkpoint(tmp_path / "checkpoint2.pt", seed=2)
    before = (tmp_path / "checkpoint2.pt").read_bytes()
    os.symlink(tmp_path / "checkpoint2.pt", tmp_path / "link.pt")
    for output in (tmp_path / "checkpoint2.pt", tmp_path / "sub" / ".." / "checkpoint2.pt", tmp_path / "link.pt"):
        assert average("--inputs", tmp_path / "checkpoint1.pt", tmp_path / "checkpoint2.pt", "--output", output) == 1
        assert "is one of the inputs" in capsys.readouterr().err
    assert average("--inputs", tmp_path, "--num-epoch-checkpoints", "2", "--output", tmp_path / "checkpoint1.pt") == 1
    assert (tmp_path / "checkpoint2.pt").read_bytes() == before


def test_non_finite_weights_are_reported_by_name(tmp_path, capsys):
    fake_checkpoint(tmp_path / "a.pt", seed=1)
    state = fake_checkpoint(tmp_path / "b.pt", seed=2)
    state["model"]["encoder.h"][1] = float("nan")
    state["model"]["decoder.b"][0] = float("inf")
    torch.save(state, tmp_path / "b.pt")
    assert average("--inputs", tmp_path / "a.pt", tmp_path / "b.pt", "--output", tmp_path / "o.pt") == 1
    err = capsys.readouterr().err
    assert "b.pt holds NaN or infinite weights in 2 tensors: encoder.h, decoder.b" in err
    assert not (tmp_path / "o.pt").exists()
