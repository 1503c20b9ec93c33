"""The model configuration ``fairseq-hydra-train`` (or a checkpoint it wrote) hands the plugin's
models, read the way ``fairseq-train``'s is.

The plugin's models are fairseq's legacy ``TransformerModel`` and its options are argparse
options (:func:`~ea_fairseq.models.attention_variants.add_args`), as fairseq's own
transformer's are. ``fairseq-train`` hands such a model an ``argparse.Namespace``; under hydra
fairseq applies the architecture's defaults to ``cfg.model``, an omegaconf ``DictConfig``, and
hands that over. fairseq's ``TransformerConfig.from_namespace`` keeps only the keys it knows of
a ``DictConfig``, so the plugin's options would be dropped there and every attention built
vanilla. :func:`namespace_from_config` turns the ``DictConfig`` into the ``Namespace``
``fairseq-train`` would have built, after checking it against the model's own option
definitions: a key no option of the model defines, or a value its option refuses, stops the
build with a message naming it (:class:`~ea_fairseq.errors.OptionError`, one line under
``fairseq-hydra-train``: :mod:`ea_fairseq.hydra_checks`).
"""
import argparse
from typing import Dict, Iterable, List

from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY, MODEL_REGISTRY
from fairseq.models.transformer import TransformerModel
from omegaconf import OmegaConf, open_dict

from ..errors import OptionError, did_you_mean


# the registered name of the plugin's model, which defines every option of the plugin (the
# module that defines it reads its configuration through this one)
PLUGIN_MODEL = "ea_transformer"


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message):
        raise OptionError(message)


def option_parser(model_class) -> argparse.ArgumentParser:
    """The model's command-line options, as ``fairseq-train --arch ...`` adds them (no
    defaults: an option not given stays unset)."""
    parser = _RaisingParser(argument_default=argparse.SUPPRESS, allow_abbrev=False, add_help=False)
    model_class.add_args(parser)
    return parser


def option_actions(model_class) -> Dict[str, argparse.Action]:
    return {action.dest: action for action in option_parser(model_class)._actions}


def plugin_option_names(model_class) -> List[str]:
    """The options ``model_class`` adds to those of fairseq's transformer, in their order."""
    fairseq_options = option_actions(TransformerModel)
    return [dest for dest in option_actions(model_class) if dest not in fairseq_options]


def arch_keys(arch: str) -> Iterable[str]:
    """The keys the architecture function of ``arch`` fills in."""
    args = argparse.Namespace()
    ARCH_CONFIG_REGISTRY[arch](args)
    return vars(args).keys()


def _tokens(action: argparse.Action, key: str, value) -> List[str]:
    """``value`` of ``key`` as the command-line tokens that give it."""
    option = action.option_strings[0]
    if action.nargs == 0:  # a flag: store_true / store_false
        if not isinstance(value, bool):
            raise OptionError(f"model.{key}: {value!r}: a flag takes true or false ({option})")
        return [option] if value == bool(action.const) else []
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):  # a list (nargs=2: a pair)
        values = value if isinstance(value, (list, tuple)) else [value]
        return [option, *map(str, values)]
    if isinstance(value, (list, tuple, dict)):
        raise OptionError(f"model.{key}: {value!r}: {option} takes one value")
    return [f"{option}={value}"]


def unknown_key_message(key: str, arch: str, known) -> str:
    if key in ("encoder", "decoder", "quant_noise"):
        return (f"model.{key}: fairseq's legacy transformer reads flat options ({key}_embed_dim, "
                f"{key}_layers, ...), not a nested {key} section")
    hint = did_you_mean(key, known, "model.")
    message = (f"model.{key}: not an option of --arch {arch}{hint}; `ea-fairseq-options {arch}` "
               "lists them (option --a-b is key model.a_b)")
    plugin_model = MODEL_REGISTRY[PLUGIN_MODEL]
    model_class = ARCH_MODEL_REGISTRY[arch]
    if model_class is not plugin_model and key in plugin_option_names(plugin_model):
        message += (f". {key} is an option of the plugin's own archs (ea_transformer_lite, "
                    f"pa_transformer_lite, ran_d, ...); --arch {arch} takes of the plugin's "
                    f"options only {', '.join(plugin_option_names(model_class))}")
    return message


def namespace_from_config(cfg, model_class) -> argparse.Namespace:
    """The ``Namespace`` ``fairseq-train`` would hand ``model_class`` for the hydra model
    configuration ``cfg`` (a ``DictConfig``, or the ``dict`` a checkpoint saves it as; its
    ``_name`` the architecture), its plugin options checked and
    typed by their own argparse definitions; ``OptionError`` (a ``ValueError``) names a key
    no option of the model defines or a value its option refuses."""
    values = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    arch = values.pop("_name", None) or values.get("arch")
    if arch not in ARCH_CONFIG_REGISTRY:
        raise OptionError(f"model._name: {arch!r} is not an architecture; `ea-fairseq-options` lists "
                          "the plugin's, `fairseq-train --help` all of them under --arch")
    actions = option_actions(model_class)
    known = set(actions) | set(arch_keys(arch)) | {"arch"}
    unknown = [key for key in values if key not in known]
    if unknown:
        raise OptionError(unknown_key_message(unknown[0], arch, known))
    plugin = set(plugin_option_names(model_class))
    tokens = []
    for key, value in values.items():
        if key in plugin and value is not None:
            tokens += _tokens(actions[key], key, value)
    try:
        parsed = option_parser(model_class).parse_args(tokens)
    except OptionError as error:
        raise OptionError(f"model configuration of --arch {arch}: {error} (the hydra key is the "
                         "option's name with '_' for '-')") from None
    args = argparse.Namespace(**values)
    vars(args).update(vars(parsed))
    args.arch = arch
    ARCH_CONFIG_REGISTRY[arch](args)
    return args


def record_options(cfg, args, names: Iterable[str]) -> None:
    """Write the values the model was built with for ``names`` into the hydra configuration
    ``cfg``, which is what a checkpoint saves: the checkpoint keeps them whatever the
    defaults of a later version."""
    with open_dict(cfg):
        for name in names:
            if hasattr(args, name):
                value = getattr(args, name)
                cfg[name] = list(value) if isinstance(value, tuple) else value
