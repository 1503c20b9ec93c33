#!/usr/bin/env python3
"""Text tools shared by the translation recipes in examples/translation/.

Python ports of the steps the Moses-based fairseq recipes run, without cloning Moses:
the Moses scripts (normalize-punctuation, remove-non-printing-char, tokenizer, lowercase,
clean-corpus-n) are ported byte for byte in nmt_moses.py (tests/fixtures/moses holds the
Perl scripts' outputs they are tested against; sacremoses supplies the nonbreaking-prefix
lists); BPE is subword-nmt. This file holds the command line, the text pipeline and the
SentencePiece commands; nmt_fetch.py fetch and find, nmt_corpus.py the input formats and
split.

  fetch   place the raw archives in ORIG (from --raw-dir, or downloaded) and unpack them
  find    locate a corpus file inside the unpacked archives (glob, any depth)
  text    extract (plain / .gz / SGML / XML / IWSLT train.tags / "|||" bitext), then
          optionally normalize punctuation, drop non-printing characters, Moses-tokenize
          and lowercase, each as the Perl script does; streams line by line, several
          workers if asked
  clean   clean-corpus-n.perl: drop pairs that are empty, longer than MAX tokens, or
          whose length ratio exceeds RATIO
  split   every N-th line to one file, the rest to another (fairseq's valid split)
  spm-learn / spm-encode   learn a joint SentencePiece model / segment text with it

BPE is learnt and applied with ``python -m subword_nmt.learn_bpe`` / ``apply_bpe``
directly (see common.sh); SentencePiece, the alternative, with the ``sentencepiece`` package. Run ``python examples/translation/nmt_text.py CMD --help`` for options.
"""
import argparse
import os
import sys
from multiprocessing import Pool

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its modules beside it, however this file is loaded
from nmt_corpus import cmd_split, open_text, read_lines  # noqa: E402
from nmt_fetch import cmd_fetch, cmd_find  # noqa: E402
from nmt_moses import MosesTokenizer, PunctNormalizer, cmd_clean, perl_lowercase, remove_non_printing  # noqa: E402

# --------------------------------------------------------------------------- text


class Pipeline:
    """Per-line processing, picklable for multiprocessing: the Moses scripts' steps in the
    order fairseq's recipes pipe them."""

    def __init__(self, args):
        self.args = args
        self._tok = self._norm = None
        self._ready = False

    def _setup(self):
        if self.args.normalize_punct:
            self._norm = PunctNormalizer(self.args.lang)
        if self.args.tokenize:
            self._tok = MosesTokenizer(self.args.lang, aggressive_dash=self.args.aggressive_dash,
                                       escape=not self.args.no_escape)
        self._ready = True

    def __call__(self, line: str) -> str:
        a = self.args
        if not self._ready:
            self._setup()
        if a.fix_apostrophe:  # sed -e "s/\’/\'/g" of the fairseq recipes (test sets)
            line = line.replace("\u2019", "'")
        if self._norm is not None:
            line = self._norm.normalize(line)
        if a.remove_non_printing:
            line = remove_non_printing(line)
        if self._tok is not None:
            line = self._tok.tokenize(line)
        if a.lowercase:
            line = perl_lowercase(line)
        return line


_WORKER_PIPE = None


def _init_worker(args):
    global _WORKER_PIPE
    _WORKER_PIPE = Pipeline(args)


def _process_chunk(lines):
    return [_WORKER_PIPE(line) for line in lines]


def _chunks(iterable, size):
    buf = []
    for item in iterable:
        buf.append(item)
        if len(buf) == size:
            yield buf
            buf = []
    if buf:
        yield buf


def _tee(lines, path):
    with open(path, "w", encoding="utf-8") as raw:
        for line in lines:
            raw.write(line + "\n")
            yield line


def cmd_text(args) -> int:
    pipe = Pipeline(args)
    lines = read_lines(args.inputs, args.input_format, args.side)
    if args.raw_output:
        lines = _tee(lines, args.raw_output)
    mode = "a" if args.append else "w"
    out = sys.stdout if args.output == "-" else open(args.output, mode, encoding="utf-8")
    n = 0
    try:
        if args.workers > 1:
            # Pool.imap would read the whole input ahead; windows of chunks bound the memory.
            with Pool(args.workers, initializer=_init_worker, initargs=(args,)) as pool:
                for window in _chunks(_chunks(lines, 2000), 4 * args.workers):
                    for done in pool.imap(_process_chunk, window):
                        out.write("".join(line + "\n" for line in done))
                        n += len(done)
        else:
            for line in lines:
                out.write(pipe(line) + "\n")
                n += 1
    finally:
        if out is not sys.stdout:
            out.close()
    if args.verbose:
        print(f"[text] {n} lines -> {args.output}", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------- SentencePiece


def cmd_spm_learn(args) -> int:
    """One SentencePiece model learnt on all INPUTS (both languages: a joint vocabulary)."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        input=",".join(args.inputs), model_prefix=args.model_prefix, vocab_size=args.vocab_size,
        model_type=args.model_type, character_coverage=args.character_coverage,
        # at most VOCAB pieces: a small corpus gets fewer instead of an error
        hard_vocab_limit=False,
        input_sentence_size=args.input_sentence_size, shuffle_input_sentence=True,
        num_threads=args.workers, minloglevel=1)
    n = spm.SentencePieceProcessor(model_file=args.model_prefix + ".model").get_piece_size()
    print(f"[spm] {args.model_type} model of {n} pieces -> {args.model_prefix}.model", file=sys.stderr)
    return 0


def cmd_spm_encode(args) -> int:
    """Each line of INPUT as its SentencePiece pieces, space-separated."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=args.model)
    with open_text(args.input) as f, open(args.output, "w", encoding="utf-8") as out:
        for chunk in _chunks((line.rstrip("\n") for line in f), 10000):
            pieces = sp.encode(chunk, out_type=str, num_threads=args.workers)
            out.write("".join(" ".join(p) + "\n" for p in pieces))
    return 0


# --------------------------------------------------------------------------- CLI


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    f = sub.add_parser("fetch", help="place raw archives in ORIG and unpack them")
    f.add_argument("--orig", required=True)
    f.add_argument("--raw-dir", help="directory with already-downloaded files (never downloads then)")
    f.add_argument("--no-download", action="store_true")
    f.add_argument("files", nargs="+", metavar="NAME=URL")
    f.set_defaults(fn=cmd_fetch)

    f = sub.add_parser("find", help="print the first file under ROOT matching each glob")
    f.add_argument("--any", action="store_true", help="print only the first pattern that matches")
    f.add_argument("root")
    f.add_argument("patterns", nargs="+")
    f.set_defaults(fn=cmd_find)

    t = sub.add_parser("text", help="extract / normalize / tokenize / lowercase")
    t.add_argument("inputs", nargs="+", help="input files (.gz read transparently; - for stdin)")
    t.add_argument("-o", "--output", default="-")
    t.add_argument("--append", action="store_true")
    t.add_argument("-l", "--lang", default="en")
    t.add_argument("--input-format", choices=["plain", "sgm", "iwslt-train", "bitext"], default="plain")
    t.add_argument("--raw-output", metavar="FILE",
                   help="also write the extracted sentences, before any processing, to FILE")
    t.add_argument("--side", type=int, default=0, help="bitext: 0 = left of '|||', 1 = right")
    t.add_argument("--normalize-punct", action="store_true", help="normalize-punctuation.perl")
    t.add_argument("--remove-non-printing", action="store_true", help="remove-non-printing-char.perl")
    t.add_argument("--tokenize", action="store_true", help="tokenizer.perl -l LANG")
    t.add_argument("--aggressive-dash", action="store_true", help="tokenizer.perl -a")
    t.add_argument("--no-escape", action="store_true", help="tokenizer.perl -no-escape")
    t.add_argument("--lowercase", action="store_true", help="lowercase.perl")
    t.add_argument("--fix-apostrophe", action="store_true", help="replace ’ by '")
    t.add_argument("--workers", type=int, default=1)
    t.add_argument("-v", "--verbose", action="store_true")
    t.set_defaults(fn=cmd_text)

    c = sub.add_parser("clean", help="clean-corpus-n.perl")
    c.add_argument("--ratio", type=float, default=1.5)
    c.add_argument("inp")
    c.add_argument("l1")
    c.add_argument("l2")
    c.add_argument("out")
    c.add_argument("min", type=int)
    c.add_argument("max", type=int)
    c.set_defaults(fn=cmd_clean)

    s = sub.add_parser("split", help="every N-th line to EVERY_OUT, the others to REST_OUT")
    s.add_argument("n", type=int)
    s.add_argument("inp")
    s.add_argument("every_out")
    s.add_argument("rest_out")
    s.set_defaults(fn=cmd_split)

    m = sub.add_parser("spm-learn", help="learn a joint SentencePiece model on INPUTS")
    m.add_argument("inputs", nargs="+")
    m.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    m.add_argument("--vocab-size", type=int, required=True, help="at most this many pieces")
    m.add_argument("--model-type", choices=["unigram", "bpe"], default="unigram")
    m.add_argument("--character-coverage", type=float, default=1.0,
                   help="share of characters covered; 0.9995 for Chinese or Japanese")
    m.add_argument("--input-sentence-size", type=int, default=10_000_000,
                   help="learn on a random sample of at most this many lines")
    m.add_argument("--workers", type=int, default=1)
    m.set_defaults(fn=cmd_spm_learn)

    m = sub.add_parser("spm-encode", help="segment a text file with a SentencePiece model")
    m.add_argument("--model", required=True)
    m.add_argument("-i", "--input", required=True)
    m.add_argument("-o", "--output", required=True)
    m.add_argument("--workers", type=int, default=1)
    m.set_defaults(fn=cmd_spm_encode)

    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
