"""The plugin's read and write primitives (:mod:`ea_fairseq.safety.confined`,
:mod:`ea_fairseq.safety.writers`) for the tools, which must not load the plugin (fairseq, torch:
``ea-fairseq-bleu`` and ``ea-fairseq-compare`` run where fairseq is not installed).

Importing anything under ``ea_fairseq`` runs its ``__init__``, which loads fairseq; these
modules import only the standard library and :mod:`ea_fairseq.errors`, so they are loaded here
from their files under their own names, without their package. A later ``import ea_fairseq``
finds them in ``sys.modules`` and shares them: one ``OptionError``, one ``ConfinedPathError``.
"""
import importlib.util
import os
import sys


def _module(name: str):
    if name not in sys.modules:
        if "ea_fairseq" in sys.modules:  # the plugin is loaded: its own import
            return importlib.import_module(name)
        top = importlib.util.find_spec("ea_fairseq").submodule_search_locations[0]
        path = os.path.join(top, *name.split(".")[1:])
        spec = (importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                       submodule_search_locations=[path])
                if os.path.isdir(path) else importlib.util.spec_from_file_location(name, path + ".py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, module)
    return sys.modules[name]


OptionError = _module("ea_fairseq.errors").OptionError
_module("ea_fairseq.safety")
_confined, _writers = _module("ea_fairseq.safety.confined"), _module("ea_fairseq.safety.writers")
ConfinedPathError, inside, open_inside = _confined.ConfinedPathError, _confined.inside, _confined.open_inside
replaced, write_bytes, write_text = _writers.replaced, _writers.write_bytes, _writers.write_text
