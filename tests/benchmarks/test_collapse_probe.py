"""benchmarks/collapse_probe.py on a real fairseq-train checkpoint of RAN-ALL: it tells a model
whose encoder still separates its tokens from the same model with its tokens washed out (a
constant added by every encoder self-attention), and bad input is one line. The probe runs
in process (its ``main``), the command itself once: the refusal of a missing checkpoint."""
import contextlib
import io
import os
import re
import runpy
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from support.trained_checkpoints import ENV, family_checkpoints

PROBE = os.path.join(REPO, "benchmarks", "collapse_probe.py")
pytestmark = pytest.mark.usefixtures("one_thread")


def probe(checkpoint, data_bin, *extra):
    """The probe's ``main`` in this process: (exit status, stdout, the message it exits with)."""
    main = runpy.run_path(PROBE)["main"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            rc, err = main([str(checkpoint), str(data_bin), "--batch", "0", *extra]), ""
        except SystemExit as refused:
            rc, err = 1, str(refused.code)
    return rc, out.getvalue(), err


def rows(stdout, side):
    """{layer: [(norm, cosine), ...]} of the ``side`` ("enc"/"dec") table."""
    table, current = {}, None
    for line in stdout.splitlines():
        if line.startswith(("enc layer", "dec layer")):
            current = line[:3]
        elif current == side and "|" in line and line.split("|")[0].strip().isdigit():
            cells = [c.split() for c in line.split("|")[1:]]
            table[int(line.split("|")[0])] = [(float(n), float(c)) for n, c in cells]
    return table


@pytest.fixture(scope="module")
def ran(tmp_path_factory, tiny_data_bin):
    return family_checkpoints(tmp_path_factory, tiny_data_bin)["ran"]


def test_probe_sees_tokens_washed_out(ran, tiny_data_bin, tmp_path):
    rc, out, err = probe(ran, tiny_data_bin)
    assert rc == 0, err[-2000:]
    healthy = rows(out, "enc")
    assert sorted(healthy) == [0, 1] and sorted(rows(out, "dec")) == [0, 1]
    assert all(-1.0 <= cos <= 1.0 and norm > 0 for cells in healthy.values() for norm, cos in cells)
    assert healthy[1][0][1] < 0.95  # the second layer's input still tells tokens apart
    assert "decoder NLL" in out
    # every encoder self-attention adds one large vector to every token: post-LN, the
    # second layer's input is then that vector for every token of every sentence
    state = torch.load(ran, weights_only=False)  # a file the tests wrote
    constant = 1000.0 * torch.randn(state["model"]["encoder.layers.0.self_attn.out_proj.bias"].shape,
                                    generator=torch.Generator().manual_seed(0))
    for key in state["model"]:
        if key.startswith("encoder.layers.") and key.endswith("self_attn.out_proj.bias"):
            state["model"][key] = constant.clone()
    washed = tmp_path / "washed.pt"
    torch.save(state, washed)
    rc, out, err = probe(washed, tiny_data_bin)
    assert rc == 0, err[-2000:]
    assert rows(out, "enc")[1][0][1] > 0.999
    nll = re.search(r"own sources ([0-9.]+), sources of other sentences ([0-9.]+)", out)
    own, other = map(float, nll.groups())
    assert abs(own - other) < 1e-3  # the decoder cannot tell the sources apart any more


def test_bad_input_is_one_line(ran, tiny_data_bin, tmp_path):
    rc, _, err = probe(ran, tiny_data_bin, "--batch", "100000")
    assert rc != 0 and err.strip().splitlines()[-1].startswith("collapse_probe: the training data has fewer")
    assert "Traceback" not in err
    # the command itself: one line on stderr, no traceback
    proc = subprocess.run([sys.executable, PROBE, str(tmp_path / "missing.pt"), str(tiny_data_bin)],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("collapse_probe: cannot load"), proc.stderr[-2000:]
