"""Crafted checkpoints for the loading guard's tests (tests/safety/test_safe_loading*.py): each attack
edits a trusted transformer_lite checkpoint (trained by fairseq-train, tests/support/trained_checkpoints.py)
so that fairseq's loading would run code, exhaust memory or build a model its weights do not
fit, and names the path the refusal must show."""
import argparse
import json
import os

import pytest
import torch
from fairseq import checkpoint_utils
from omegaconf import OmegaConf

from ea_fairseq.safety import no_code as safety
from support.trained_checkpoints import family_checkpoints


def payload(marker, tail="None") -> str:
    """A string fairseq's eval() runs, leaving a file behind."""
    return f"__import__('os').system('touch {marker}') or {tail}"


def trusted_state(path):
    return torch.load(path, weights_only=False)  # our own, trusted file


def _grammar(value) -> str:
    """``value`` in omegaconf's interpolation grammar (for ``${oc.create:...}``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_grammar, value)) + "]"
    return json.dumps(str(value))


# attack name -> (edit of a trusted transformer_lite checkpoint's state, the path the refusal names)
def _bytes_in_fconv(state, marker):
    state["cfg"]["model"].arch = state["cfg"]["model"]._name = "fconv_iwslt_de_en"
    state["cfg"]["model"].encoder_layers = payload(marker, "[(32, 3)]").encode()


def _bytes_in_transformer(state, marker):
    state["cfg"]["model"].adaptive_softmax_cutoff = bytearray(payload(marker).encode())


def _code_in_evaluated_field(state, marker):
    state["cfg"]["model"].adaptive_softmax_cutoff = payload(marker)


def _code_in_optimizer(state, marker):
    state["cfg"]["optimizer"]["adam_betas"] = payload(marker, "(0.9, 0.98)")


def _model_fields(namespace) -> dict:
    """The fields of a checkpoint's model Namespace that a hydra model config holds."""
    from fairseq.models import ARCH_MODEL_REGISTRY
    from ea_fairseq.models.hydra_config import arch_keys, option_actions

    known = set(option_actions(ARCH_MODEL_REGISTRY[namespace.arch])) | set(arch_keys(namespace.arch)) | {"_name"}
    return {key: value for key, value in vars(namespace).items() if key in known}


def _oc_create_section(state, marker):
    fields = dict(_model_fields(state["cfg"]["model"]), adaptive_softmax_cutoff=payload(marker))
    state["cfg"]["model"] = "${oc.create:{" + ", ".join(f"{k}: {_grammar(v)}" for k, v in fields.items()) + "}}"


def _oc_env(state, marker):
    state["cfg"]["task"]["target_lang"] = "${oc.env:HOME}"


def _interpolation_in_omegaconf_container(state, marker):
    cfg = OmegaConf.create({"model": dict(vars(state["cfg"]["model"])), "task": {"data": "x"}},
                           flags={"allow_objects": True})
    cfg.model.adaptive_softmax_cutoff = "${oc.create:[" + json.dumps(payload(marker)) + "]}"
    state["cfg"] = cfg


def _shared_reference_bomb(state, marker):
    level = ["x"]
    for _ in range(40):  # 2^40 paths through 80 list objects
        level = [level, level]
    state["cfg"]["model"].encoder_layers_to_keep = level


def _cycle(state, marker):
    loop = []
    loop.append(loop)
    state["cfg"]["common"]["tensorboard_logdir"] = loop


def _legacy_args_layout(state, marker):
    flat = argparse.Namespace(**vars(state["cfg"]["model"]))
    flat.task, flat.data = "translation", state["cfg"]["task"]["data"]
    flat.adaptive_softmax_cutoff = payload(marker)
    state["args"], state["cfg"] = flat, None


def _yaml_configuration(state, marker):
    model = dict(vars(state["cfg"]["model"]), arch="fconv_iwslt_de_en", _name="fconv_iwslt_de_en",
                 encoder_layers=payload(marker, "[(32, 3)]"))
    state["cfg"] = json.dumps({"model": model, "task": state["cfg"]["task"]})  # OmegaConf.create parses it


def _pickled_callable(state, marker):
    state["hook"] = os.system


def _stride_zero_tensor(state, marker):
    state["model"]["encoder.layers.0.fc1.bias"] = torch.zeros(1).expand(1 << 30)


def _nested_repetition(state, marker):
    state["cfg"]["model"].encoder_xformers_att_config = "{'a': [[0] * 100000] * 100000}"


def _long_string_repetition(state, marker):
    state["cfg"]["model"].encoder_xformers_att_config = "{'a': ['x' * 100000] * 100000}"


class _ReadValues:
    """Pickled as a call of the allow-listed ``dict`` on an omegaconf container: unpickling
    it would read (and resolve) the container's values inside ``torch.load``."""

    def __init__(self, container):
        self.container = container

    def __reduce__(self):
        return dict, (self.container,)


def _resolved_while_unpickled(state, marker):
    chain = {"a0": "x" * 16}
    for i in range(1, 40):  # 16 * 2^39 characters once resolved
        chain[f"a{i}"] = "${a%d}${a%d}" % (i - 1, i - 1)
    state["cfg"]["common_eval"] = _ReadValues(OmegaConf.create(chain))


def _environment_read_while_unpickled(state, marker):
    task = dict(state["cfg"]["task"], target_lang="${oc.env:HOME}")
    state["cfg"]["task"] = _ReadValues(OmegaConf.create({k: v for k, v in task.items() if v is not None}))


def _model_larger_than_its_weights(state, marker):
    state["cfg"]["model"].encoder_ffn_embed_dim = 500_000_000  # 32 GB for fc1 alone


def _more_layers_than_its_weights(state, marker):
    state["cfg"]["model"].encoder_layers = 1_000_000


BUDGET = "the model its configuration describes would create more than"  # (safety/budget.py)
ATTACKS = {
    "bytes-in-fconv": (_bytes_in_fconv, "cfg.model.encoder_layers: a bytes value"),
    "bytearray-in-transformer": (_bytes_in_transformer, "cfg.model.adaptive_softmax_cutoff: a bytearray value"),
    "code-in-evaluated-field": (_code_in_evaluated_field, "cfg.model.adaptive_softmax_cutoff = "),
    "code-in-optimizer-field": (_code_in_optimizer, "cfg.optimizer.adam_betas = "),
    "oc.create-section": (_oc_create_section, "cfg.model: '${oc.create:"),
    "oc.env": (_oc_env, "cfg.task.target_lang: '${oc.env:HOME}'"),
    "interpolation-in-omegaconf": (_interpolation_in_omegaconf_container, "cfg.model.adaptive_softmax_cutoff: '${"),
    "shared-reference-bomb": (_shared_reference_bomb, "cfg.model.encoder_layers_to_keep"),
    "cycle": (_cycle, "cfg.common.tensorboard_logdir[0]: it contains itself"),
    "legacy-args": (_legacy_args_layout, "args.adaptive_softmax_cutoff = "),
    "yaml-configuration": (_yaml_configuration, "cfg = '{"),
    "pickled-callable": (_pickled_callable, "posix.system"),
    "stride-0-tensor": (_stride_zero_tensor, "['model']['encoder.layers.0.fc1.bias'] declares (1073741824,)"),
    "nested-repetition": (_nested_repetition, "would hold more than 100000 items"),
    "long-string-repetition": (_long_string_repetition, "would hold more than 100000 items"),
    "resolved-while-unpickled": (_resolved_while_unpickled, "reads the values of an omegaconf container"),
    "environment-read-while-unpickled": (_environment_read_while_unpickled,
                                         "reads the values of an omegaconf container"),
    "model-larger-than-its-weights": (_model_larger_than_its_weights, BUDGET),
    "more-layers-than-its-weights": (_more_layers_than_its_weights, BUDGET),
}


def crafted(src, dst, attack, marker):
    state = trusted_state(src)
    ATTACKS[attack][0](state, marker)
    torch.save(state, dst)
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_data_bin):
    return family_checkpoints(tmp_path_factory, tiny_data_bin)


def unguarded_load(path):
    """fairseq's own loader, without this plugin's checks (the allow-list still scoped)."""
    with safety.checkpoint_globals_allowed():
        return checkpoint_utils.load_checkpoint_to_cpu.__wrapped__(str(path))
