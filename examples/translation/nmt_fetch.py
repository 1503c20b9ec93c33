"""The recipes' raw data: the archives a recipe names placed in ORIG (from --raw-dir, or
downloaded and checked against their published SHA-256) and unpacked, and a corpus file found
inside them: nmt_text.py's ``fetch`` and ``find`` commands."""
import gzip
import hashlib
import lzma
import os
import re
import shutil
import sys
import tarfile
import urllib.request
import zipfile
from pathlib import Path


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
