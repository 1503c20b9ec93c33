"""``import ea_fairseq`` does the same in every program: whatever ``sys.argv`` says, it loads the
plugin (fairseq's registries, the checkpoint, archive and data-file checks) and leaves
``sys.excepthook`` alone; the one-line error printing is installed only in a program the plugin
serves (a fairseq command-line entry point, the plugin's own tools). The tools' package imports
neither fairseq nor torch."""
import json
import os
import subprocess
import sys

from conftest import REPO

STATE = """
import json, sys
sys.argv[:] = {argv!r}
sys.orig_argv[:] = [sys.executable] + {orig!r}
import ea_fairseq
from fairseq import checkpoint_utils, file_utils
from fairseq.data import Dictionary, data_utils, encoders
from fairseq.models import ARCH_MODEL_REGISTRY
from fairseq.tasks import TASK_REGISTRY
print(json.dumps({{
    "archs": sorted(a for a, m in ARCH_MODEL_REGISTRY.items() if m.__module__.startswith("ea_fairseq.")),
    "tasks": sorted(t for t, c in TASK_REGISTRY.items() if c.__module__.startswith("ea_fairseq.")),
    "checkpoints checked by": checkpoint_utils.load_checkpoint_to_cpu.__module__,
    "archives extracted by": file_utils.load_archive_file.__module__,
    "data files checked by": [f.__module__ for f in
                              (data_utils.load_indexed_dataset, Dictionary.add_from_file, encoders.build_bpe)],
    "excepthook": sys.excepthook is sys.__excepthook__ and "python's" or "replaced",
}}))
"""


def _env():
    return dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def _run(code, *args):
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), cwd=REPO)


def _result(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return out


ARGVS = {  # sys.argv, and the interpreter's own arguments (python -m NAME ...)
    "python -c": (["-c"], ["-c", "..."]),
    "a console tool's name": (["/usr/local/bin/ea-fairseq-bleu", "--help"], ["/usr/local/bin/ea-fairseq-bleu"]),
    "python -m a tool": (["ea_fairseq_cli/bleu.py", "--help"], ["-m", "ea_fairseq_cli.bleu", "--help"]),
    "fairseq-train's name": (["fairseq-train", "data", "--user-dir", "ea_fairseq"], ["fairseq-train"]),
}


def test_import_loads_the_same_plugin_whatever_sys_argv_says():
    procs = {name: _run(STATE.format(argv=argv, orig=orig)) for name, (argv, orig) in ARGVS.items()}
    states = {name: json.loads(_result(proc)) for name, proc in procs.items()}
    first = states["python -c"]
    assert "ea_transformer_lite" in first["archs"] and "translation_lines" in first["tasks"]
    assert first["checkpoints checked by"] == "ea_fairseq.safety.no_code.hook"
    assert first["data files checked by"] == ["ea_fairseq.safety.data_files"] * 3
    assert first["archives extracted by"] == "ea_fairseq.safety.archives"
    assert first["excepthook"] == "python's"  # a plain import leaves it alone
    for name, state in states.items():
        assert state == first, name


def test_the_excepthook_is_installed_in_a_fairseq_entry_point_and_only_there(tmp_path):
    """A program whose main module is a fairseq console script (it imports ``cli_main`` from
    ``fairseq_cli``) gets the one-line printing when it imports the plugin, as
    ``fairseq-train --user-dir ea_fairseq`` does; the negative control, the same program
    without that import, keeps Python's."""
    served = tmp_path / "served.py"
    served.write_text("from fairseq_cli.generate import cli_main  # noqa: F401\n"
                      "import sys\nimport ea_fairseq  # noqa: F401\n"
                      "print(sys.excepthook is sys.__excepthook__, sys.excepthook.ea_fairseq_replaces)\n")
    plain = tmp_path / "plain.py"
    plain.write_text("import fairseq_cli.generate  # noqa: F401\nimport sys\nimport ea_fairseq  # noqa: F401\n"
                     "print(sys.excepthook is sys.__excepthook__)\n")
    procs = [subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=_env(), cwd=REPO) for path in (served, plain)]
    assert [_result(proc).split() for proc in procs] == [["False", "sys:excepthook"], ["True"]]


def test_the_tools_package_imports_neither_fairseq_nor_torch():
    """``ea_fairseq_cli`` (every console tool's module) loads where fairseq and torch cannot be
    imported at all (the COMET environment has no fairseq); the metric tools run there."""
    code = ("import sys\nsys.modules['fairseq'] = sys.modules['torch'] = None\n"
            "from ea_fairseq_cli import analysis, average_checkpoints, bleu, compare_systems, curves, warm_start\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fairseq', 'torch', 'ea_fairseq')))\n"
            "print(bleu.main(['--help']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=REPO)
    # (the plugin's read and write primitives, standard library only, loaded without the plugin)
    assert proc.stdout.splitlines()[0] == ("['ea_fairseq.errors', 'ea_fairseq.safety', 'ea_fairseq.safety.confined', "
                                           "'ea_fairseq.safety.writers', 'fairseq', 'torch']"), proc.stderr[-2000:]
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-2000:]
