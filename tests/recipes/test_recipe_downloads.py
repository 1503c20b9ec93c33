"""What the prepare-*.sh recipes download is checked before it is used: HTTPS URLs, each file's
SHA-256 (published, kept in the recipe) compared while it arrives, a mismatch refused in one
line before anything is unpacked, and a file with no published digest not downloaded unless the
user gives one or accepts it unverified. The downloads here come from a local mirror
(EA_DOWNLOAD_MIRROR=file://...) holding the tests' stand-in archives."""
import hashlib
import re
import sys

import pytest

from support import recipe_fixtures as fx
from test_recipes import RECIPES, env, run  # noqa: F401  (fixture)

SCRIPTS = sorted(RECIPES.glob("prepare-*.sh"))


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def mirror(tmp_path):
    """A directory of stand-ins for the WMT'14 En-De and IWSLT'14 archives."""
    fx.wmt14(tmp_path / "mirror", "de", n_train=6, n_eval=2)
    fx.iwslt14(tmp_path / "mirror", n_train=6, n_eval=2)
    return tmp_path / "mirror"


def fetch_env(env, mirror, **extra):  # noqa: F811
    e = {k: v for k, v in env.items() if k not in ("EA_NO_DOWNLOAD", "EA_SHA256", "EA_ALLOW_UNVERIFIED_DOWNLOADS")}
    return dict(e, EA_DOWNLOAD_MIRROR=mirror.as_uri(), **extra)


def test_every_recipe_url_is_https_and_every_digest_a_sha256():
    specs = [m for script in SCRIPTS for m in re.findall(r'"[\w.$-]+=(\S+?)"', script.read_text())]
    urls = [s for s in specs if "://" in s or s.startswith("$")]
    assert len(urls) >= 15
    for script in SCRIPTS:
        assert "http://" not in script.read_text(), script
    digests = re.findall(r"#sha256=(\w+)", "".join(s.read_text() for s in SCRIPTS))
    assert len(digests) >= 11 and all(re.fullmatch(r"[0-9a-f]{64}", d) for d in digests)


def test_a_download_that_is_not_the_published_file_is_refused_before_it_is_unpacked(tmp_path, env, mirror):  # noqa: F811
    """prepare-wmt14en2de.sh: the stand-in Europarl archive is not the published one."""
    work = tmp_path / "w"
    user = f"dev.tgz={sha256(mirror / 'dev.tgz')} test-full.tgz={sha256(mirror / 'test-full.tgz')}"
    proc = run(["bash", RECIPES / "prepare-wmt14en2de.sh", "--work-dir", work],
               fetch_env(env, mirror, EA_SHA256=user), tmp_path, check=False)
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode == 4 and len(errors) == 1, proc.stderr
    found = sha256(mirror / "training-parallel-europarl-v7.tgz")
    assert errors[0].startswith("[fetch] error: training-parallel-europarl-v7.tgz from file://")
    assert f"SHA-256 {found}, expected 0224c7c710c8a063dfd893b0cc0830202d61f4c75c17eb8e31836103d27d96e7" in errors[0]
    assert "nothing unpacked" in errors[0] and "EA_SHA256=training-parallel-europarl-v7.tgz=" in errors[0]
    assert [p.name for p in (work / "orig").iterdir()] == []  # no archive, no .part, nothing unpacked
    assert "Traceback" not in proc.stderr

    # negative control: with the stand-in's own digest given, the same download is kept and unpacked
    proc = run(["bash", RECIPES / "prepare-wmt14en2de.sh", "--work-dir", work],
               fetch_env(env, mirror, EA_SHA256=f"{user} training-parallel-europarl-v7.tgz={found}"), tmp_path,
               check=False)
    assert (work / "orig" / "training-parallel-europarl-v7" / ".unpacked").is_file(), proc.stderr
    assert proc.returncode == 4 and "training-parallel-commoncrawl.tgz from file://" in proc.stderr  # the next one


def test_a_file_without_a_published_digest_is_not_downloaded_unless_the_user_says_so(tmp_path, env, mirror):  # noqa: F811
    work = tmp_path / "w"
    proc = run(["bash", RECIPES / "prepare-iwslt14.sh", "--work-dir", work], fetch_env(env, mirror), tmp_path,
               check=False)
    assert proc.returncode == 4 and proc.stderr.count("\n") == 1, proc.stderr
    assert "no published SHA-256 to check de-en.tgz" in proc.stderr and "--raw-dir" in proc.stderr
    assert "EA_SHA256=" in proc.stderr and "EA_ALLOW_UNVERIFIED_DOWNLOADS=1" in proc.stderr
    assert "downloading" not in proc.stderr and list((work / "orig").iterdir()) == []

    fetch = [sys.executable, RECIPES / "nmt_text.py", "fetch", "--orig", work / "orig",
             "de-en.tgz=https://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz"]
    proc = run(fetch, fetch_env(env, mirror, EA_ALLOW_UNVERIFIED_DOWNLOADS="1"), tmp_path)
    assert f"de-en.tgz used unverified, SHA-256 {sha256(mirror / 'de-en.tgz')}" in proc.stderr
    assert (work / "orig" / "de-en" / ".unpacked").is_file()

    proc = run(fetch[:4] + [work / "given"] + fetch[5:], fetch_env(env, mirror, EA_SHA256="de-en.tgz=0"),
               tmp_path, check=False)
    assert proc.returncode == 4 and "not NAME=SHA256" in proc.stderr


def test_the_readme_says_how_downloads_are_checked():
    text = (RECIPES / "README.md").read_text()
    assert "EA_SHA256" in text and "EA_ALLOW_UNVERIFIED_DOWNLOADS" in text and "EA_DOWNLOAD_MIRROR" in text

