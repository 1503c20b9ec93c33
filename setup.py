"""ea_fairseq: evolving-attention variants (EA, PA, RAN, DropAttention) as a fairseq --user-dir plugin.

The plugin deliberately does not depend on a fairseq distribution by name: fairseq is
published under several names that all install the same ``fairseq`` package
(ve-fairseq, fairseq-fixed, a source checkout of upstream main). Requiring one of them
would make pip swap a user's own build. Use scripts/setup_env.sh for the tested,
pinned environment, or ``pip install --no-deps -e .`` next to your own fairseq
(post-0.12.2 upstream main; checked at import time).
"""
from setuptools import find_packages, setup

setup(
    name="ea_fairseq",
    version="0.1.0",
    description="Evolving / predictive / recurrent attention and DropAttention for fairseq",
    long_description=__doc__,
    packages=find_packages(include=["ea_fairseq", "ea_fairseq.*"]),
    package_data={"ea_fairseq": ["accelerators/cpu/csrc/*.cpp", "accelerators/cpu/csrc/*.h"]},  # built on first use (accelerators/cpu/build.py)
    python_requires=">=3.9",
    install_requires=[],
    extras_require={
        "pinned": ["torch==2.13.0", "ve-fairseq==0.12.3"],
        "analysis": ["matplotlib", "tabulate"],
    },
    entry_points={
        "console_scripts": [],
    },
)
