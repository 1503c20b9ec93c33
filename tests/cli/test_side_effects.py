"""What loading the plugin changes outside the plugin is the table of ``ea_fairseq.side_effects``
and nothing else: a process records every fairseq, omegaconf, hydra and torch module, and the
standard library's that the table names (its
attributes, its classes' attributes, its registries' items) as it finishes importing, then
the plugin is loaded and every replaced value is listed. The list must be the table's rows
for that process, each the plugin's replacement holding fairseq's original; the negative
control, a replacement made outside the table, is listed as one."""
import json
import os
import subprocess
import sys

from conftest import REPO

WATCH = r"""
import importlib.abc, json, logging, os, sys, warnings

WATCHED = ("fairseq", "fairseq_cli", "omegaconf", "hydra", "torch")  # torch: only torch, torch.serialization
recorded = {}  # module name: {attribute: value}, as the module finished importing


def attributes(module):
    out = {}
    for name, value in list(vars(module).items()):
        if name.startswith("__"):
            continue
        out[name] = value
        if isinstance(value, type) and value.__module__ == module.__name__:
            for key, member in list(vars(value).items()):
                if not key.startswith("__"):
                    out[f"{name}.{key}"] = member
        if isinstance(value, dict) and name.endswith("REGISTRY"):
            out.update({f"{name}[{key}]": item for key, item in list(value.items()) if isinstance(key, str)})
    return out


class Recorder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] not in WATCHED[:-1]:
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module, run=run):
            run(module)
            recorded[module.__name__] = attributes(module)

        spec.loader.exec_module = exec_module
        return spec


import fairseq  # noqa: E402,F401  (what fairseq's own import changes is fairseq's)

for name, module in list(sys.modules.items()):
    if name.split(".")[0] in WATCHED[:-1] or name in ("torch", "torch.serialization", "sys", "os", "logging",
                                                       "warnings", "argparse"):
        if getattr(module, "__name__", name) == name:  # (not an alias: fairseq.distributed_utils is
            recorded[name] = attributes(module)         # fairseq.distributed.utils, recorded as such)
sys.meta_path.insert(0, Recorder())  # the modules imported from here on, as each finishes importing
environ, filters, root = dict(os.environ), list(warnings.filters), logging.getLogger().level


def replaced():
    out = []
    for module, before in recorded.items():
        now = attributes(sys.modules[module])
        out += [f"{module}:{key}" for key, value in before.items() if key not in now or now[key] is not value]
    if dict(os.environ) != environ:
        out.append("os:environ")
    if list(warnings.filters) != filters:
        out.append("warnings:filters")
    if logging.getLogger().level != root:
        out.append("logging:root.level")
    return sorted(out)


import ea_fairseq  # noqa: E402
from ea_fairseq import side_effects  # noqa: E402
from fairseq.models.transformer import TransformerModel  # noqa: E402

plain = replaced()
rows = {row.target: row for row in side_effects.SIDE_EFFECTS}
theirs = {}
for target in plain:
    row = rows.get(target)
    if row is not None:
        module, _, name = target.partition(":")
        now = attributes(sys.modules[module])[name]
        theirs[target] = [getattr(now, side_effects.MARK, None) == target, now.__wrapped__ is recorded[module][name]]
archs = sorted(key.split("[")[1][:-1] for key, value in recorded["fairseq.models"].items()
               if key.startswith("ARCH_MODEL_REGISTRY[") and value is TransformerModel)
side_effects.install(serving_command_line=True)
side_effects.install(serving_command_line=True)  # idempotent: one hook, chained to Python's
served = replaced()
once = sys.excepthook.__wrapped__ is sys.__excepthook__
registry_row = next(row.target for row in side_effects.SIDE_EFFECTS if row.how == "registry items")
kept = all(side_effects.original(registry_row, arch) is TransformerModel for arch in archs)
import fairseq.utils  # noqa: E402

fairseq.utils.move_to_cpu = lambda sample: sample  # a replacement outside the table
print(json.dumps({"plain": plain, "theirs": theirs, "archs": archs, "served": served, "hidden": replaced(),
                  "excepthook chained once": once, "registry originals kept": kept,
                  "gate": side_effects.original("omegaconf.base:Container._maybe_resolve_interpolation").__module__}))
"""


def test_loading_the_plugin_replaces_the_tables_rows_and_nothing_else():
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", WATCH], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])

    from ea_fairseq import side_effects

    def expected(scopes):
        out = []
        for row in side_effects.SIDE_EFFECTS:
            if row.scope not in scopes:
                continue
            if row.how == "attribute":
                out.append(row.target)
            elif row.how == "registry items":
                registry = row.target.split("[")[0]
                out += [f"{registry}[{arch}]" for arch in found["archs"]]
            elif row.replacement == "ea_fairseq.known_warnings:install":  # (and the hydra logger's level)
                out.append("warnings:filters")
        return sorted(out)

    every = (side_effects.EVERY_PROCESS,)
    assert "transformer" in found["archs"] and "transformer_wmt_en_de" in found["archs"]
    assert found["plain"] == expected(every)
    attribute_rows = [row.target for row in side_effects.SIDE_EFFECTS
                      if row.how == "attribute" and row.scope in every]
    assert found["theirs"] == {target: [True, True] for target in attribute_rows}  # the plugin's, fairseq's kept
    assert found["served"] == expected(every + (side_effects.SERVED_COMMAND_LINES,))
    assert found["excepthook chained once"] and found["registry originals kept"]
    assert found["gate"] == "omegaconf.base"  # the scoped replacement is not in place after loading
    assert set(found["hidden"]) - set(found["served"]) == {"fairseq.utils:move_to_cpu"}  # negative control


def test_the_plugin_loaded_by_user_dir_under_another_name_is_loaded_once(tmp_path):
    """fairseq's ``--user-dir`` imports the folder under its own name: the table's rows name
    that package's replacements, so the plugin is loaded once, its replacements in place. (A
    table read by its written names imports a second copy as ``ea_fairseq``, which registers
    every model again: fairseq's 'Cannot register duplicate model architecture', exit 1.)"""
    (tmp_path / "my_plugin").symlink_to(os.path.join(REPO, "ea_fairseq"))
    code = (
        "import argparse, sys\n"
        "from fairseq.utils import import_user_module\n"
        "import_user_module(argparse.Namespace(user_dir=sys.argv[1]))\n"
        "from fairseq import checkpoint_utils\n"
        "from fairseq.models import ARCH_MODEL_REGISTRY\n"
        "print(sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in ('my_plugin', 'ea_fairseq')}),\n"
        "      checkpoint_utils.load_checkpoint_to_cpu.__module__, ARCH_MODEL_REGISTRY['transformer'].__module__)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "my_plugin")], capture_output=True, text=True,
                          cwd=str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["['my_plugin']", "my_plugin.safety.no_code.hook", "my_plugin.models.baseline"]


PREFETCHING = """
import sys, time, torch
from fairseq.data.iterators import BufferedIterator
if sys.argv[1] == "served":
    from ea_fairseq import side_effects
    side_effects.install(serving_command_line=True)


class Batches:  # fairseq's prefetch thread busy inside torch when Python finalizes
    def __len__(self):
        return 10 ** 6

    def __iter__(self):
        a, b = torch.zeros(1 << 22), torch.ones(1 << 22)
        while True:
            for _ in range(20):
                a.copy_(b)
            yield a[:1].clone()


next(iter(BufferedIterator(1000, Batches())))
time.sleep(0.05)
print("stopped mid-epoch")
"""


def test_a_run_stopped_mid_epoch_exits_with_its_status():
    """fairseq's prefetch thread, left inside torch when a run stops mid-epoch, aborts Python's
    finalization (status 134 after the run has saved); the plugin's command lines stop it first."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")

    def run(side):
        return subprocess.run([sys.executable, "-c", PREFETCHING, side], capture_output=True, text=True, env=env,
                              cwd=REPO, timeout=120)

    for _ in range(3):
        proc = run("served")
        assert proc.returncode == 0 and "stopped mid-epoch" in proc.stdout, proc.stderr[-2000:]
    # negative control: without the plugin's command-line rows the same process aborts (at least
    # once in three: where the thread stands when Python finalizes is up to the scheduler)
    assert any(run("plain").returncode == -6 for _ in range(3))
