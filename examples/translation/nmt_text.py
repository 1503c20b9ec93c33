#!/usr/bin/env python3
"""Text tools shared by the translation recipes in examples/translation/.

Python ports of the steps the Moses-based fairseq recipes run, without cloning Moses:
the Moses scripts (normalize-punctuation, remove-non-printing-char, tokenizer, lowercase)
are ported here byte for byte (tests/fixtures/moses holds the Perl scripts' outputs they
are tested against; sacremoses supplies the nonbreaking-prefix lists); BPE is subword-nmt.

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
import gzip
import hashlib
import io
import lzma
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


class BrokenArchive(Exception):
    """A raw file that is there but cannot be unpacked (truncated download, wrong file)."""


def _unpack(path: Path, dest: Path) -> None:
    stamp = dest / ".unpacked"
    if stamp.exists():
        return
    dest.mkdir(parents=True, exist_ok=True)
    name = path.name
    print(f"[fetch] unpacking {name} -> {dest}", file=sys.stderr)
    try:
        _extract(path, dest)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, lzma.LZMAError) as err:
        shutil.rmtree(dest, ignore_errors=True)
        first = str(err).splitlines()[0].rstrip(": ") if str(err) else ""
        raise BrokenArchive(f"{type(err).__name__}: {first}" if first else type(err).__name__) from None
    stamp.touch()


def _extract(path: Path, dest: Path) -> None:
    name = path.name
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


# Downloads are checked: every NAME=URL a recipe fetches carries the SHA-256 its publisher (or
# a public catalogue of it) gives, as URL#sha256=HEX; the file is hashed while it arrives and
# kept (renamed from NAME.part) only if the digest matches, so nothing unpacks a file that is
# not the published one. A file without a published digest is not downloaded unless the user
# gives one (EA_SHA256="NAME=HEX ...") or accepts it unverified (EA_ALLOW_UNVERIFIED_DOWNLOADS=1).
# EA_DOWNLOAD_MIRROR=BASE fetches NAME from BASE/NAME instead (checked the same way). Files the
# user places in --raw-dir or ORIG are the user's and are used as they are.
UNVERIFIED_SWITCH = "EA_ALLOW_UNVERIFIED_DOWNLOADS"
_SHA256 = re.compile(r"[0-9a-f]{64}")


class DownloadRefused(Exception):
    """A download whose digest is not the published one, or that has none to check."""


def _expected_digests(specs) -> dict:
    """``{name: sha256}``: the recipe's (``URL#sha256=HEX``), replaced by the user's
    (``EA_SHA256="NAME=HEX ..."``)."""
    digests = {}
    for name, url in specs:
        _, _, fragment = url.partition("#")
        if fragment.startswith("sha256="):
            digests[name] = fragment[len("sha256="):].lower()
    for item in os.environ.get("EA_SHA256", "").split():
        name, _, digest = item.partition("=")
        if not _SHA256.fullmatch(digest.lower()):
            raise DownloadRefused(f"EA_SHA256: {item!r} is not NAME=SHA256 (64 hex digits)")
        digests[name] = digest.lower()
    return digests


def _download(url: str, target: Path, expected) -> bool:
    """``url`` to ``target``, kept only if its SHA-256 is ``expected`` (None: the user accepted it
    unverified). False on a network error; :class:`DownloadRefused` on another digest."""
    part = target.with_name(target.name + ".part")
    url = url.partition("#")[0]
    mirror = os.environ.get("EA_DOWNLOAD_MIRROR", "")
    if mirror:
        url = mirror.rstrip("/") + "/" + target.name
    print(f"[fetch] downloading {url}", file=sys.stderr)
    digest = hashlib.sha256()
    try:
        req = urllib.request.Request(url, headers={"User-Agent": "ea_fairseq-recipes"})
        part.unlink(missing_ok=True)  # a new file of its own (never through a link left in its place)
        with urllib.request.urlopen(req, timeout=60) as resp, \
                os.fdopen(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb") as out:
            for block in iter(lambda: resp.read(1 << 20), b""):
                digest.update(block)
                out.write(block)
    except Exception as err:  # network errors, HTTP errors, timeouts
        print(f"[fetch] failed: {url}: {err}", file=sys.stderr)
        part.unlink(missing_ok=True)
        return False
    found = digest.hexdigest()
    if expected is not None and found != expected:
        part.unlink(missing_ok=True)
        raise DownloadRefused(
            f"{target.name} from {url}: SHA-256 {found}, expected {expected}: not the published file "
            "(damaged, changed on the server or altered on the way); deleted, nothing unpacked. Run the "
            "recipe again; if the server's file changed, check it and give its digest with "
            f"EA_SHA256={target.name}=<sha256>")
    if expected is None:
        print(f"[fetch] {UNVERIFIED_SWITCH}=1: {target.name} used unverified, SHA-256 {found} "
              f"(check it against its publisher's; EA_SHA256={target.name}={found} pins it)", file=sys.stderr)
    part.rename(target)
    return True


def cmd_fetch(args) -> int:
    orig = Path(args.orig)
    orig.mkdir(parents=True, exist_ok=True)
    raw_dir = Path(args.raw_dir) if args.raw_dir else None
    download = not args.no_download and raw_dir is None
    specs = [(spec.partition("=")[0], spec.partition("=")[2]) for spec in args.files]
    try:
        digests = _expected_digests(specs)
        if download:  # every file to download has a digest to check, or the user accepts it unchecked
            unverified = [name for name, url in specs if url and name not in digests and not (orig / name).exists()]
            if unverified and os.environ.get(UNVERIFIED_SWITCH, "") != "1":
                raise DownloadRefused(
                    f"no published SHA-256 to check {', '.join(unverified)} against, so it is not downloaded; "
                    "download it yourself, check it and pass its directory with --raw-dir, or give its "
                    f"digest (EA_SHA256=\"{unverified[0]}=<sha256> ...\"), or set {UNVERIFIED_SWITCH}=1 to use "
                    "it unverified (its digest is printed)")
    except DownloadRefused as err:
        print(f"[fetch] error: {err}", file=sys.stderr)
        return 4
    missing = []
    for name, spec_url in specs:
        target, url = orig / name, spec_url.partition("#")[0]
        if not target.exists():
            if raw_dir is not None and (raw_dir / name).exists():
                os.symlink((raw_dir / name).resolve(), target)
            else:
                try:
                    fetched = download and url and _download(spec_url, target, digests.get(name))
                except DownloadRefused as err:
                    print(f"[fetch] error: {err}", file=sys.stderr)
                    return 4
                if not fetched:
                    missing.append((name, url))
                    continue
        try:
            _unpack(target, _archive_dir(orig, name))
        except BrokenArchive as err:
            print(f"[fetch] error: {target.resolve()} is not a readable archive ({err}): the file is "
                  f"damaged or incomplete; download it again{f' from {url}' if url else ''} and replace it",
                  file=sys.stderr)
            return 3
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
    if path.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8", errors="replace", newline="\n")
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


# --------------------------------------------------------------------------- Moses, as Perl runs it
# Ports of mosesdecoder's scripts/tokenizer/*.perl that give the Perl scripts' bytes, checked
# against their outputs in tests/fixtures/moses/ (make_fixtures.sh there). sacremoses 0.2.0
# differs from them: its normalizer maps ’ to ' (Perl: "), and « » with no-break spaces
# without the space Perl keeps, unless perl_parity=True; it applies the "period before a
# closing quote" rule to the line without its newline, which Perl's [^<] matches (so Perl
# turns `„Wir kommen.“` into `"Wir kommen".`); its tokenizer has no fi/sv colon rule (Perl:
# "EU:ssa" stays one token), never splits the period of a sentence's last word when that
# word is an abbreviation or contains a period ("U.S.A." -> "U.S.A ." in Perl), strips the
# space Perl leaves after a final ".'", and its character classes come from an old Unicode
# table without CJK and other scripts (Perl's \p{IsAlnum} is \p{Alphabetic} + \p{Nd}).

_PERL_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"  # Perl's \s


def _normalize_punct_rules(lang: str, penn: bool):
    r"""normalize-punctuation.perl's substitutions, in its order, as byte regexes: the script
    reads bytes (no utf8 layer), so \d is [0-9], /i folds ASCII only, and every rule sees the
    line with its newline."""
    nbsp = "\u00a0"
    rules = [
        (r"\r", ""), (r"\(", " ("), (r"\)", ") "), (r" +", " "), (r"\) ([\.\!\:\?\;\,])", r")\1"),
        (r"\( ", "("), (r" \)", ")"), (r"(\d) \%", r"\1%"), (r" :", ":"), (r" ;", ";"),
    ]
    if not penn:
        rules += [(r"\`", "'"), (r"\'\'", ' " ')]
    rules += [
        ("„", '"'), ("“", '"'), ("”", '"'), ("–", "-"), ("—", " - "), (r" +", " "), ("´", "'"),
        ("(?i)([a-z])‘([a-z])", r"\1'\2"), ("(?i)([a-z])’([a-z])", r"\1'\2"), ("‘", "'"),
        ("‚", "'"), ("’", '"'), ("''", '"'), ("´´", '"'), ("…", "..."),
        # French quotes
        (f"{nbsp}«{nbsp}", ' "'), (f"«{nbsp}", '"'), ("«", '"'), (f"{nbsp}»{nbsp}", '" '),
        (f"{nbsp}»", '"'), ("»", '"'),
        # pseudo-spaces
        (f"{nbsp}\\%", "%"), (f"nº{nbsp}", "nº "), (f"{nbsp}:", ":"), (f"{nbsp}ºC", " ºC"),
        (f"{nbsp}cm", " cm"), (f"{nbsp}\\?", "?"), (f"{nbsp}\\!", "!"), (f"{nbsp};", ";"),
        (f",{nbsp}", ", "), (r" +", " "),
    ]
    if lang == "en":
        rules += [(r'\"([,\.]+)', r'\1"')]
    elif lang not in ("cs", "cz"):
        rules += [(r',\"', '",'), (r'(\.+)\"(\s*[^<])', r'"\1\2')]
    if lang in ("de", "es", "cz", "cs", "fr"):
        rules += [(f"(\\d){nbsp}(\\d)", r"\1,\2")]
    else:
        rules += [(f"(\\d){nbsp}(\\d)", r"\1.\2")]
    return [(re.compile(pat.encode("utf-8")), sub.encode("utf-8")) for pat, sub in rules]


class PunctNormalizer:
    """normalize-punctuation.perl -l LANG [-penn], one line (without its newline) at a time."""

    def __init__(self, lang: str, penn: bool = False):
        self.rules = _normalize_punct_rules(lang, penn)

    def normalize(self, line: str) -> str:
        text = line.encode("utf-8") + b"\n"
        for pattern, sub in self.rules:
            text = pattern.sub(sub, text)
        text = text.decode("utf-8", errors="replace")
        return text[:-1] if text.endswith("\n") else text


def remove_non_printing(line: str) -> str:
    r"""remove-non-printing-char.perl: s/\p{C}/ /g."""
    return "".join(" " if unicodedata.category(c)[0] == "C" else c for c in line)


def perl_lowercase(line: str) -> str:
    """lowercase.perl (Perl's lc): full case mapping without Python's final-sigma rule."""
    return "".join(c.lower() for c in line) if "\u03a3" in line else line.lower()


class MosesTokenizer:
    r"""tokenizer.perl -l LANG [-a] (escaping on, no protected patterns), one line at a time.

    Nonbreaking prefixes are sacremoses' copies of Moses' files (English for a language
    without one, as the Perl script falls back to); character classes are Unicode
    properties of the ``regex`` module (Perl's \p{IsAlnum} = Alphabetic + Nd, \p{IsAlpha},
    \p{IsN}, \p{IsLower}, \p{Ll}). Characters whose properties changed between Unicode
    versions can tokenize differently with a Perl of another Unicode version.
    """

    _ALNUM = r"\p{Alphabetic}\p{Nd}"

    def __init__(self, lang: str, aggressive_dash: bool = False, escape: bool = True):
        import regex
        from sacremoses.corpus import NonbreakingPrefixes

        self.lang, self.aggressive, self.escape = lang, aggressive_dash, escape
        rx = regex.compile
        alnum = self._ALNUM
        self.space = rx(f"[{_PERL_SPACE}]+")
        self.blank = rx(f"[{_PERL_SPACE}]*")
        self.junk = rx(r"[\x00-\x1f]")
        if lang in ("fi", "sv"):  # the colon inside words: USA:n, 20:een, EU:ssa, S:t
            self.special = [(rx(rf"([^{alnum}\s\.\:\'\`\,\-])"), r" \1 "),
                            (rx(r"(:)(?=$|[^\p{Ll}])"), r" \1 ")]
        elif lang == "tdt":
            self.special = [(rx(rf"([^{alnum}\s\.\'\`\,\-])"), r" \1 "),
                            (rx(r"(\')(?=$|[^\p{Ll}])"), r" \1 ")]
        elif lang == "ca":
            self.special = [(rx(rf"([^{alnum}\s\.\·\'\`\,\-])"), r" \1 "),
                            (rx(r"(·)(?=$|[^\p{Ll}])"), r" \1 ")]
        else:
            self.special = [(rx(rf"([^{alnum}\s\.\'\`\,\-])"), r" \1 ")]
        self.hyphen = rx(rf"([{alnum}])\-(?=[{alnum}])")
        self.commas = [(rx(r"([^\p{N}])[,]"), r"\1 , "), (rx(r"[,]([^\p{N}])"), r" , \1"),
                       (rx(r"([\p{N}])[,]$"), r"\1 ,")]
        a, na = r"[\p{Alphabetic}]", r"[^\p{Alphabetic}]"
        if lang == "en":  # contractions split right
            self.apostrophe = [(rx(f"({na})[']({na})"), r"\1 ' \2"),
                               (rx(r"([^\p{Alphabetic}\p{N}])[']([\p{Alphabetic}])"), r"\1 ' \2"),
                               (rx(f"({a})[']({na})"), r"\1 ' \2"),
                               (rx(f"({a})[']({a})"), r"\1 '\2"),
                               (rx(r"([\p{N}])[']([s])"), r"\1 '\2")]
        elif lang in ("fr", "it", "ga", "ca"):  # contractions split left
            self.apostrophe = [(rx(f"({na})[']({na})"), r"\1 ' \2"), (rx(f"({na})[']({a})"), r"\1 ' \2"),
                               (rx(f"({a})[']({na})"), r"\1 ' \2"), (rx(f"({a})[']({a})"), r"\1' \2")]
        elif lang in ("so", "tdt"):
            self.apostrophe = [(rx(f"({na})[']({na})"), r"\1 ' \2"), (rx(f"({na})[']({a})"), r"\1 ' \2"),
                               (rx(f"({a})[']({na})"), r"\1 ' \2")]
        else:
            self.apostrophe = [(rx(r"\'"), " ' ")]
        self.word_period = rx(r"^(\S+)\.$")
        self.has_period_alpha = (rx(r"\."), rx(r"\p{Alphabetic}"))
        self.starts_lower = rx(r"^[\p{Lowercase}]")
        self.starts_digit = rx(r"^[0-9]+")
        self.prefixes = {}
        for item in NonbreakingPrefixes().words(lang):
            m = re.match(r"(.*)\s+#NUMERIC_ONLY#", item)
            self.prefixes[m.group(1) if m else item] = 2 if m else 1

    def tokenize(self, line: str) -> str:
        if self.blank.fullmatch(line):  # the script prints whitespace-only lines untouched
            return line
        text = self.junk.sub("", self.space.sub(" ", f" {line} "))
        text = re.sub(r" +", " ", text).strip(" ")
        for pattern, sub in self.special:
            text = pattern.sub(sub, text)
        if self.aggressive:
            text = self.hyphen.sub(r"\1 @-@ ", text)
        text = re.sub(r"\.([\.]+)", r" DOTMULTI\1", text)
        while "DOTMULTI." in text:
            text = re.sub(r"DOTMULTI\.([^\.])", r"DOTDOTMULTI \1", text)
            text = text.replace("DOTMULTI.", "DOTDOTMULTI")
        for pattern, sub in self.commas + self.apostrophe:
            text = pattern.sub(sub, text)
        words = text.split(" ")  # Perl's split(/\s/): empty fields kept, trailing ones dropped
        while words and not words[-1]:
            words.pop()
        last = len(words) - 1
        for i, word in enumerate(words):
            m = self.word_period.match(word)
            if not m:
                continue
            pre = m.group(1)
            kind = self.prefixes.get(pre)
            if i == last:  # a sentence's last word: always split
                words[i] = pre + " ."
            elif ((self.has_period_alpha[0].search(pre) and self.has_period_alpha[1].search(pre))
                  or kind == 1 or self.starts_lower.match(words[i + 1])):
                pass
            elif kind == 2 and self.starts_digit.match(words[i + 1]):
                pass
            else:
                words[i] = pre + " ."
        text = re.sub(r" +", " ", " ".join(words) + " ").strip(" ")
        text = re.sub(r"\.\' ?$", " . ' ", text, count=1)
        while "DOTDOTMULTI" in text:
            text = text.replace("DOTDOTMULTI", "DOTMULTI.")
        text = text.replace("DOTMULTI", ".")
        if self.escape:
            for char, entity in (("&", "&amp;"), ("|", "&#124;"), ("<", "&lt;"), (">", "&gt;"),
                                 ("'", "&apos;"), ('"', "&quot;"), ("[", "&#91;"), ("]", "&#93;")):
                text = text.replace(char, entity)
        return text


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


# --------------------------------------------------------------------------- clean / split


# Perl's \s on character strings (which Python's str.split() exceeds: it also splits at
# \x1c-\x1f, which clean-corpus-n.perl keeps inside a word)
_PERL_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_PERL_SPACES = re.compile(f"[{_PERL_SPACE}]+")
_OVERLONG_WORD = re.compile(f"[^{_PERL_SPACE}|]{{1001}}")  # its --max-word-length 1000


def cmd_clean(args) -> int:
    """clean-corpus-n.perl -ratio R IN L1 L2 OUT MIN MAX, line for line: ``|`` removed
    unless the first pair holds one (factored input), white space folded, pairs dropped that
    are empty, outside MIN..MAX words, over the length ratio, or with a word over 1000
    characters."""
    l1, l2 = args.l1, args.l2
    kept = total = 0
    factored = None
    # newline="\n": lines end at \n only, as Perl reads them (a \r is white space inside)
    with open(f"{args.inp}.{l1}", encoding="utf-8", newline="\n") as f1, \
            open(f"{args.inp}.{l2}", encoding="utf-8", newline="\n") as f2, \
            open(f"{args.out}.{l1}", "w", encoding="utf-8") as o1, open(f"{args.out}.{l2}", "w", encoding="utf-8") as o2:
        for a, b in zip(f1, f2, strict=True):
            total += 1
            a, b = a.removesuffix("\n"), b.removesuffix("\n")
            if factored is None:
                factored = "|" in a or "|" in b
            if not factored:
                a, b = a.replace("|", ""), b.replace("|", "")
            a = _PERL_SPACES.sub(" ", a).strip(" ")
            b = _PERL_SPACES.sub(" ", b).strip(" ")
            if not a or not b:
                continue
            na, nb = len(a.split(" ")), len(b.split(" "))
            if not (args.min <= na <= args.max and args.min <= nb <= args.max):
                continue
            if na / nb > args.ratio or nb / na > args.ratio:
                continue
            if _OVERLONG_WORD.search(a) or _OVERLONG_WORD.search(b):
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
    with _open_text(args.input) as f, open(args.output, "w", encoding="utf-8") as out:
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
