"""The environment scripts/setup_env.sh builds is the tested set of constraints.txt: every
package it installs (what it names, torch, ve-fairseq, this project with its ``test`` and
``corpus`` extras, and all they require) pinned there, and installed at its pin. A package
left unpinned is whatever is newest on the day a fresh machine builds it. What a user installs
into the venv beside them is theirs, and not looked at."""
import hashlib
import os
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONSTRAINTS = os.path.join(REPO, "constraints.txt")
#: what setup_env.sh installs by name (and scripts/test_triton.sh: triton, where present):
#: name -> extras
ROOTS = {"torch": (), "setuptools": (), "ve-fairseq": (), "ea-fairseq": ("test", "corpus"), "triton": ()}
PROJECT = "ea-fairseq"  # installed from the checkout, not pinned


def pins(path=CONSTRAINTS):
    """name -> its ``==`` specifier; asserts each line is an exact pin of a package not
    pinned on an earlier line."""
    out = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                req = Requirement(line)
                (spec,) = req.specifier
                name = canonicalize_name(req.name)
                assert spec.operator == "==", f"{path}: {line!r} is not an exact pin"
                assert name not in out, f"{path}: {req.name} is pinned twice"
                out[name] = spec
    return out


def built_by_setup_env() -> bool:
    """This interpreter's venv is setup_env.sh's, for these constraints, with the CPU build of
    torch (a build from another index brings requirements of its own)."""
    stamp = os.path.join(sys.prefix, ".ea_fairseq_stamp")
    if not os.path.isfile(stamp):
        return False
    blob = b"".join(Path(REPO, name).read_bytes() for name in ("constraints.txt", "pyproject.toml"))
    import torch

    return Path(stamp).read_text().strip() == hashlib.sha256(blob).hexdigest() and torch.version.cuda is None


def installed():
    """name -> (version, requirements) of what pip installed into the venv (not the packages
    some of them vendor, which land on sys.path once imported: setuptools')."""
    site = sorted({sysconfig.get_paths()[key] for key in ("purelib", "platlib")})
    return {canonicalize_name(d.metadata["Name"]): (d.version, d.requires or [])
            for d in metadata.distributions(path=site)}


def required(have, roots=ROOTS):
    """The installed packages ``roots`` (with their extras) require, themselves included."""
    seen, todo = set(), [(canonicalize_name(name), frozenset(extras)) for name, extras in roots.items()]
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen or name not in have:
            continue
        seen.add((name, extras))
        for line in have[name][1]:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (*extras, "")):
                todo.append((canonicalize_name(req.name), frozenset(req.extras)))
    return {name for name, _ in seen}


def findings(pinned, have):
    """(required but not pinned, {name: (installed, pin)} off their pin)."""
    unpinned = sorted(required(have) - set(pinned) - {PROJECT})
    wrong = {name: (have[name][0], str(spec)) for name, spec in pinned.items()
             if name in have and not spec.contains(have[name][0], prereleases=True)}
    return unpinned, wrong


def test_the_constraints_are_exact_pins_and_name_each_package_once(tmp_path):
    assert "scipy" in pins()
    for text, message in (("torch>=2\n", "is not an exact pin"), ("SciPy==1\nscipy==1\n", "scipy is pinned twice")):
        (tmp_path / "c.txt").write_text(text)
        with pytest.raises(AssertionError, match=message):
            pins(tmp_path / "c.txt")


@pytest.mark.skipif(not built_by_setup_env(),
                    reason="this environment is not setup_env.sh's for this constraints.txt with the CPU torch")
def test_every_package_setup_env_installs_is_pinned_at_its_version():
    have = installed()
    assert {"torch", "ve-fairseq", "scipy", "scikit-learn", "pytest"} <= required(have)  # the walk reaches them
    unpinned, wrong = findings(pins(), have)
    assert not unpinned, f"installed by setup_env.sh but not pinned in constraints.txt: {unpinned}: pin them"
    assert not wrong, f"installed versions differ from constraints.txt: {wrong}"


def test_an_unpinned_requirement_or_a_version_off_its_pin_is_found():
    """The check above on an environment where a pinned package requires one that is not
    pinned, through an extra, another package is off its pin, and a package nothing requires
    (a user's own) is installed."""
    pinned = pins()
    have = {name: (str(spec.version), []) for name, spec in pinned.items()}
    have[PROJECT] = ("0", ['scipy; extra == "test"'])
    assert findings(pinned, have) == ([], {})
    have["scipy"] = ("0.1", ["new-dependency[fast]"])
    have["new-dependency"] = ("1.0", ['deeper; extra == "fast"', 'not-needed; extra == "slow"'])
    have["deeper"] = have["not-needed"] = have["a-users-own"] = ("1.0", [])
    unpinned, wrong = findings(pinned, have)
    assert unpinned == ["deeper", "new-dependency"]
    assert wrong == {"scipy": ("0.1", str(pinned["scipy"]))}
