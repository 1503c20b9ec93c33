"""Tiny stand-ins for the raw archives the translation recipes read.

Each builder writes, into a directory, files with the names and inner layout of the real
downloads (archive name, folders, file names, SGML/XML/tag formats), filled with a few
dozen made-up parallel sentences. ``prepare-*.sh --raw-dir DIR`` then runs offline.
"""
import gzip
import io
import random
import tarfile
import zipfile
from pathlib import Path

_WORDS = (
    "the house is big and old . a dog runs fast over the street , while one small child "
    "plays in the garden with a cat ; she laughs today : state-of-the-art ideas are "
    "never simple ? we don't know \" why \" it works , but ( maybe ) it's fine !"
).split()


def _word(word: str, lang: str) -> str:
    """A deterministic 'translation' of an English word into LANG (parallel but different)."""
    if lang == "en" or not word[0].isalpha():
        return word
    if "-" in word:  # keep compounds as compounds, to exercise the compound split
        return "-".join(_word(w, lang) for w in word.split("-"))
    return f"{word[::-1]}{lang}"


def sentences(n: int, lang: str, seed: int, cased: bool = True):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
        line = " ".join(_word(w, lang) for w in words)
        out.append(line[0].upper() + line[1:] if cased else line)
    return out


def _add(tar: tarfile.TarFile, name: str, text: str) -> None:
    data = text.encode("utf-8")
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _tgz(path: Path, members: dict, mode: str = "w:gz") -> None:
    with tarfile.open(path, mode) as tar:
        for name, text in members.items():
            _add(tar, name, text)


def _plain(lines) -> str:
    return "".join(line + "\n" for line in lines)


def _sgm(lines, kind: str, lang: str, setid: str) -> str:
    tag = {"src": "srcset", "ref": "refset"}[kind]
    body = "".join(f'<seg id="{i}">{line}</seg>\n' for i, line in enumerate(lines, 1))
    return (f'<{tag} setid="{setid}" srclang="any" trglang="{lang}">\n'
            f'<doc sysid="{kind}" docid="d1" genre="news" origlang="en">\n<p>\n'
            f"{body}</p>\n</doc>\n</{tag}>\n")


def _pair(src: str, tgt: str, n: int, seed: int):
    return sentences(n, src, seed), sentences(n, tgt, seed)


# --------------------------------------------------------------------------- IWSLT'14

IWSLT14_TEST_SETS = ("IWSLT14.TED.dev2010", "IWSLT14.TEDX.dev2012", "IWSLT14.TED.tst2010",
                     "IWSLT14.TED.tst2011", "IWSLT14.TED.tst2012")


def iwslt14(raw: Path, n_train: int = 80, n_eval: int = 4) -> dict:
    """de-en.tgz: de-en/train.tags.de-en.{de,en} with talk headers + the XML dev/test sets."""
    members = {}
    de, en = _pair("de", "en", n_train, seed=1)
    for lang, lines in (("de", de), ("en", en)):
        header = ["<url>http://www.ted.com/talks/x.html</url>", "<keywords>talks</keywords>",
                  "<talkid>1</talkid>", f"<title>Title {lang}</title>",
                  f"<description>About {lang}</description>"]
        members[f"de-en/train.tags.de-en.{lang}"] = _plain(header + lines)
    counts = {}
    for k, name in enumerate(IWSLT14_TEST_SETS):
        de, en = _pair("de", "en", n_eval, seed=100 + k)
        en = [line.replace("'", "\u2019") for line in en]  # the ’ the recipe normalizes
        for lang, lines in (("de", de), ("en", en)):
            body = "".join(f'<seg id="{i}"> {line} </seg>\n' for i, line in enumerate(lines, 1))
            members[f"de-en/{name}.de-en.{lang}.xml"] = (
                f'<?xml version="1.0" encoding="UTF-8"?>\n<mteval>\n<srcset setid="{name}" '
                f'srclang="{lang}">\n<doc docid="1">\n<talkid>1</talkid>\n{body}</doc>\n'
                "</srcset>\n</mteval>\n")
        counts[name] = n_eval
    raw.mkdir(parents=True, exist_ok=True)
    _tgz(raw / "de-en.tgz", members)
    return {"train_pairs": n_train, "test_lines": n_eval * len(IWSLT14_TEST_SETS)}


# --------------------------------------------------------------------------- WMT'14


def wmt14(raw: Path, tgt: str, n_train: int = 60, n_eval: int = 6,
          news_commentary: str = "v9") -> dict:
    """The WMT'14 archives of prepare-wmt14en2{de,fr}.sh (layout of the statmt.org files)."""
    raw.mkdir(parents=True, exist_ok=True)
    pair = f"{tgt}-en"
    en, xx = _pair("en", tgt, n_train, seed=2)
    _tgz(raw / "training-parallel-europarl-v7.tgz",
         {f"training/europarl-v7.{pair}.en": _plain(en), f"training/europarl-v7.{pair}.{tgt}": _plain(xx)})
    en, xx = _pair("en", tgt, n_train, seed=3)
    _tgz(raw / "training-parallel-commoncrawl.tgz",
         {f"commoncrawl.{pair}.en": _plain(en), f"commoncrawl.{pair}.{tgt}": _plain(xx)})
    en, xx = _pair("en", tgt, n_train, seed=4)
    if news_commentary == "v9":
        _tgz(raw / "training-parallel-nc-v9.tgz",
             {f"training/news-commentary-v9.{pair}.en": _plain(en),
              f"training/news-commentary-v9.{pair}.{tgt}": _plain(xx)})
    else:
        _tgz(raw / "training-parallel-nc-v12.tgz",
             {f"training/news-commentary-v12.{pair}.en": _plain(en),
              f"training/news-commentary-v12.{pair}.{tgt}": _plain(xx)})
    if tgt == "fr":
        en, xx = _pair("en", tgt, n_train, seed=5)
        _tgz(raw / "training-parallel-un.tgz",
             {f"un/undoc.2000.{pair}.en": _plain(en), f"un/undoc.2000.{pair}.{tgt}": _plain(xx)})
        en, xx = _pair("en", tgt, n_train, seed=6)
        _giga(raw / "training-giga-fren.tar", en, xx)
    en, xx = _pair("en", tgt, n_eval, seed=7)
    _tgz(raw / "dev.tgz", {"dev/newstest2013.en": _plain(en), f"dev/newstest2013.{tgt}": _plain(xx),
                           "dev/newstest2012.en": _plain(en[:2])})
    en, xx = _pair("en", tgt, n_eval, seed=8)
    code = f"{tgt}en"
    _tgz(raw / "test-full.tgz",
         {f"test-full/newstest2014-{code}-src.en.sgm": _sgm(en, "src", "en", "newstest2014"),
          f"test-full/newstest2014-{code}-ref.{tgt}.sgm": _sgm(xx, "ref", tgt, "newstest2014"),
          f"test-full/newstest2014-{code}-src.{tgt}.sgm": _sgm(xx, "src", tgt, "newstest2014"),
          f"test-full/newstest2014-{code}-ref.en.sgm": _sgm(en, "ref", "en", "newstest2014")})
    return {"test_en": en, f"test_{tgt}": xx}


def _giga(path: Path, en, fr) -> None:
    with tarfile.open(path, "w") as tar:
        for lang, lines in (("en", en), ("fr", fr)):
            data = gzip.compress(_plain(lines).encode("utf-8"))
            info = tarfile.TarInfo(f"giga-fren.release2.fixed.{lang}.gz")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


# --------------------------------------------------------------------------- WMT'17

WMT17_DEV = {"lv": "newsdev2017", "fi": "newstest2016", "tr": "newstest2016"}


def wmt17(raw: Path, lang: str, n_train: int = 60, n_eval: int = 5) -> dict:
    raw.mkdir(parents=True, exist_ok=True)
    seed = {"lv": 10, "fi": 20, "tr": 30}[lang]
    if lang in ("lv", "fi"):
        en, xx = _pair("en", lang, n_train, seed)
        _tgz(raw / "training-parallel-ep-v8.tgz",
             {f"training/europarl-v8.{lang}-en.en": _plain(en),
              f"training/europarl-v8.{lang}-en.{lang}": _plain(xx)})
        en, xx = _pair("en", lang, n_train, seed + 1)
        _tgz(raw / "rapid2016.tgz", {f"rapid2016.en-{lang}.en": _plain(en),
                                     f"rapid2016.en-{lang}.{lang}": _plain(xx)})
    if lang == "lv":
        en, xx = _pair("en", lang, n_train, seed + 2)
        _tgz(raw / "leta.v1.tgz", {"LETA-lv-en/leta.en": _plain(en), "LETA-lv-en/leta.lv": _plain(xx)})
        en, xx = _pair("en", lang, n_train, seed + 3)
        _tgz(raw / "dcep.lv-en.v1.tgz", {"dcep.en-lv/dcep.en": _plain(en), "dcep.en-lv/dcep.lv": _plain(xx)})
        en, xx = _pair("en", lang, 8, seed + 4)
        _tgz(raw / "books.lv-en.v1.tgz", {"farewell/farewell.en": _plain(en), "farewell/farewell.lv": _plain(xx)})
    if lang == "fi":
        en, xx = _pair("en", lang, n_train, seed + 2)
        _tgz(raw / "wiki-titles.tgz", {"wiki/fi-en/titles.fi-en": _plain(f"{f} ||| {e}" for f, e in zip(xx, en))})
    if lang == "tr":
        en, xx = _pair("en", lang, n_train, seed)
        with zipfile.ZipFile(raw / "en-tr.txt.zip", "w") as zf:
            zf.writestr("SETIMES.en-tr.en", _plain(en))
            zf.writestr("SETIMES.en-tr.tr", _plain(xx))
            zf.writestr("README", "fixture\n")
    dev = WMT17_DEV[lang]
    members = {}
    for i, (a, b) in enumerate((("en", lang), (lang, "en"))):
        s, t = _pair(a, b, n_eval, seed + 5 + i)
        members[f"dev/{dev}-{a}{b}-src.{a}.sgm"] = _sgm(s, "src", a, dev)
        members[f"dev/{dev}-{a}{b}-ref.{b}.sgm"] = _sgm(t, "ref", b, dev)
    _tgz(raw / "dev.tgz", members)
    members = {}
    tests = {}
    for i, (a, b) in enumerate((("en", lang), (lang, "en"))):
        s, t = _pair(a, b, n_eval + i, seed + 7 + i)  # directions differ in length on purpose
        members[f"test/newstest2017-{a}{b}-src.{a}.sgm"] = _sgm(s, "src", a, "newstest2017")
        members[f"test/newstest2017-{a}{b}-ref.{b}.sgm"] = _sgm(t, "ref", b, "newstest2017")
        tests[f"{a}-{b}"] = (s, t)
    _tgz(raw / "test.tgz", members)
    return tests


def write_scored_run(directory: Path, refs, hyps, segments=None) -> Path:
    """An ``evaluate.sh`` output for given hypotheses: a ``fairseq-generate`` file scored by
    ``ea-fairseq-bleu`` (iwslt mode) in ``directory/eval``, and optional segment scores
    ``{metric: values}`` of a metric computed elsewhere; the ``eval`` directory."""
    from ea_fairseq_cli import bleu

    ev = directory / "eval"
    ev.mkdir(parents=True)
    gen = ev / "generate-test.de-en.txt"
    gen.write_text("".join(f"S-{i}\tx\nT-{i}\t{r}\nH-{i}\t-0.1\t{h}\nD-{i}\t-0.1\t{h}\n"
                           for i, (r, h) in enumerate(zip(refs, hyps))), encoding="utf-8")
    assert bleu.main([str(gen), "--mode", "iwslt", "--out-prefix", str(ev / "test.de-en")]) == 0
    for name, values in (segments or {}).items():
        (ev / f"test.de-en.seg.{name}").write_text("".join(f"{float(v)!r}\n" for v in values))
    return ev
