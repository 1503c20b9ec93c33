#!/usr/bin/env python3
"""Build the small Spanish->English Bible corpus shipped in examples/translation/bible-es-en/.

Source: Debian's public-domain SWORD modules (read with ``pysword``):

    apt-get install sword-text-sparv sword-text-kjv
    #  sword-text-sparv -> module spaRV1909eb  (Reina-Valera 1909, Spanish, public domain)
    #  sword-text-kjv   -> module engKJV2006eb (King James Version 1769, English, public domain)

Both modules use the KJV versification, so verses are aligned by (book, chapter, verse).
The OSIS markup is removed (Strong's ``<w>`` tags, translator additions ``<transChange>``
keep their text; footnotes ``<note>``, non-canonical headings and USFM residue are dropped),
whitespace is normalised, and pairs that are empty, very long or whose lengths disagree
too much are dropped. The split is BY BOOK: valid and test books never occur in train.

The output is deterministic (fixed book order, no randomness, xz without timestamps), so
re-running the script reproduces the shipped files byte for byte (given the same module
versions: SpaRV 2.60, KJV 14.3 in Debian).

    python examples/translation/bible-es-en/build_corpus.py [--sword-path /usr/share/sword] [--out DIR]
"""
import argparse
import functools
import html
import lzma
import math
import os
import re
import sys
import unicodedata
from collections import Counter

SRC_MODULE = "spaRV1909eb"
TGT_MODULE = "engKJV2006eb"
SRC_LANG, TGT_LANG = "es", "en"

# Held-out books (OSIS names). Mixed genres: OT narrative + NT epistle in each split.
# Avoided on purpose: books that largely duplicate other books (the synoptic gospels,
# Chronicles vs Samuel/Kings), which would leak near-identical verses into the test set.
VALID_BOOKS = ("Judg", "1Cor")
TEST_BOOKS = ("1Sam", "Rom")

MAX_WORDS = 120        # drop a pair if either side has more whitespace-separated words
MIN_WORDS = 1          # ... or fewer
MAX_RATIO = 2.0        # ... or if max(len)/min(len) exceeds this (only when the longer side > RATIO_MIN_LEN)
RATIO_MIN_LEN = 8

_UPPER = "A-ZÁÉÍÓÚÑÜ"


def die(msg):
    sys.exit(f"[build_bible_corpus] error: {msg}")


def load_bible(modules, name):
    try:
        bible = modules.get_bible_from_module(name)
    except Exception as e:  # pysword raises plain exceptions / KeyError
        die(f"cannot open SWORD module {name!r} ({e}); install it with "
            "'apt-get install sword-text-sparv sword-text-kjv'")
    # zText modules with BlockType=BOOK decompress a whole book per verse lookup; cache it.
    if hasattr(bible, "_decompressed_text"):
        bible._decompressed_text = functools.lru_cache(maxsize=8)(bible._decompressed_text)
    return bible


def iter_verses(bible):
    """Yield (book_osis, chapter, verse, raw_osis_text) in canonical order."""
    books = bible.get_structure().get_books()
    for testament in ("ot", "nt"):
        for book in books[testament]:
            for chapter, n_verses in enumerate(book.chapter_lengths, 1):
                texts = list(bible.get_iter(books=[book.osis_name], chapters=[chapter], clean=False))
                if len(texts) != n_verses:
                    die(f"{book.osis_name} {chapter}: expected {n_verses} verses, got {len(texts)}")
                for verse, text in enumerate(texts, 1):
                    yield book.osis_name, chapter, verse, text or ""


def strip_osis(text):
    # drop footnotes / cross references with their content (they can nest <seg>, <divineName>)
    text = re.sub(r"<note\b[^>]*>.*?</note>", " ", text, flags=re.S)
    text = re.sub(r"<note\b[^>]*/>", " ", text)
    # the Hebrew letter headings of Psalm 119 go (RV1909 has no counterpart after fix_spanish);
    # other titles keep their text: psalm superscriptions and the epistles' subscriptions
    # ('Written to the Romans from Corinthus ...') are part of the verse in both translations
    text = re.sub(r"<title\b[^>]*>(?:(?!</title>).)*<foreign\b.*?</title>", " ", text, flags=re.S)
    text = re.sub(r"<[^>]*>", " ", text)  # every other tag: keep the content
    text = html.unescape(text)
    text = re.sub(r"\\\+?[a-z]+\d*\*?", " ", text)  # USFM residue such as '\nd ' and '\+nd*'
    return text


def normalise(text):
    text = unicodedata.normalize("NFC", text)
    text = text.replace("¶", " ").replace("\u2019", "'").replace("\u2018", "'")
    text = re.sub(r"\s+", " ", text).strip()
    text = re.sub(r"\s+([,.;:?!)])", r"\1", text)  # spaces left where tags were removed
    text = re.sub(r"([(¿¡])\s+", r"\1", text)
    return text


_CAPS_WORD = re.compile(rf"^([¡¿(]*)([{_UPPER}]{{2,}})([^\w]*)$")


def _decap_run(words, i, need_lower_next, lower_vocab):
    """Re-case the run of all-capitals words starting at words[i]; True if done.

    A word is lower-cased if it occurs in lower case elsewhere in the text ('ACONTECIÓ'),
    otherwise it is a name and gets an initial capital ('MOISÉS' -> 'Moisés'); the first
    word of a sentence always gets one."""
    j = i
    while j < len(words) and _CAPS_WORD.match(words[j]):
        j += 1
    if j == i or (need_lower_next and not (j < len(words) and re.match(r"[a-záéíóúñü]", words[j]))):
        return False
    for k in range(i, j):
        pre, word, post = _CAPS_WORD.match(words[k]).groups()
        starts_sentence = k == 0 or re.search(r"[.!?:]$", words[k - 1])
        lower = word.lower()
        word = lower if (lower in lower_vocab and not (k == i and starts_sentence)) else word[0] + lower[1:]
        words[k] = pre + word + post
    return True


def fix_spanish(book, chapter, verse, text, lower_vocab):
    """RV1909 prints the first word(s) of a chapter or paragraph (and acrostic letter names) in capitals."""
    if book == "Ps" and chapter == 119 and (verse - 1) % 8 == 0:
        # acrostic stanza heading, e.g. 'ALEPH. BIENAVENTURADOS ...' (KJV keeps it in a dropped <title>)
        text = re.sub(rf"^[{_UPPER}]+\.?\s+", "", text)
    words = text.split(" ")
    if verse == 1:
        # chapter opening, possibly after a psalm superscription: the first capitals run
        # 'EN el principio' -> 'En el principio', 'DE SIETE años' -> 'De siete años',
        # 'Y MOISÉS dijo' -> 'Y Moisés dijo', '... su hijo. ¡OH Jehová' -> '... ¡Oh Jehová'
        for i in range(len(words)):
            if _decap_run(words, i, False, lower_vocab):
                break
    else:
        # paragraph opening inside a chapter: 'HUBO en los días', 'El MISMO día' (only when a
        # lower-case word follows, so 'TEKEL: Pesado ...' and 'YO SOY EL QUE SOY' stay)
        for i in range(min(2, len(words))):
            if _decap_run(words, i, True, lower_vocab):
                break
    return " ".join(words)


# --- verse alignment ---------------------------------------------------------------------
# Both modules claim KJV versification, but the Spanish text keeps RV1909's own verse
# boundaries in ~40 chapters (e.g. Numbers 13, 1 Samuel 24, 1 Kings 22, Job 38-40, Hosea
# 11-12, Jonah 1-2): the verses there are shifted by one against the KJV, or split
# differently. Pairing by verse number alone would put ~300 wrong translations into the
# corpus (some in the test books). So each book is aligned with Gale & Church's (1993)
# length-based dynamic programme (banded): 1-1 beads keep verse pairs, 2-1/1-2/2-2 beads
# join neighbouring verses into one pair, 1-0/0-1 beads (a verse with no counterpart) are
# dropped. Where the numbering agrees (nearly everywhere) this is the identity alignment.
_BEAD_PRIOR = {(1, 1): 0.89, (1, 0): 0.0099 / 2, (0, 1): 0.0099 / 2,
               (2, 1): 0.089 / 2, (1, 2): 0.089 / 2, (2, 2): 0.011}
_GC_VARIANCE = 6.8
_BAND = 40


def _gc_cost(l1, l2, bead, ratio):
    prior = -math.log(_BEAD_PRIOR[bead])
    if l1 == 0 and l2 == 0:
        return prior
    mean = (l1 + l2 / ratio) / 2
    delta = (l2 - l1 * ratio) / math.sqrt(max(mean, 1.0) * _GC_VARIANCE)
    p_two_sided = math.erfc(abs(delta) / math.sqrt(2))  # = 2 * (1 - Phi(|delta|))
    return prior - math.log(max(p_two_sided, 1e-300))


def align_verses(src, tgt, ratio):
    """Gale-Church alignment of two lists of non-empty strings -> list of (src_slice, tgt_slice)."""
    n, m = len(src), len(tgt)
    ps, pt = [0], [0]
    for x in src:
        ps.append(ps[-1] + len(x))
    for x in tgt:
        pt.append(pt[-1] + len(x))
    cost, back = {(0, 0): 0.0}, {}
    for i in range(n + 1):
        centre = round(i * m / max(n, 1))
        for j in range(max(0, centre - _BAND), min(m, centre + _BAND) + 1):
            if i == 0 and j == 0:
                continue
            best, arg = math.inf, None
            for di, dj in _BEAD_PRIOR:
                prev = cost.get((i - di, j - dj))
                if prev is None:
                    continue
                c = prev + _gc_cost(ps[i] - ps[i - di], pt[j] - pt[j - dj], (di, dj), ratio)
                if c < best:
                    best, arg = c, (di, dj)
            if arg is not None:
                cost[(i, j)], back[(i, j)] = best, arg
    if (n, m) not in cost:
        die("verse alignment failed (band too narrow)")
    beads, i, j = [], n, m
    while i or j:
        di, dj = back[(i, j)]
        beads.append((slice(i - di, i), slice(j - dj, j)))
        i, j = i - di, j - dj
    return beads[::-1]


def keep_pair(src, tgt):
    ls, lt = len(src.split()), len(tgt.split())
    if min(ls, lt) < MIN_WORDS:
        return "empty"
    if max(ls, lt) > MAX_WORDS:
        return "too long"
    if max(ls, lt) > RATIO_MIN_LEN and max(ls, lt) / max(1, min(ls, lt)) > MAX_RATIO:
        return "length ratio"
    return None


def write_xz(path, lines):
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    # check=CRC32 and a fixed preset: the output only depends on the input (no timestamps)
    with open(path, "wb") as f:
        f.write(lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC32, preset=9 | lzma.PRESET_EXTREME))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sword-path", default=os.environ.get("SWORD_PATH", "/usr/share/sword"))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "..", "examples", "translation", "bible-es-en"))
    ap.add_argument("--dump-realigned", metavar="FILE",
                    help="write the pairs whose alignment differs from verse-number pairing (for inspection)")
    args = ap.parse_args()

    try:
        from pysword.modules import SwordModules
    except ImportError:
        die("pysword is not installed (pip install pysword)")
    if not os.path.isdir(os.path.join(args.sword_path, "mods.d")):
        die(f"no SWORD library at {args.sword_path}; run 'apt-get install sword-text-sparv sword-text-kjv'")
    modules = SwordModules(args.sword_path)
    found = modules.parse_modules()
    for name in (SRC_MODULE, TGT_MODULE):
        if name not in found:
            die(f"SWORD module {name} not found in {args.sword_path} (found: {sorted(found)}); "
                "run 'apt-get install sword-text-sparv sword-text-kjv'")
    for name in (SRC_MODULE, TGT_MODULE):
        print(f"[build_bible_corpus] {name}: version {found[name].get('version', '?')}", file=sys.stderr)

    src = list(iter_verses(load_bible(modules, SRC_MODULE)))
    tgt = list(iter_verses(load_bible(modules, TGT_MODULE)))
    if [r[:3] for r in src] != [r[:3] for r in tgt]:
        die("the two modules do not share the same verse list")
    all_books = {r[0] for r in src}
    for b in VALID_BOOKS + TEST_BOOKS:
        if b not in all_books:
            die(f"unknown book {b}")

    # clean, then group by book (canonical order), dropping verses that are empty on one side
    books = {}
    dropped = Counter()
    src_clean = [normalise(strip_osis(r[3])) for r in src]
    lower_vocab = {w for line in src_clean for w in re.findall(r"\w+", line) if w.islower()}
    for (book, ch, vs, _), s, (_, _, _, t_raw) in zip(src, src_clean, tgt):
        s = normalise(fix_spanish(book, ch, vs, s, lower_vocab))
        t = normalise(strip_osis(t_raw))
        b_src, b_tgt = books.setdefault(book, ([], []))
        if s:
            b_src.append(((ch, vs), s))
        if t:
            b_tgt.append(((ch, vs), t))
        dropped["empty verse"] += (not s) + (not t)
    n_chars = [sum(len(x) for _, x in b[k]) for b in books.values() for k in (0, 1)]
    ratio = sum(n_chars[1::2]) / sum(n_chars[0::2])  # target chars per source char

    splits = {"train": ([], []), "valid": ([], []), "test": ([], [])}
    n_moved, realigned = 0, []
    for book, (b_src, b_tgt) in books.items():
        for ss, ts in align_verses([x for _, x in b_src], [x for _, x in b_tgt], ratio):
            s_refs, t_refs = [r for r, _ in b_src[ss]], [r for r, _ in b_tgt[ts]]
            if s_refs != t_refs:
                n_moved += max(len(s_refs), len(t_refs))
                fmt = lambda refs: "+".join(f"{c}:{v}" for c, v in refs) or "-"
                realigned.append(f"{book} {SRC_LANG} {fmt(s_refs)} = {TGT_LANG} {fmt(t_refs)}\t"
                                 + " ".join(x for _, x in b_src[ss]) + "\t" + " ".join(x for _, x in b_tgt[ts]))
            if not s_refs or not t_refs:
                dropped["no counterpart"] += max(len(s_refs), len(t_refs))
                continue
            s = " ".join(x for _, x in b_src[ss])
            t = " ".join(x for _, x in b_tgt[ts])
            why = keep_pair(s, t)
            if why:
                dropped[why] += 1
                continue
            split = "valid" if book in VALID_BOOKS else "test" if book in TEST_BOOKS else "train"
            splits[split][0].append(s)
            splits[split][1].append(t)
    if args.dump_realigned:
        with open(args.dump_realigned, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in realigned)

    os.makedirs(args.out, exist_ok=True)
    total = 0
    for split, (ss, ts) in splits.items():
        for lang, lines in ((SRC_LANG, ss), (TGT_LANG, ts)):
            path = os.path.join(args.out, f"{split}.{lang}.xz")
            write_xz(path, lines)
            total += os.path.getsize(path)
        n_words = sum(len(x.split()) for x in ss), sum(len(x.split()) for x in ts)
        print(f"[build_bible_corpus] {split}: {len(ss)} pairs, {n_words[0]} {SRC_LANG} / "
              f"{n_words[1]} {TGT_LANG} words", file=sys.stderr)
    print(f"[build_bible_corpus] verses read: {len(src)}; realigned (not 1-1 by number): {n_moved}; "
          f"dropped: {dict(sorted(dropped.items()))}", file=sys.stderr)
    print(f"[build_bible_corpus] wrote {args.out} ({total / 1e6:.2f} MB compressed)", file=sys.stderr)


if __name__ == "__main__":
    main()
