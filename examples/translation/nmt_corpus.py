"""The corpus files the recipes read, and fairseq's valid split: sentences extracted one a line
from plain, .gz or .xz text, SGML/XML ``<seg>`` lines, IWSLT train.tags files and
"source ||| target" bitext (what nmt_text.py's ``text`` and ``spm-encode`` commands read), and
its ``split`` command."""
import gzip
import io
import lzma
import re
import sys

_SEG = re.compile(r"<seg[^>]*>\s*(.*?)\s*</seg>", re.IGNORECASE)
_IWSLT_DROP = ("<url>", "<talkid>", "<keywords>")
_IWSLT_STRIP = re.compile(r"</?(title|description)>")


def open_text(path: str):
    if path == "-":
        return io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace")
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    if path.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8", errors="replace", newline="\n")
    return open(path, encoding="utf-8", errors="replace", newline="\n")


def read_lines(paths, fmt: str, side: int):
    """Yield the sentences of ``paths`` (one per line, without newline)."""
    for path in paths:
        with open_text(path) as f:
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


def cmd_split(args) -> int:
    """awk 'NR%N==0' > every ; awk 'NR%N!=0' > rest."""
    with open(args.inp, encoding="utf-8") as f, open(args.every_out, "w", encoding="utf-8") as ev, \
            open(args.rest_out, "w", encoding="utf-8") as rest:
        for i, line in enumerate(f, start=1):
            (ev if i % args.n == 0 else rest).write(line)
    return 0
