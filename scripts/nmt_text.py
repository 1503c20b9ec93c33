#!/usr/bin/env python3
"""Text tools shared by the translation recipes in examples/translation/.

Python ports of the steps the Moses-based fairseq recipes run, built on the Python
packages (sacremoses, subword-nmt) instead of cloned Perl repositories:

  fetch   place the raw archives in ORIG (from --raw-dir, or downloaded) and unpack them
  find    locate a corpus file inside the unpacked archives (glob, any depth)
  text    extract (plain / .gz / SGML / XML / IWSLT train.tags / "|||" bitext), then
          optionally normalize punctuation, drop non-printing characters, Moses-tokenize
          and lowercase; streams line by line, several workers if asked
  clean   clean-corpus-n.perl: drop pairs that are empty, longer than MAX tokens, or
          whose length ratio exceeds RATIO
  split   every N-th line to one file, the rest to another (fairseq's valid split)

BPE is learnt and applied with ``python -m subword_nmt.learn_bpe`` / ``apply_bpe``
directly (see common.sh). Run ``python scripts/nmt_text.py CMD --help`` for options.
"""
import argparse
import gzip
import io
import os
import re
import shutil
import sys
import tarfile
import unicodedata
import urllib.request
import zipfile
from multiprocessing import Pool
from pathlib import Path

# --------------------------------------------------------------------------- fetching


def _archive_dir(orig: Path, name: str) -> Path:
    for ext in (".tar.gz", ".tgz", ".tar", ".zip", ".gz"):
        if name.endswith(ext):
            return orig / name[: -len(ext)]
    return orig / (name + ".d")


def _unpack(path: Path, dest: Path) -> None:
    stamp = dest / ".unpacked"
    if stamp.exists():
        return
    dest.mkdir(parents=True, exist_ok=True)
    name = path.name
    print(f"[fetch] unpacking {name} -> {dest}", file=sys.stderr)
    if name.endswith((".tgz", ".tar.gz", ".tar")):
        with tarfile.open(path) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, filter="data")
            else:  # Python < 3.11.4
                tar.extractall(dest)
    elif name.endswith(".zip"):
        with zipfile.ZipFile(path) as zf:
            zf.extractall(dest)
    elif name.endswith(".gz"):
        with gzip.open(path, "rb") as src, open(dest / name[:-3], "wb") as out:
            shutil.copyfileobj(src, out)
    else:  # a plain file: make it findable like the archives' members
        target = dest / name
        if not target.exists():
            os.symlink(path.resolve(), target)
    stamp.touch()


def _download(url: str, target: Path) -> bool:
    part = target.with_name(target.name + ".part")
    print(f"[fetch] downloading {url}", file=sys.stderr)
    try:
        req = urllib.request.Request(url, headers={"User-Agent": "ea_fairseq-recipes"})
        with urllib.request.urlopen(req, timeout=60) as resp, open(part, "wb") as out:
            shutil.copyfileobj(resp, out, length=1 << 20)
        part.rename(target)
        return True
    except Exception as err:  # network errors, HTTP errors, timeouts
        print(f"[fetch] failed: {url}: {err}", file=sys.stderr)
        part.unlink(missing_ok=True)
        return False


def cmd_fetch(args) -> int:
    orig = Path(args.orig)
    orig.mkdir(parents=True, exist_ok=True)
    raw_dir = Path(args.raw_dir) if args.raw_dir else None
    download = not args.no_download and raw_dir is None
    missing = []
    for spec in args.files:
        name, _, url = spec.partition("=")
        target = orig / name
        if not target.exists():
            if raw_dir is not None and (raw_dir / name).exists():
                os.symlink((raw_dir / name).resolve(), target)
            elif download and url and _download(url, target):
                pass
            else:
                missing.append((name, url))
                continue
        _unpack(target, _archive_dir(orig, name))
    if missing:
        lines = [
            "[fetch] missing raw data. Put these files in a directory and pass it with --raw-dir DIR",
            f"        (or EA_RAW_DIR=DIR), or put them in {orig}:",
        ]
        if raw_dir is not None:
            lines[1] += f" (looked in {raw_dir}; with a raw directory nothing is downloaded)"
        elif args.no_download:
            lines[1] += " (downloads are off: EA_NO_DOWNLOAD / --no-download)"
        for name, url in missing:
            lines.append(f"    {name:40s} from {url}" if url else f"    {name}")
        print("\n".join(lines), file=sys.stderr)
        return 2
    return 0


def find_file(root: str, pattern: str) -> Path:
    hits = sorted(p for p in Path(root).rglob(pattern) if p.is_file())
    if not hits:
        raise FileNotFoundError(f"no file matching '{pattern}' under {root}: is the archive complete?")
    return hits[0]


def cmd_find(args) -> int:
    if args.any:  # the first pattern that matches anything
        for pattern in args.patterns:
            try:
                print(find_file(args.root, pattern))
                return 0
            except FileNotFoundError:
                continue
        print(f"[find] none of {args.patterns} under {args.root}: is the archive complete?", file=sys.stderr)
        return 1
    for pattern in args.patterns:
        try:
            print(find_file(args.root, pattern))
        except FileNotFoundError as err:
            print(f"[find] {err}", file=sys.stderr)
            return 1
    return 0


# --------------------------------------------------------------------------- text

_SEG = re.compile(r"<seg[^>]*>\s*(.*?)\s*</seg>", re.IGNORECASE)
_IWSLT_DROP = ("<url>", "<talkid>", "<keywords>")
_IWSLT_STRIP = re.compile(r"</?(title|description)>")


def _open_text(path: str):
    if path == "-":
        return io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace")
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace", newline="\n")


def read_lines(paths, fmt: str, side: int):
    """Yield the sentences of ``paths`` (one per line, without newline)."""
    for path in paths:
        with _open_text(path) as f:
            for line in f:
                line = line.rstrip("\n").rstrip("\r")
                if fmt == "plain":
                    yield line
                elif fmt == "sgm":  # grep '<seg id' | sed 's/<seg id="N">//; s/<\/seg>//'
                    m = _SEG.search(line)
                    if m:
                        yield m.group(1)
                elif fmt == "iwslt-train":  # fairseq's prepare-iwslt14.sh filters
                    if any(tag in line for tag in _IWSLT_DROP):
                        continue
                    yield _IWSLT_STRIP.sub("", line)
                elif fmt == "bitext":  # "source ||| target"
                    parts = line.split("|||")
                    yield parts[side].strip() if len(parts) == 2 else ""
                else:
                    raise ValueError(f"unknown input format {fmt}")


class Pipeline:
    """Per-line processing, picklable for multiprocessing."""

    def __init__(self, args):
        self.args = args
        self._tok = self._norm = None

    def _setup(self):
        from sacremoses import MosesPunctNormalizer, MosesTokenizer

        if self.args.normalize_punct:
            self._norm = MosesPunctNormalizer(lang=self.args.lang)
        if self.args.tokenize:
            self._tok = MosesTokenizer(lang=self.args.lang)

    def __call__(self, line: str) -> str:
        a = self.args
        if self._tok is None and self._norm is None and (a.tokenize or a.normalize_punct):
            self._setup()
        if a.fix_apostrophe:  # sed -e "s/\’/\'/g" of the fairseq recipes (test sets)
            line = line.replace("\u2019", "'")
        if self._norm is not None:
            line = self._norm.normalize(line)
        if a.remove_non_printing:  # remove-non-printing-char.perl: s/\p{C}/ /g
            line = "".join(" " if unicodedata.category(c).startswith("C") else c for c in line)
        if self._tok is not None:
            line = self._tok.tokenize(
                line, return_str=True, escape=True, aggressive_dash_splits=a.aggressive_dash
            )
        if a.lowercase:
            line = line.lower()
        return line.strip()


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


# --------------------------------------------------------------------------- clean / split


def cmd_clean(args) -> int:
    """clean-corpus-n.perl -ratio R IN L1 L2 OUT MIN MAX."""
    l1, l2 = args.l1, args.l2
    kept = total = 0
    with open(f"{args.inp}.{l1}", encoding="utf-8") as f1, open(f"{args.inp}.{l2}", encoding="utf-8") as f2, \
            open(f"{args.out}.{l1}", "w", encoding="utf-8") as o1, open(f"{args.out}.{l2}", "w", encoding="utf-8") as o2:
        for a, b in zip(f1, f2, strict=True):
            total += 1
            a = " ".join(a.split())
            b = " ".join(b.split())
            na, nb = len(a.split(" ")) if a else 0, len(b.split(" ")) if b else 0
            if na == 0 or nb == 0:
                continue
            if not (args.min <= na <= args.max and args.min <= nb <= args.max):
                continue
            if na / nb > args.ratio or nb / na > args.ratio:
                continue
            o1.write(a + "\n")
            o2.write(b + "\n")
            kept += 1
    print(f"[clean] {args.inp}: kept {kept} of {total} pairs -> {args.out}", file=sys.stderr)
    return 0


def cmd_split(args) -> int:
    """awk 'NR%N==0' > every ; awk 'NR%N!=0' > rest."""
    with open(args.inp, encoding="utf-8") as f, open(args.every_out, "w", encoding="utf-8") as ev, \
            open(args.rest_out, "w", encoding="utf-8") as rest:
        for i, line in enumerate(f, start=1):
            (ev if i % args.n == 0 else rest).write(line)
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

    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
