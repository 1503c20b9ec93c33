"""The environment scripts/setup_env.sh builds is the tested set of constraints.txt: every
distribution in it pinned there, at its pinned version (a package left unpinned is whatever
is newest on the day a fresh machine builds it)."""
import hashlib
import os
import re
import sys
import sysconfig
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: not pinned: the project itself, and the pip that comes with the Python that made the venv
UNPINNED = {"ea-fairseq", "pip"}


def pins(path):
    out = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                req = Requirement(line)
                (spec,) = req.specifier
                assert spec.operator == "==", f"{path}: {line!r} is not an exact pin"
                out[canonicalize_name(req.name)] = spec
    return out


def built_by_setup_env() -> bool:
    """This interpreter's venv is setup_env.sh's, for these constraints, with the CPU build of
    torch (a build from another index brings requirements of its own)."""
    stamp = os.path.join(sys.prefix, ".ea_fairseq_stamp")
    if not os.path.isfile(stamp):
        return False
    blob = b"".join(open(os.path.join(REPO, name), "rb").read() for name in ("constraints.txt", "pyproject.toml"))
    import torch

    return open(stamp).read().strip() == hashlib.sha256(blob).hexdigest() and torch.version.cuda is None


def installed():
    """What pip installed into the venv (not the packages some of them vendor, which land on
    sys.path once imported: setuptools')."""
    site = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    return {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions(path=sorted(site))}


def findings(pinned, have):
    """(installed but not pinned, {name: (installed, pin)} off their pin)."""
    unpinned = sorted(set(have) - set(pinned) - UNPINNED)
    wrong = {name: (have[name], str(spec)) for name, spec in pinned.items()
             if name in have and not spec.contains(have[name], prereleases=True)}
    return unpinned, wrong


def test_the_constraints_are_exact_pins_and_name_each_package_once():
    with open(os.path.join(REPO, "constraints.txt"), encoding="utf-8") as f:
        names = [canonicalize_name(re.split(r"[=<>!~ \[]", line.strip(), 1)[0]) for line in f
                 if line.strip() and not line.lstrip().startswith("#")]
    assert len(names) == len(set(names)) == len(pins(os.path.join(REPO, "constraints.txt")))


@pytest.mark.skipif(not built_by_setup_env(),
                    reason="this environment is not setup_env.sh's for this constraints.txt with the CPU torch")
def test_every_installed_package_is_pinned_at_its_version():
    unpinned, wrong = findings(pins(os.path.join(REPO, "constraints.txt")), installed())
    assert not unpinned, f"installed but not pinned in constraints.txt: {unpinned}: pin the tested versions"
    assert not wrong, f"installed versions differ from constraints.txt: {wrong}"


def test_a_package_unpinned_or_off_its_pin_is_found():
    """The check above on an environment with one package too many and one off its pin."""
    pinned = pins(os.path.join(REPO, "constraints.txt"))
    have = {name: str(spec.version) for name, spec in pinned.items()}
    assert findings(pinned, have) == ([], {})
    have.update({"some-new-dependency": "1.0", "scipy": "0.1"})
    assert findings(pinned, have) == (["some-new-dependency"], {"scipy": ("0.1", str(pinned["scipy"]))})
