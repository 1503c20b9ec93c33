"""What the tests of the quality benchmark (benchmarks/quality.py) share: the repository, the
script, its sibling modules imported as the script imports them, the script run as a command, a
tiny corpus cut from the shipped one, and a seed derived from a trained one (not trained)."""
import contextlib
import importlib
import json
import lzma
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "quality.py"


def benchmarks_module(name: str):
    """benchmarks/NAME.py, imported as quality.py imports its sibling (benchmarks/ on sys.path)."""
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    return importlib.import_module(name)


def quality(*args, check=True):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, check=check)


def tiny_corpus(out: Path, sizes) -> None:
    """``sizes[split]`` short verse pairs of the shipped corpus per split (quick BPE, training and
    beam search), written as the runner's ``--corpus`` reads them."""
    out.mkdir()
    corpus = REPO / "examples" / "translation" / "bible-es-en"
    for split, n in sizes.items():
        es = lzma.open(corpus / f"{split}.es.xz", "rt", encoding="utf-8").read().splitlines()
        en = lzma.open(corpus / f"{split}.en.xz", "rt", encoding="utf-8").read().splitlines()
        pairs = [(s, t) for s, t in zip(es, en) if len(s.split()) <= 9 and len(t.split()) <= 9][:n]
        assert len(pairs) == n
        for lang, k in (("es", 0), ("en", 1)):
            with lzma.open(out / f"{split}.{lang}.xz", "wt", encoding="utf-8") as f:
                f.writelines(p[k] + "\n" for p in pairs)


def derive_seed(results: Path, system: str, sentences, work: Path) -> None:
    """runs/SYSTEM/seed2 derived from seed 1 (not trained): seed 1's fairseq-generate output with
    the hypotheses of ``sentences`` replaced by their references, scored by ea-fairseq-bleu (in
    process, with the arguments the runner gave it) into the runner's layout: seed 1's records,
    logs and probe, a fresh eval/, its references linked to refs/ by the runner's own code."""
    from ea_fairseq_cli import bleu

    q = benchmarks_module("quality_runner")

    seed1 = (results / "runs" / system / "seed1").resolve()
    run = results / "runs" / system / "seed2"
    shutil.copytree(seed1, run, symlinks=True, ignore=shutil.ignore_patterns("eval", "valid"))
    record = json.loads((run / "run.json").read_text())
    argv = shlex.split(record["commands"][1])[1:]  # ea-fairseq-bleu GENERATE_OUTPUT --mode wmt ...
    generated = Path(argv[0]).read_text(encoding="utf-8").splitlines()
    refs = {line.split("\t")[0][2:]: line.split("\t")[-1] for line in generated if line.startswith("T-")}
    out = []
    for line in generated:
        fields = line.split("\t")
        tag, _, sid = fields[0].partition("-")
        if tag in ("H", "D") and sid.isdigit() and int(sid) in sentences:
            fields = fields[:2] + [refs[sid]]  # (id, score, text): an empty hypothesis has no text field
        out.append("\t".join(fields))
    work.mkdir(parents=True)
    (work / "generate.out").write_text("\n".join(out) + "\n", encoding="utf-8")
    argv[0] = str(work / "generate.out")
    argv[argv.index("--out-prefix") + 1] = str(run / "eval" / "test.es-en")
    (run / "eval").mkdir()
    with open(run / "eval" / "bleu-test.es-en.txt", "w", encoding="utf-8") as log, contextlib.redirect_stdout(log):
        assert bleu.main(argv) == 0
    runner = q.Runner.__new__(q.Runner)  # link_refs only: nothing here trains
    runner.results = str(results)
    runner.link_refs(str(run / "eval"))
    record.update(seed=2, derived=f"from seed 1 by tests/support/quality_support.py: the hypotheses of "
                                  f"test sentences {list(sentences)} replaced by their references",
                  commands=[shlex.join(["ea-fairseq-bleu", *argv])])
    (run / "run.json").write_text(json.dumps(record, indent=1))
