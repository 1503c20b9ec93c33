"""Moses' Perl scripts, ported to Python byte for byte: normalize-punctuation.perl,
remove-non-printing-char.perl, tokenizer.perl and lowercase.perl, one line at a time (the
steps of nmt_text.py's ``text`` command), and clean-corpus-n.perl (its ``clean`` command).
tests/fixtures/moses holds the Perl scripts' outputs they are tested against; sacremoses
supplies the nonbreaking-prefix lists."""
import re
import sys
import unicodedata

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

# Perl's \s on character strings (which Python's str.split() exceeds: it also splits at
# \x1c-\x1f, which clean-corpus-n.perl keeps inside a word)
_PERL_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"


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


# --------------------------------------------------------------------------- clean-corpus-n.perl

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
