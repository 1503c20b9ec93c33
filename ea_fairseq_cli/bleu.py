"""Score a fairseq-generate output file; every number printed says which BLEU (or chrF,
COMET) it is.

  ea-fairseq-bleu GENERATE_OUTPUT --mode {iwslt,wmt14-en-de,wmt} \\
      [--target-lang de] [--raw-ref test.raw.en-de.de] [--expect-idx test.en-de.en.idx]
      [--allow-missing] [--out-prefix PREFIX] [--comet-model PATH [--raw-src FILE]]

BLEU variants (they are not comparable with each other):

* fairseq tokenized BLEU: the ``BLEU4 = ...`` line fairseq-generate prints itself,
  computed on the tokenized, BPE-removed hypotheses and references (whitespace tokens,
  case-sensitive). For IWSLT'14 De-En (lowercased data) this is the number the EA and PA
  papers report. ``tokenized BLEU`` is the same computed here from the H and T lines
  (multi-bleu.perl), which the significance tests (ea-fairseq-compare) resample.
* compound-split tokenized BLEU (``--mode wmt14-en-de``), both conventions, labelled:
  - fairseq's ``compound_split_bleu.sh`` (what most fairseq papers report): every hyphen
    between two non-space characters of generate's tokenized H and T lines split as
    ``##AT##-##AT##``, the lines otherwise as they are, so the aggressive-hyphen token
    "a @-@ b" becomes "a @ ##AT##-##AT## @ b";
  - tensor2tensor's ``get_ende_bleu.sh``, which re-tokenizes detokenized text without
    ``-a``: here "@-@" is joined first, so "a @-@ b" and "a-b" both become
    "a ##AT##-##AT## b";
  then corpus BLEU with sacrebleu's ``tokenize='none'``, no smoothing (= multi-bleu.perl
  and ``fairseq-score`` on those files).
* tokenized BLEU (``--mode wmt``): multi-bleu.perl on generate's tokenized H and T lines.
* detokenized sacreBLEU (``--mode wmt14-en-de`` and ``wmt``): hypotheses detokenized with
  sacremoses' MosesDetokenizer, scored against the untokenized references (``--raw-ref``)
  with sacrebleu's default settings; its signature is printed.

In every mode also **chrF** and **chrF++** (sacreBLEU's ``CHRF``, defaults: character 6-grams,
beta 2; chrF++ adds word bigrams), with their signatures, on the detokenized hypotheses and
raw references where the mode has them (wmt14-en-de, wmt), else on generate's tokenized H/T
lines (iwslt). **COMET** when ``--comet-model`` names a checkpoint (or a model id in the local
Hugging Face cache) and unbabel-comet is installed: the mean of its segment scores, which go to
``PREFIX.seg.comet``. unbabel-comet needs numpy<2, so it has a venv of its own with a tested
set (``bash scripts/setup_comet_env.sh``: ``pip install -c constraints-comet.txt -e '.[comet]'``
from this repository, which is on no package index). BLEU and chrF are printed and written
first; when the COMET asked for cannot be scored (not installed, not importable, the model not
here: offline, a model id cannot be downloaded) one line says why and the exit status is 3.

With ``--out-prefix`` the hypotheses and references each metric was computed on are written
as ``PREFIX.hyp.NAME`` / ``PREFIX.ref.NAME`` and the scores as ``PREFIX.scores.json``,
which ``ea-fairseq-compare`` reads (mean and deviation over seeds, paired
bootstrap between systems).

Every test sentence must have been translated (``--expect-idx``); ``--allow-missing``
accepts an output without some (fairseq-generate --skip-invalid-size-inputs-valid-test),
and every score then says on how many sentences it was computed.

``fairseq-score --sacrebleu`` is not used: it is broken with sacrebleu 2.x.
"""
import argparse
import json
import os
import re
import struct
import sys
from typing import Dict, List, Optional

import numpy as np

from . import add_version_option
from ._safety import ConfinedPathError, inside, open_inside, replaced
from .inputs import need_file, need_output_folder, refusal

_COMPOUND = re.compile(r"(\S)-(\S)")
_FAIRSEQ_BLEU = re.compile(r"^Generate .*?: (BLEU4? = .*)$")

# metric name -> (label, sacreBLEU metric class, its keyword arguments)
TOKENIZED = dict(tokenize="none", smooth_method="none", force=True)
DETOKENIZED: dict = {}
METRICS = {
    "tok": ("tokenized BLEU (generate's tokenized H/T lines, sacrebleu tokenize=none, no smoothing"
            " = multi-bleu.perl)", "BLEU", TOKENIZED),
    "split-fairseq": ("compound-split BLEU, fairseq convention (compound_split_bleu.sh: ##AT##-##AT## "
                      "on generate's tokenized H/T lines as they are, 'a @-@ b' -> 'a @ ##AT##-##AT## @ b'; "
                      "multi-bleu.perl)", "BLEU", TOKENIZED),
    "split-t2t": ("compound-split BLEU, tensor2tensor convention (get_ende_bleu.sh: '@-@' joined "
                  "first, 'a @-@ b' -> 'a ##AT##-##AT## b'; multi-bleu.perl)", "BLEU", TOKENIZED),
    "sacrebleu": ("detokenized sacreBLEU (sacremoses detok of hyps vs raw references)", "BLEU", DETOKENIZED),
    # character n-gram F-scores (Popovic 2015, 2017) with sacreBLEU's defaults; computed on the
    # detokenized text where the mode has raw references, else on the tokenized H/T lines
    "chrf": ("chrF", "CHRF", {}),
    "chrf++": ("chrF++ (chrF with word bigrams)", "CHRF", dict(word_order=2)),
}
CHRF_TEXT = {"detok": "detokenized hyps vs raw references", "tok": "generate's tokenized H/T lines"}
MODE_METRICS = {  # the first is the one ea-fairseq-compare lists first
    "iwslt": ["tok", "chrf", "chrf++"],
    "wmt14-en-de": ["split-fairseq", "split-t2t", "sacrebleu", "chrf", "chrf++"],
    "wmt": ["tok", "sacrebleu", "chrf", "chrf++"],
}


def parse_generate(path: str) -> Dict[str, Dict[int, str]]:
    """The S/T/H/D lines of a fairseq-generate output, by sentence id (best hypothesis only)."""
    out: Dict[str, Dict[int, str]] = {"S": {}, "T": {}, "H": {}, "D": {}}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            tag, _, rest = line.partition("-")
            if tag not in out or "\t" not in rest:
                continue
            sid, *fields = rest.split("\t")
            if not sid.isdigit():
                continue
            text = fields[-1] if fields else ""
            if tag in ("H", "D") and len(fields) < 2:  # "H-3\tscore" with an empty hypothesis
                text = ""
            out[tag].setdefault(int(sid), text)
    return out


def fairseq_bleu_line(path: str) -> Optional[str]:
    found = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            m = _FAIRSEQ_BLEU.match(line.strip())
            if m:
                found = m.group(1)
    return found


def _idx_header(path: str):
    """(magic 9 bytes, version 8, dtype 1, count 8, then the int32 sizes)"""
    with open(path, "rb") as f:
        header = f.read(26)
    if header[:9] != b"MMIDIDX\x00\x00":
        raise ValueError(f"{path} is not a fairseq mmap index")
    return struct.unpack("<Q", header[18:26])[0]


def idx_num_sentences(path: str) -> int:
    """Number of sentences of a fairseq mmap-binarized split, from its .idx header."""
    return _idx_header(path)


def idx_sizes(path: str) -> np.ndarray:
    """Tokens per sentence (with </s>) of a fairseq mmap-binarized split: the sizes fairseq
    compares with a model's max_positions."""
    n = _idx_header(path)
    return np.fromfile(path, dtype=np.int32, count=n, offset=26)


def compound_split(line: str) -> str:
    """tensor2tensor's convention: the recipes' aggressive hyphen splits joined first
    ("a @-@ b" -> "a-b"), then perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'."""
    return compound_split_fairseq(line.replace(" @-@ ", "-"))


def compound_split_fairseq(line: str) -> str:
    """fairseq's compound_split_bleu.sh: perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g' on the
    line as it is ("a @-@ b" -> "a @ ##AT##-##AT## @ b")."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


def sacrebleu_metric(name: str):
    """The sacreBLEU metric object (public API: ``sacrebleu.metrics.BLEU`` / ``CHRF``) of a
    metric name of :data:`METRICS`."""
    from sacrebleu import metrics

    _, cls, kwargs = METRICS[name]
    return getattr(metrics, cls)(**kwargs)


def tokenized_bleu(hyps: List[str], refs: List[str]):
    """multi-bleu.perl-style corpus BLEU on already tokenized text."""
    metric = sacrebleu_metric("tok")
    return metric.corpus_score(hyps, [refs]), metric.get_signature()


def detokenize(lines: List[str], lang: str) -> List[str]:
    from sacremoses import MosesDetokenizer

    detok = MosesDetokenizer(lang=lang)
    return [detok.detokenize(line.split()) for line in lines]


COMET_INSTALL = ("bash scripts/setup_comet_env.sh (a venv of its own: unbabel-comet needs numpy<2; "
                 "constraints-comet.txt), then score with .venv-comet/bin/ea-fairseq-bleu")
COMET_UNAVAILABLE = 3  # exit status: BLEU/chrF printed and written, the COMET asked for not scored


class CometUnavailable(Exception):
    """COMET was asked for and cannot be scored here; the message is one line that says why
    and what to do."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def import_comet():
    """unbabel-comet's ``comet`` module, or :class:`CometUnavailable` with the real reason: not
    installed, or installed and failing to import (its own error, one line)."""
    import importlib.util
    import warnings

    if importlib.util.find_spec("comet") is None:
        raise CometUnavailable(f"unbabel-comet is not installed in this Python ({sys.executable}): "
                               f"{COMET_INSTALL}")
    try:
        with warnings.catch_warnings():  # torchmetrics 0.10's pkg_resources deprecation warning
            warnings.simplefilter("ignore")
            import comet
    except Exception as exc:  # a broken dependency raises anything, not only ImportError
        raise CometUnavailable(f"unbabel-comet is installed but does not import ({_first_line(exc)}): "
                               f"install the tested set, {COMET_INSTALL}") from None
    return comet


def resolve_comet_model(comet, name: str) -> str:
    """A COMET checkpoint path: NAME itself when it is a file, ``NAME/checkpoints/model.ckpt`` for
    a downloaded model's directory, else NAME as a Hugging Face model id (``Unbabel/...``), from
    the local cache or downloaded. Offline a model cannot be downloaded: one line says so."""
    if os.path.isdir(name) and os.path.isfile(os.path.join(name, "checkpoints", "model.ckpt")):
        return os.path.join(name, "checkpoints", "model.ckpt")
    if os.path.isfile(name):
        return name
    if os.path.exists(name) or name.count("/") != 1 or name.startswith((".", "/")) or name.endswith(".ckpt"):
        raise CometUnavailable(f"COMET model {name} is not a checkpoint file (nor a directory with "
                               "checkpoints/model.ckpt, nor a model id such as Unbabel/wmt22-comet-da)")
    try:
        return comet.download_model(name, local_files_only=True)
    except Exception:
        pass
    try:
        return comet.download_model(name)
    except Exception:
        raise CometUnavailable(
            f"COMET model {name} is not in the local Hugging Face cache and cannot be downloaded here "
            f"(offline?): download it where there is network (python -c \"from comet import download_model; "
            f"print(download_model('{name}'))\") and give --comet-model PATH/checkpoints/model.ckpt") from None


def comet_scores(model_path: str, sources: List[str], hyps: List[str], refs: List[str],
                 batch_size: int = 16, gpus: Optional[int] = None) -> List[float]:
    """Segment-level COMET scores (unbabel-comet's ``load_from_checkpoint`` and ``predict``);
    :class:`CometUnavailable` (one line) when COMET or the model cannot be had."""
    comet = import_comet()
    path = resolve_comet_model(comet, model_path)
    if gpus is None:
        import torch

        gpus = 1 if torch.cuda.is_available() else 0
    try:
        model = comet.load_from_checkpoint(path)
    except Exception as exc:  # e.g. offline: the checkpoint's encoder config/tokenizer (xlm-roberta-large)
        raise CometUnavailable(
            f"COMET could not load {path} ({_first_line(exc)}); offline, the encoder it names in its "
            "hparams.yaml (e.g. xlm-roberta-large) must already be in the Hugging Face cache "
            "(HF_HUB_OFFLINE=1)") from None
    data = [{"src": s, "mt": h, "ref": r} for s, h, r in zip(sources, hyps, refs)]
    out = model.predict(data, batch_size=batch_size, gpus=gpus)
    return [float(x) for x in out.scores]


def comet_model_name(path: str) -> Optional[str]:
    """The Hugging Face id of a COMET checkpoint as ``comet.download_model`` lays it out
    (``.../models--Unbabel--wmt22-comet-da/snapshots/HASH/checkpoints/model.ckpt``) or as given
    (``Unbabel/wmt22-comet-da``); None when the path does not say."""
    m = re.search(r"models--([^/\\]+?)--([^/\\]+)", path)
    if m:
        return f"{m.group(1)}/{m.group(2)}"
    return path if re.fullmatch(r"[\w.-]+/[\w.-]+", path) and not os.path.exists(path) else None


def _write(path: str, lines: List[str]) -> None:
    with replaced(path, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)


def check_inputs(args) -> None:
    """Every file the command line names, before any scoring: one line for a mistake."""
    program = "ea-fairseq-bleu"
    need_file(program, args.generate_output,
              "the file fairseq-generate's output was saved to (fairseq-generate DATA --path CKPT ... > gen.out)")
    need_file(program, args.raw_ref, "--raw-ref the untokenized references, one per line")
    need_file(program, args.expect_idx, "--expect-idx the binarized split's index (DATA/test.SRC-TGT.SRC.idx)")
    need_file(program, args.raw_src, "--raw-src the untokenized sources, one per line")
    need_output_folder(program, "--out-prefix", args.out_prefix)
    for path in (args.raw_ref, args.raw_src):  # files of a data directory: read only from inside it
        if path is not None:
            try:
                inside(path, os.path.dirname(path) or ".")
            except ConfinedPathError as err:
                raise refusal(program, str(err)) from None


def read_raw(path: str) -> List[str]:
    """The lines of ``--raw-ref``/``--raw-src``, a file in a received data directory: read only
    from inside its own directory (a link out of it, swapped in since :func:`check_inputs`,
    refused in one line)."""
    try:
        with open_inside(path, os.path.dirname(path) or ".", "r", encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f]
    except ConfinedPathError as err:
        raise refusal("ea-fairseq-bleu", str(err)) from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("generate_output")
    p.add_argument("--mode", choices=sorted(MODE_METRICS), required=True)
    p.add_argument("--target-lang", help="language of the hypotheses (detokenizer rules)")
    p.add_argument("--raw-ref", help="untokenized references, one per line in test-set order")
    p.add_argument("--expect-idx", metavar="IDX",
                   help="the binarized split's .idx: check every sentence was translated")
    p.add_argument("--allow-missing", action="store_true",
                   help="score an output that lacks some sentences (e.g. skipped as too long), "
                        "saying so in every label")
    p.add_argument("--out-prefix", help="also write PREFIX.{hyp,ref}.METRIC and PREFIX.scores.json")
    p.add_argument("--comet-model", metavar="PATH",
                   help="also score with this COMET checkpoint (a model.ckpt, the model's directory, or a "
                        "Hugging Face id such as Unbabel/wmt22-comet-da, from the cache or downloaded; needs "
                        "the comet extra: bash scripts/setup_comet_env.sh); segment scores go to PREFIX.seg.comet")
    p.add_argument("--comet-name", metavar="ID",
                   help="the COMET model's Hugging Face id, recorded in scores.json (ea-fairseq-compare "
                        "--agreement needs it) [read from PATH when it is comet.download_model's layout]")
    p.add_argument("--raw-src", help="untokenized sources for COMET (default: generate's S lines, detokenized)")
    p.add_argument("--source-lang", help="language of the sources (detokenizer rules for COMET's sources)")
    p.add_argument("--comet-batch-size", type=int, default=16)
    p.add_argument("--comet-gpus", type=int, help="GPUs for COMET (default: 1 if CUDA is available, else 0)")
    add_version_option(p, "ea-fairseq-bleu")
    args = p.parse_args(argv)
    check_inputs(args)

    gen = parse_generate(args.generate_output)
    ids = sorted(gen["H"])
    if not ids:
        print(f"ea-fairseq-bleu: no hypotheses (H- lines) in {args.generate_output}", file=sys.stderr)
        return 1
    hyps = [gen["H"][i] for i in ids]
    refs = [gen["T"].get(i) for i in ids]
    if any(r is None for r in refs):
        print("ea-fairseq-bleu: generate output has hypotheses without references (T- lines)", file=sys.stderr)
        return 1
    expected = None
    if args.expect_idx:
        expected = idx_num_sentences(args.expect_idx)
        if len(ids) != expected and not args.allow_missing:
            lost = sorted(set(range(expected)) - set(ids))[:10]
            print(f"ea-fairseq-bleu: {args.generate_output} has {len(ids)} hypotheses but the test set has "
                  f"{expected} sentences (missing ids {lost}...). fairseq drops a last batch "
                  "smaller than --required-batch-size-multiple: generate with "
                  "--required-batch-size-multiple 1", file=sys.stderr)
            return 1
    raw = None
    if args.mode != "iwslt":
        if not args.raw_ref or not args.target_lang:
            print("ea-fairseq-bleu: --mode wmt* needs --raw-ref and --target-lang for sacreBLEU", file=sys.stderr)
            return 1
        raw = read_raw(args.raw_ref)
        expected = len(raw) if expected is None else expected
        if ids[-1] >= len(raw) or len(raw) != expected or (len(ids) != len(raw) and not args.allow_missing):
            print(f"ea-fairseq-bleu: {len(ids)} hypotheses (ids up to {ids[-1]}) but {args.raw_ref} has "
                  f"{len(raw)} lines: generate must translate the whole test set, in the "
                  "order the references are in", file=sys.stderr)
            return 1
    coverage = ""
    if expected is not None and len(ids) != expected:
        lost = sorted(set(range(expected)) - set(ids))
        coverage = (f" [on {len(ids)} of {expected} sentences: {len(lost)} not translated, ids "
                    f"{lost[:10]}{'...' if len(lost) > 10 else ''}]")

    results = []
    line = fairseq_bleu_line(args.generate_output)
    label = "fairseq tokenized BLEU (fairseq-generate's scorer, tokenized BPE-removed text)"
    results.append(f"{label}{coverage}: {line}" if line else f"{label}: not in the output")

    texts = {  # metric -> (hypotheses, references), one line per translated sentence
        "tok": (hyps, refs),
        "split-fairseq": ([compound_split_fairseq(h) for h in hyps], [compound_split_fairseq(r) for r in refs]),
        "split-t2t": ([compound_split(h) for h in hyps], [compound_split(r) for r in refs]),
    }
    if raw is not None:
        texts["sacrebleu"] = (detokenize(hyps, args.target_lang), [raw[i] for i in ids])
    chrf_text = "detok" if raw is not None else "tok"
    texts["chrf"] = texts["chrf++"] = texts["sacrebleu" if raw is not None else "tok"]
    names = MODE_METRICS[args.mode] + ([] if "tok" in MODE_METRICS[args.mode] else ["tok"])
    report = {"generate_output": os.path.abspath(args.generate_output), "mode": args.mode,
              "sentences": expected if expected is not None else len(ids), "translated": len(ids),
              "missing_ids": sorted(set(range(expected)) - set(ids)) if expected is not None else [],
              "primary": MODE_METRICS[args.mode][0], "metrics": {}}
    for name in names:
        h, r = texts[name]
        metric = sacrebleu_metric(name)
        score = metric.corpus_score(h, [r])
        sig = metric.get_signature()
        label = METRICS[name][0]
        if name.startswith("chrf"):
            label += f" ({CHRF_TEXT[chrf_text]})"
        if name in MODE_METRICS[args.mode]:  # (the unsplit BLEU of En-De is only written)
            results.append(f"{label}{coverage}: {score.score:.2f}  [{score}]  signature: {sig}")
        entry = {"label": label, "score": score.score, "signature": str(sig)}
        if args.out_prefix:  # chrF and chrF++ point to the files of the text they scored
            text = ("sacrebleu" if chrf_text == "detok" else "tok") if name.startswith("chrf") else name
            _write(f"{args.out_prefix}.hyp.{text}", h)
            _write(f"{args.out_prefix}.ref.{text}", r)
            entry.update(hyp=os.path.basename(f"{args.out_prefix}.hyp.{text}"),
                         ref=os.path.basename(f"{args.out_prefix}.ref.{text}"))
        report["metrics"][name] = entry
    # BLEU and chrF are printed and written before COMET runs: COMET may be unavailable or slow
    print("\n".join(results), flush=True)
    _write_report(args.out_prefix, report)
    if not args.comet_model:  # not asked for: no COMET line (--help says how)
        return 0
    if args.raw_src:
        raw_src = read_raw(args.raw_src)
        sources = [raw_src[i] if i < len(raw_src) else "" for i in ids]
    else:
        sources = detokenize([gen["S"].get(i, "") for i in ids], args.source_lang or "en")
    comet_hyps, comet_refs = texts["sacrebleu"] if raw is not None else texts["tok"]
    print(f"ea-fairseq-bleu: COMET ({args.comet_model}) on {len(ids)} sentences ...", file=sys.stderr)
    try:
        segments = comet_scores(args.comet_model, sources, comet_hyps, comet_refs,
                                args.comet_batch_size, args.comet_gpus)
    except CometUnavailable as exc:
        print(f"COMET: not scored: {exc}")
        report["comet_unavailable"] = str(exc)
        _write_report(args.out_prefix, report)
        return COMET_UNAVAILABLE
    score = float(np.mean(segments))
    model = args.comet_name or comet_model_name(args.comet_model)
    label = f"COMET ({model or args.comet_model}, mean of segment scores)"
    print(f"{label}{coverage}: {score:.4f}")
    report["metrics"]["comet"] = {"label": label, "score": score, "model": model,
                                  "checkpoint": os.path.abspath(args.comet_model)
                                  if os.path.exists(args.comet_model) else args.comet_model}
    if args.out_prefix:
        _write(f"{args.out_prefix}.seg.comet", [repr(x) for x in segments])
        report["metrics"]["comet"]["segments"] = os.path.basename(f"{args.out_prefix}.seg.comet")
    _write_report(args.out_prefix, report)
    return 0


def _write_report(prefix: Optional[str], report: dict) -> None:
    if prefix:
        with replaced(f"{prefix}.scores.json", "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
