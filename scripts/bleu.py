#!/usr/bin/env python3
"""Score a fairseq-generate output file; every number printed says which BLEU it is.

  python scripts/bleu.py GENERATE_OUTPUT --mode {iwslt,wmt14-en-de,wmt} \\
      [--target-lang de] [--raw-ref test.raw.en-de.de] [--out-prefix PREFIX]

BLEU variants (they are not comparable with each other):

* fairseq tokenized BLEU: the ``BLEU4 = ...`` line fairseq-generate prints itself,
  computed on the tokenized, BPE-removed hypotheses and references (whitespace tokens,
  case-sensitive). For IWSLT'14 De-En (lowercased data) this is the number the EA and PA
  papers report.
* compound-split tokenized BLEU (``--mode wmt14-en-de``): hypotheses (H lines) and
  references (T lines) of generate, both Moses-tokenized, with every hyphen between two
  non-space characters split as ``##AT##-##AT##`` (the usual WMT'14 En-De convention; the
  recipes' aggressive-hyphen tokens ``@-@`` are joined first, so "a @-@ b" and "a-b" both
  become "a ##AT##-##AT## b"), then
  corpus BLEU with sacrebleu's ``tokenize='none'``, no smoothing: what multi-bleu.perl
  gives on those files.
* tokenized BLEU (``--mode wmt``): the same without the compound split.
* detokenized sacreBLEU (``--mode wmt14-en-de`` and ``wmt``): hypotheses detokenized with
  sacremoses' MosesDetokenizer, scored against the untokenized references (``--raw-ref``)
  with sacrebleu's default settings; its signature is printed.

``fairseq-score --sacrebleu`` is not used: it is broken with sacrebleu 2.x.
"""
import argparse
import re
import struct
import sys
from typing import Dict, List, Optional

_COMPOUND = re.compile(r"(\S)-(\S)")
_FAIRSEQ_BLEU = re.compile(r"^Generate .*?: (BLEU4? = .*)$")


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


def idx_num_sentences(path: str) -> int:
    """Number of sentences of a fairseq mmap-binarized split, from its .idx header."""
    with open(path, "rb") as f:
        header = f.read(26)
    if header[:9] != b"MMIDIDX\x00\x00":
        raise ValueError(f"{path} is not a fairseq mmap index")
    return struct.unpack("<Q", header[18:26])[0]


def compound_split(line: str) -> str:
    """perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g', after joining the recipes' aggressive
    hyphen splits ("a @-@ b" -> "a-b"), so that both give the usual "a ##AT##-##AT## b"."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line.replace(" @-@ ", "-"))


def tokenized_bleu(hyps: List[str], refs: List[str]):
    """multi-bleu.perl-style corpus BLEU on already tokenized text."""
    from sacrebleu.metrics import BLEU

    metric = BLEU(tokenize="none", smooth_method="none", force=True)
    return metric.corpus_score(hyps, [refs]), metric.get_signature()


def detokenize(lines: List[str], lang: str) -> List[str]:
    from sacremoses import MosesDetokenizer

    detok = MosesDetokenizer(lang=lang)
    return [detok.detokenize(line.split()) for line in lines]


def sacrebleu_detok(hyps: List[str], refs: List[str]):
    from sacrebleu.metrics import BLEU

    metric = BLEU()
    return metric.corpus_score(hyps, [refs]), metric.get_signature()


def _write(path: str, lines: List[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("generate_output")
    p.add_argument("--mode", choices=["iwslt", "wmt14-en-de", "wmt"], required=True)
    p.add_argument("--target-lang", help="language of the hypotheses (detokenizer rules)")
    p.add_argument("--raw-ref", help="untokenized references, one per line in test-set order")
    p.add_argument("--expect-idx", metavar="IDX",
                   help="the binarized split's .idx: check every sentence was translated")
    p.add_argument("--out-prefix", help="also write PREFIX.{hyp,ref}[.split|.detok] files")
    args = p.parse_args(argv)

    gen = parse_generate(args.generate_output)
    ids = sorted(gen["H"])
    if not ids:
        print(f"bleu.py: no hypotheses (H- lines) in {args.generate_output}", file=sys.stderr)
        return 1
    hyps = [gen["H"][i] for i in ids]
    refs = [gen["T"].get(i) for i in ids]
    if any(r is None for r in refs):
        print("bleu.py: generate output has hypotheses without references (T- lines)", file=sys.stderr)
        return 1
    if args.expect_idx:
        expected = idx_num_sentences(args.expect_idx)
        if len(ids) != expected:
            lost = sorted(set(range(expected)) - set(ids))[:10]
            print(f"bleu.py: {args.generate_output} has {len(ids)} hypotheses but the test set has "
                  f"{expected} sentences (missing ids {lost}...). fairseq drops a last batch "
                  "smaller than --required-batch-size-multiple: generate with "
                  "--required-batch-size-multiple 1", file=sys.stderr)
            return 1
    results = []
    line = fairseq_bleu_line(args.generate_output)
    label = "fairseq tokenized BLEU (fairseq-generate's scorer, tokenized BPE-removed text)"
    results.append(f"{label}: {line}" if line else f"{label}: not in the output")

    if args.mode in ("wmt14-en-de", "wmt"):
        if args.mode == "wmt14-en-de":
            h_tok, r_tok = [compound_split(h) for h in hyps], [compound_split(r) for r in refs]
            label = ("compound-split tokenized BLEU (##AT##-##AT## on Moses-tokenized hyp/ref, "
                     "sacrebleu tokenize=none, no smoothing = multi-bleu.perl)")
        else:
            h_tok, r_tok = hyps, refs
            label = "tokenized BLEU (Moses-tokenized hyp/ref, sacrebleu tokenize=none, no smoothing = multi-bleu.perl)"
        score, sig = tokenized_bleu(h_tok, r_tok)
        results.append(f"{label}: {score.score:.2f}  [{score}]  signature: {sig}")

        if not args.raw_ref or not args.target_lang:
            print("bleu.py: --mode wmt* needs --raw-ref and --target-lang for sacreBLEU", file=sys.stderr)
            return 1
        with open(args.raw_ref, encoding="utf-8") as f:
            raw = [r.rstrip("\n") for r in f]
        if ids[-1] >= len(raw) or len(ids) != len(raw):
            print(f"bleu.py: {len(ids)} hypotheses (ids up to {ids[-1]}) but {args.raw_ref} has "
                  f"{len(raw)} lines: generate must translate the whole test set, in the "
                  "order the references are in", file=sys.stderr)
            return 1
        h_detok = detokenize(hyps, args.target_lang)
        score, sig = sacrebleu_detok(h_detok, [raw[i] for i in ids])
        results.append(f"detokenized sacreBLEU (sacremoses detok of hyps vs raw references): "
                       f"{score.score:.2f}  [{score}]  signature: {sig}")
        if args.out_prefix:
            _write(args.out_prefix + ".hyp.tok", h_tok)
            _write(args.out_prefix + ".ref.tok", r_tok)
            _write(args.out_prefix + ".hyp.detok", h_detok)
    elif args.out_prefix:
        _write(args.out_prefix + ".hyp.tok", hyps)
        _write(args.out_prefix + ".ref.tok", refs)
    print("\n".join(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
