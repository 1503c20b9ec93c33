"""Attention analysis: metrics against hand-computed values, map capture on every
architecture, the FLOPs report against EA Table 5, PNG plots, and the command-line tool
end to end on a checkpoint trained here."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import REPO, build_model, cli, random_batch
from ea_fairseq.analysis import flops as F
from ea_fairseq.analysis import metrics as M
from ea_fairseq.analysis.maps import AttentionCapture
from ea_fairseq.models import building
from support.families import FAMILIES, LSRA_BRANCHES

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LN2 = math.log(2.0)


# -- metrics on hand-made matrices -------------------------------------------------------------
def test_entropy_hand_values_and_uniform_is_maximal():
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.25, 0.25, 0.5]])
    expected = [LN2, 0.0, -(2 * 0.25 * math.log(0.25) + 0.5 * math.log(0.5))]  # 1.5 ln 2
    assert M.attention_entropy(p).tolist() == pytest.approx(expected, abs=1e-6)
    for n in (1, 2, 7, 30):
        uniform = torch.full((n,), 1.0 / n)
        assert M.attention_entropy(uniform).item() == pytest.approx(math.log(n), abs=1e-5)
        others = torch.softmax(torch.randn(200, n, generator=torch.Generator().manual_seed(n)), -1)
        assert (M.attention_entropy(others) <= math.log(n) + 1e-5).all()


def test_js_divergence_hand_values():
    p, q = torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0])
    # M = (0.75, 0.25); KL(p||M) = 0.5 ln(4/3), KL(q||M) = ln(4/3); JS = 0.75 ln(4/3)
    assert M.js_divergence(p, q).item() == pytest.approx(0.75 * math.log(4 / 3), abs=1e-6)
    assert M.js_divergence(q, p).item() == pytest.approx(0.75 * math.log(4 / 3), abs=1e-6)
    assert M.js_divergence(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])).item() == pytest.approx(LN2)
    r = torch.softmax(torch.randn(5, 9), -1)
    assert M.js_divergence(r, r).abs().max().item() < 1e-6


@pytest.mark.parametrize("a,div,disagreement", [
    ([[1, 0], [0, 1]], 0.0, 0.5),            # orthogonal heads: A A^T = I; cos = 1, 0, 0, 1
    ([[1, 0], [1, 0]], 2.0, 1.0),            # identical one-hot heads: off-diagonal 1s
    ([[0.5, 0.5], [0.5, 0.5]], 1.0, 1.0),    # A A^T - I = [[-.5, .5], [.5, -.5]]
    ([[1, 0], [0.5, 0.5]], 0.75, (2 + 2 / math.sqrt(2)) / 4),  # [[0, .5], [.5, -.5]]; cos = 1/sqrt2
    ([[1, 0, 0], [0, 1, 0], [0, 0, 1]], 0.0, 1 / 3),
])
def test_div_and_disagreement_hand_values(a, div, disagreement):
    a = torch.tensor(a, dtype=torch.float)
    assert M.head_div(a).item() == pytest.approx(div, abs=1e-6)  # DropAttention Eq. (11)
    assert M.head_disagreement(a).item() == pytest.approx(disagreement, abs=1e-6)  # Eq. (12)


def test_layer_metrics_ignore_padding_and_identical_layers_have_zero_js():
    g = torch.Generator().manual_seed(0)
    bsz, heads, tgt, src = 3, 4, 5, 6
    w = torch.softmax(torch.randn(bsz, heads, tgt, src, generator=g), -1)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    garbage = w.clone()
    garbage[~mask[:, None, :, None].expand_as(w)] = 0.0  # padded query rows: not distributions
    garbage[2, :, 3, 0] = 1.0
    for mode in M.JS_MODES:
        acc = M.LayerMetrics(mode)
        acc.update([garbage, garbage, garbage.flip(-1)], mask)
        r = acc.result()
        assert r["queries"] == 9
        rows = w.permute(0, 2, 1, 3)[mask]  # the 9 real queries, (9, heads, src)
        assert r["entropy"][0] == pytest.approx(M.attention_entropy(rows).mean().item(), abs=1e-6)
        assert r["div"][1] == pytest.approx(M.head_div(rows).mean().item(), abs=1e-5)
        assert r["disagreement"][1] == pytest.approx(M.head_disagreement(rows).mean().item(), abs=1e-6)
        assert r["js"][0][1] == pytest.approx(0.0, abs=1e-7)  # identical layers
        assert r["js"][0][0] == 0.0 and r["js"][0][2] > 0.01 and r["js"][0][2] == r["js"][2][0]

    uniform = torch.full((2, heads, tgt, src), 1.0 / src)
    acc = M.LayerMetrics()
    acc.update([uniform, uniform])
    assert acc.result()["entropy"] == pytest.approx([math.log(src)] * 2, abs=1e-6)
    # the printed report reads the numbers for its reader: the caveats under the table
    report = M.markdown({"uniform": {"encoder.self": acc.result()}})
    table, caveats = report.split("\n\nHow to read them: ", 1)
    assert "| uniform " in table and "larger means LESS diverse heads" in caveats
    assert "not with the paper" in caveats and "log 2 = 0.6931" in caveats
    assert acc.result()["div"][0] == pytest.approx(heads * (1 / src - 1) ** 2 + heads * (heads - 1) / src ** 2)


# -- capture on every architecture -------------------------------------------------------------
#: the families whose maps the capture is checked on (families.py: ``Family.maps``)
CAPTURED = [name for name, f in FAMILIES.items() if f.maps is not None]
#: those the matmul count is checked on here (LSRA's light convolution: test_conv_transformer.py)
COUNTED = [name for name in CAPTURED if not set(LSRA_BRANCHES) & set(FAMILIES[name].mechanism)]


@pytest.mark.parametrize("family_name", CAPTURED)
def test_capture_every_layer_and_head_without_changing_the_model(family_name, dictionary):
    family = FAMILIES[family_name]
    model, args = build_model(*family.args(), "--encoder-layers", "3", "--decoder-layers", "2")
    model.eval()
    src, lengths, prev = random_batch(dictionary, [7, 4], 5)
    with torch.no_grad():
        plain, extra = model(src, lengths, prev)
        with AttentionCapture(model) as cap:
            captured, extra_captured = model(src, lengths, prev)
    maps = cap.result()
    assert (captured - plain).abs().max().item() < 1e-5
    assert list(maps) == ["encoder.self", "decoder.self", "decoder.cross"]
    shapes = {"encoder.self": (2, 4, 7, 7), "decoder.self": (2, 4, 5, 5), "decoder.cross": (2, 4, 5, 7)}
    layers = {"encoder.self": 3, "decoder.self": 2, "decoder.cross": 2}
    for name, kinds in maps.items():
        assert len(kinds["weights"]) == layers[name]
        for w in kinds["weights"]:
            assert tuple(w.shape) == shapes[name]
            if family.arch == "hcsa_lite" and name != "decoder.cross":  # the density, unnormalised
                assert (w.sum(-1) <= 1 + 1e-6).all() and (w.sum(-1) > 0.2).all()
            else:
                assert torch.allclose(w.sum(-1), torch.ones(()), atol=1e-5)
    # fairseq's own alignment output is the head average of the last cross-attention
    assert torch.allclose(maps["decoder.cross"]["weights"][-1].mean(1), extra["attn"][0], atol=1e-6)
    # causal decoder maps, padded source keys get nothing
    assert maps["decoder.self"]["weights"][0].triu(1).abs().max() == 0
    assert maps["encoder.self"]["weights"][0][1, :, :, :3].abs().max() == 0  # 3 pads on the left
    carried = {k for kinds in maps.values() for k in kinds} - {"weights"}
    assert carried == family.maps
    if family_name == "ea-lite":  # EA: weights = softmax(A_logit), A_logit from the parts
        enc = maps["encoder.self"]
        beta = model.encoder.layers[0].self_attn.beta
        for i in range(3):
            logits = enc["logits"][i][0]  # unpadded sentence
            assert torch.allclose(enc["weights"][i][0], torch.softmax(logits, -1), atol=1e-5)
        assert enc["convolution"][0].min() >= 0  # β·ReLU(conv)
        # first layer (no α skip), unpadded sentence: A_logit = β·ReLU(conv) + (1-β)·QK^T/√d
        assert torch.allclose(enc["logits"][0][0], enc["convolution"][0][0]
                              + (1 - beta) * enc["dot_product"][0][0], atol=1e-5)


# -- FLOPs -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def table5_counts():
    out = {}
    for arch in F.PAPER_TABLE5:
        out[arch] = F.count_model(building.build_model(arch, vocab=100, meta=True)[0], 30, 30, name=arch)
    return out


def test_params_reproduce_table5(table5_counts):
    for arch, (_, params, _) in F.PAPER_TABLE5.items():
        assert F.human(table5_counts[arch].params) == F.human(params), arch


def test_flops_table5_convention(table5_counts):
    """2 x multiplications reproduces Transformer-Lite, Transformer-Base and EA-Base to the
    paper's last digit; EA-Lite comes out 0.15M (0.09%) below the paper's 163.46M."""
    for arch, (_, _, paper) in F.PAPER_TABLE5.items():
        ours = table5_counts[arch].flops("table5")
        if arch == "ea_transformer_lite":
            assert F.human(ours) == "163.31M" and abs(ours / paper - 1) < 1e-3
        else:
            assert F.human(ours) == F.human(paper), arch
    report = F.markdown_report(list(table5_counts.values()))
    assert "| transformer_lite (Transformer-Lite)" in report and "158.31M" in report


@pytest.mark.parametrize("name", COUNTED)
def test_analytic_matmul_count_equals_torch_flop_counter(name):
    """The module walk counts what the kernels compute: 2 x MACs of every matrix product
    (plus the output projection) equals torch's FlopCounterMode on a forward pass. The
    map convolutions are counted at the map's size (the math of EA/PA); a kernel may also
    compute border rows it crops (shifted layouts), never fewer."""
    model = building.build_model(*FAMILIES[name].args(), "--encoder-layers", "2", "--decoder-layers", "2",
                                 vocab=60)[0].eval()
    for m in model.modules():  # fairseq's own attention path (the fused one hides its bmm)
        if hasattr(m, "skip_embed_dim_check"):
            m.skip_embed_dim_check = True
    src = torch.randint(4, 60, (1, 9))
    prev = torch.randint(4, 60, (1, 6))
    with torch.no_grad():
        model(src, torch.tensor([9]), prev)  # warm-up pass
        with FlopCounterMode(display=False) as counter:
            model(src, torch.tensor([9]), prev)
    total = F.count_model(model, 9, 6).total
    by_op = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    conv = by_op.pop("aten.convolution", 0)
    # RAN's transition W (Eq. 3) on the rows a pass needs: "input_independent" (with the
    # layer norm, which the counter does not see)
    ran = sum(2 * m.num_layers * m.initial.size(0) * n * m.max_positions * m.transition.in_features
              for m, n in ((getattr(model.encoder, "recurrent_matrices", None), 9),
                           (getattr(model.decoder, "recurrent_matrices", None), 6)) if m is not None)
    assert 2 * sum(total.get(k, 0) for k in ("linear", "attention", "output_projection")) + ran == sum(by_op.values())
    ours_conv = 2 * total.get("map_conv", 0)
    assert ours_conv <= conv <= ours_conv * (9 + 2) * (9 + 2) / (6 * 6) and (conv > 0) == (ours_conv > 0)


# -- plots ------------------------------------------------------------------------------------
def assert_png(path):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    import matplotlib.image

    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 50 and img.shape[1] > 50


def test_plots_entropy_and_js_are_png(tmp_path):
    from ea_fairseq_cli import metric_plots

    def fake(entropy):
        n = len(entropy)
        return {"layers": n, "entropy": entropy, "div": [0.1] * n, "disagreement": [0.5] * n,
                "js": [[abs(i - j) / 10 for j in range(n)] for i in range(n)], "js_mode": "mean"}

    results = {"a": {"encoder.self": fake([1.0, 1.2, 0.9]), "decoder.cross": fake([2.0, 1.5, 1.0])},
               "b": {"encoder.self": fake([1.1, 1.0, 0.8])}}
    assert_png(metric_plots.plot_entropy(results, str(tmp_path / "e.png")))
    assert_png(metric_plots.plot_js(results, str(tmp_path / "js.png")))


def test_plot_colour_scales_fit_the_data(tmp_path, monkeypatch):
    """Weights on a scale from 0 to the largest weight shown (square root: a near-uniform
    head is a mid tone, not dark); the kinds figure's colour bars are readable; the entropy
    axis shows plain values (no offset such as "+2")."""
    from ea_fairseq_cli import metric_plots, plots

    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, out: figures.append(fig) or out)
    keys = 7
    weights = np.full((2, 3, 5, keys), 1.0 / keys, dtype=np.float32)
    weights[:, 0] = np.eye(5, keys) * 0.5 + 0.5 / keys  # peaked head: largest weight 0.57
    norm = plots._norm(weights, probabilities=True)
    assert norm.vmin == 0 and norm.vmax == pytest.approx(0.5 + 0.5 / keys)
    assert 0.4 < norm(1.0 / keys) < 0.6  # uniform head: mid tone (a fixed 0-1 scale gives 0.14)
    signed = plots._norm(np.array([-3.0, 0.5, np.nan]), probabilities=False)
    assert (signed.vmin, signed.vmax) == (-3.0, 3.0) and plots._cmap(signed) == "RdBu_r"
    # EA's convolution term, beta * ReLU(...), masked entries 0: one sign, a sequential scale from 0
    convolution = plots._norm(np.array([[0.0, 0.2], [np.nan, 1.5]]), probabilities=False)
    assert (convolution.vmin, convolution.vmax) == (0.0, 1.5) and plots._cmap(convolution) == "Reds"
    assert convolution(0.0) == 0.0 and convolution(1.5) == 1.0  # the whole colour range is used
    negative = plots._norm(np.array([-2.0, -0.5, 0.0]), probabilities=False)
    assert (negative.vmin, negative.vmax) == (-2.0, 0.0) and plots._cmap(negative) == "Blues_r"

    class Dump:
        sentences = {0: type("S", (), {"kinds": {"encoder.self": ["weights", "logits"]}})()}

        def shape(self, sid, attention, kind):
            return weights.shape

        def get(self, sid, attention, kind, part):
            layers, heads, rows, cols = part
            return (weights if kind == "weights" else np.log(weights) * 40)[layers][:, heads][:, :, rows, cols]

        def axis_tokens(self, sid, attention):
            return [f"t{i}" for i in range(5)], [f"s{i}" for i in range(keys)]

    plots.plot_maps(Dump(), 0, "encoder.self", out=str(tmp_path / "m.png"))
    plots.plot_maps(Dump(), 0, "encoder.self", out=str(tmp_path / "p.png"), scale="panel")
    plots.plot_kinds(Dump(), 0, "encoder.self", out=str(tmp_path / "k.png"))
    maps, panels, kinds = figures
    assert len(maps.axes) == 2 * 3 + 1 and len(panels.axes) == 2 * 3 * 2  # one bar, or one per panel
    images = [ax.images[0] for ax in maps.axes if ax.images]
    assert all(im.norm is images[0].norm and im.norm.vmax == pytest.approx(0.5 + 0.5 / keys) for im in images)
    kinds.canvas.draw()
    bars = [ax for ax in kinds.axes if not ax.images]
    assert len(bars) == 2
    for bar in bars:
        box = bar.get_window_extent().transformed(kinds.dpi_scale_trans.inverted())
        assert box.width > 1.2 and box.height > 0.1  # inches
        assert len([t for t in bar.get_xticklabels() if t.get_text()]) >= 3
    metrics = {"layers": 3, "entropy": [2.00001, 2.00002, 2.00004], "div": [0.1] * 3,
               "disagreement": [0.5] * 3, "js": [[0.0] * 3] * 3, "js_mode": "mean"}
    metric_plots.plot_entropy({"a": {"encoder.self": metrics}}, str(tmp_path / "e.png"))
    entropy = figures[-1]
    entropy.canvas.draw()
    assert entropy.axes[0].yaxis.get_major_formatter().get_offset() == ""
    assert any(t.get_text().startswith("2.0000") for t in entropy.axes[0].get_yticklabels())


# -- command line, end to end --------------------------------------------------------------------
def run(cmd, env=None):
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _env():
    return dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny_data_bin, tmp_path_factory):
    """ea_transformer_lite, 2+2 layers, trained for 2 updates by fairseq-train --user-dir."""
    save = str(tmp_path_factory.mktemp("analysis_ckpt"))
    run([cli("fairseq-train"), tiny_data_bin, "--user-dir", os.path.join(REPO, "ea_fairseq"),
         "--arch", "ea_transformer_lite", "--encoder-layers", "2", "--decoder-layers", "2",
         "--share-all-embeddings", "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500",
         "--max-update", "2", "--disable-validation", "--no-epoch-checkpoints", "--save-dir", save,
         "--cpu", "--num-workers", "0", "--no-progress-bar", "--seed", "1"], env=_env())
    return os.path.join(save, "checkpoint_last.pt")


def test_cli_end_to_end(tiny_checkpoint, tiny_data_bin, tmp_path):
    """``python -m ea_fairseq_cli.analysis dump`` in a subprocess (while the other subcommands
    run in this process through the same entry point, ``cli.main``)."""
    from ea_fairseq_cli import analysis as analysis_cli

    out = tmp_path / "out"
    dump_cmd = [sys.executable, "-m", "ea_fairseq_cli.analysis", "dump", tiny_checkpoint,
                "--data", tiny_data_bin, "--split", "test", "--ids", "0", "3",
                "--out", str(out / "maps.npz")]
    dump_proc = subprocess.Popen(dump_cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=_env(), cwd=REPO)

    # raw pre-BPE'd sentences, beam-5 hypothesis (no reference given)
    with open(os.path.join(os.path.dirname(tiny_data_bin), "test.src")) as f:
        lines = [next(f) for _ in range(2)]
    raw = tmp_path / "raw.src"
    raw.write_text("".join(lines))
    assert analysis_cli.main(["dump", tiny_checkpoint, "--data", tiny_data_bin, "--input", str(raw),
                              "--max-len-b", "20", "--out", str(out / "raw.npz")]) == 0
    raw_meta = json.load(open(out / "raw.json"))
    assert raw_meta["decoder_targets"] == "beam hypothesis" and len(raw_meta["sentences"]) == 2
    assert raw_meta["sentences"][1]["source"] == lines[1].split() + ["</s>"]

    # metrics over the whole valid set: Markdown, CSV and JSON
    analysis_cli.main(["metrics", tiny_checkpoint, "--names", "ea", "--data", tiny_data_bin,
                       "--split", "valid", "--out", str(out / "metrics"), "--no-progress-bar"])
    result = json.load(open(out / "metrics.json"))["models"]["ea"]
    assert result["encoder.self"]["queries"] > 40  # every token of the 40 valid sentences
    for attention in ("encoder.self", "decoder.self", "decoder.cross"):
        r = result[attention]
        assert r["layers"] == 2 and all(0 < e < math.log(60) for e in r["entropy"])
        assert r["js"][0][0] == 0 and 0 < r["js"][0][1] < LN2
    assert (out / "metrics.md").read_text().count("| ea ") == 6
    assert (out / "metrics.csv").read_text().splitlines()[0] == "model,attention,layer,entropy,div,disagreement"

    # flops of the trained checkpoint beside an architecture
    analysis_cli.main(["flops", "--arch", "transformer_lite", "--checkpoint", tiny_checkpoint,
                       "--data", tiny_data_bin, "--out", str(out / "flops")])
    report = (out / "flops.md").read_text()
    assert "| transformer_lite (Transformer-Lite) | 2.48M" in report and "158.31M" in report
    assert [m["model"] for m in json.load(open(out / "flops.json"))["models"]][1].endswith("checkpoint_last")

    # the dump of the subprocess: reference-forced maps of two test sentences
    stdout, stderr = dump_proc.communicate(timeout=300)
    assert dump_proc.returncode == 0, stderr[-4000:]
    assert "wrote" in stdout
    z = np.load(out / "maps.npz", allow_pickle=False)
    meta = json.loads(str(z["meta.json"]))
    assert [s["id"] for s in meta["sentences"]] == [0, 3]
    s0 = meta["sentences"][0]
    assert s0["source"][-1] == "</s>" and s0["decoder_input"][0] == "</s>" and s0["target"][-1] == "</s>"
    for attention, rows, cols in (("encoder.self", "source", "source"),
                                  ("decoder.self", "target", "decoder_input"),
                                  ("decoder.cross", "target", "source")):
        assert set(s0["maps"][attention]) == {"weights", "dot_product", "convolution", "logits"}
        w = z[f"0/{attention}/weights"]
        assert w.shape == (2, 4, len(s0[rows]), len(s0[cols]))
        assert np.allclose(w.sum(-1), 1.0, atol=1e-5)
    assert np.triu(z["0/decoder.self/convolution"][:, :, :, :], 1).max() == 0  # masked: zero
    assert json.load(open(out / "maps.json"))["sentences"][1]["id"] == 3

    # plots
    analysis_cli.main(["plot", "maps", str(out / "maps.npz"), "--sentence", "0", "--attention",
                       "encoder.self", "decoder.cross", "--out-dir", str(out / "fig")])
    analysis_cli.main(["plot", "kinds", str(out / "maps.npz"), "--sentence", "3", "--attention",
                       "encoder.self", "--out-dir", str(out / "fig")])
    analysis_cli.main(["plot", "entropy", str(out / "metrics.json"), str(out / "metrics.json"),
                       "--out", str(out / "fig" / "entropy.png")])
    analysis_cli.main(["plot", "js", str(out / "metrics.json"), "--out", str(out / "fig" / "js.png")])
    pngs = sorted(os.listdir(out / "fig"))
    assert pngs == ["entropy.png", "js.png", "s0_decoder.cross_weights.png",
                    "s0_encoder.self_weights.png", "s3_encoder.self_head1.png"]
    for p in pngs:
        assert_png(out / "fig" / p)
