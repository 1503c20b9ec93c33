"""A checkpoint cannot run code: crafted checkpoints are refused by every loading path
(fairseq-generate, fairseq-interactive, the hub, --restore-file, averaging, the analysis
tool, warm start) before fairseq converts or evaluates anything, nothing is executed, and
the message names the field; damaged files are reported as such; normal checkpoints of
every family the plugin vouches for still load."""
import argparse
import ast
import json
import os
import re
import time

import numpy as np
import pytest
import torch
from fairseq import checkpoint_utils, options, tasks
from fairseq.models.transformer import TransformerModel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from conftest import cli
from ea_fairseq import checkpoint_safety as safety
from ea_fairseq_cli import average_checkpoints as avg
from trained_checkpoints import USER_DIR, family_checkpoints, run, train_command


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


def _lstm_family(state, marker):
    state["cfg"]["model"].arch = state["cfg"]["model"]._name = "lstm_luong_wmt_en_de"
    state["cfg"]["model"].encoder_layers = "1"  # clean: refused for its family alone


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
    "lstm-family": (_lstm_family, "cfg.model._name = 'lstm_luong_wmt_en_de'"),
    "pickled-callable": (_pickled_callable, "posix.system"),
    "stride-0-tensor": (_stride_zero_tensor, "['model']['encoder.layers.0.fc1.bias'] declares (1073741824,)"),
    "nested-repetition": (_nested_repetition, "would hold more than 100000 items"),
    "long-string-repetition": (_long_string_repetition, "would hold more than 100000 items"),
    "resolved-while-unpickled": (_resolved_while_unpickled, "reads the values of an omegaconf container"),
    "environment-read-while-unpickled": (_environment_read_while_unpickled,
                                         "reads the values of an omegaconf container"),
    "model-larger-than-its-weights": (_model_larger_than_its_weights,
                                      "cfg.model.encoder_ffn_embed_dim = 500000000: more than the largest"),
    "more-layers-than-its-weights": (_more_layers_than_its_weights,
                                     "cfg.model.encoder_layers = 1000000: more than the 2 encoder layers"),
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


@pytest.mark.parametrize("attack", ["bytes-in-fconv", "code-in-evaluated-field", "oc.create-section",
                                    "yaml-configuration"])
def test_the_payloads_are_live_without_the_guard(tmp_path, checkpoints, attack):
    """Negative control: unguarded, fairseq's loading runs the payload (so the tests below,
    which check that the file is never created, can fail)."""
    marker = tmp_path / "pwned"
    path = crafted(checkpoints["vanilla"], tmp_path / "c.pt", attack, marker)
    state = unguarded_load(path)
    with pytest.raises(Exception):  # eval ran; what it returned does not build a model
        checkpoint_utils.load_model_ensemble_and_task([str(path)], state=state)
    assert marker.exists()


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_every_attack_is_refused_by_the_hub_and_the_plugins_loader(tmp_path, checkpoints, tiny_data_bin, attack):
    """The hub (``from_pretrained``: fairseq's loader, as generate, interactive, --restore-file
    and the analysis tool use it) and the plugin's loader (averaging, warm start)."""
    marker = tmp_path / "pwned"
    path = crafted(checkpoints["vanilla"], tmp_path / "c.pt", attack, marker)
    shown = ATTACKS[attack][1]
    start = time.perf_counter()
    with pytest.raises(safety.UnsafeCheckpointError) as refusal:
        TransformerModel.from_pretrained(str(tmp_path), checkpoint_file="c.pt",
                                         data_name_or_path=tiny_data_bin, user_dir=USER_DIR)
    assert shown in str(refusal.value) and "Nothing in" in str(refusal.value)
    with pytest.raises(safety.UnsafeCheckpointError) as refusal:
        safety.load_checkpoint(str(path))
    assert shown in str(refusal.value)
    assert time.perf_counter() - start < 10  # (the 2^40 walk would take days)
    assert not marker.exists()


def test_fairseq_generate_refuses(tmp_path, tiny_data_bin, checkpoints):
    marker = tmp_path / "pwned"
    path = crafted(checkpoints["vanilla"], tmp_path / "c.pt", "bytes-in-fconv", marker)
    code, out = run([cli("fairseq-generate"), tiny_data_bin, "--user-dir", USER_DIR, "--path", path,
                     "--beam", "2", "--cpu", "--max-len-b", "5"], expect_ok=False, cwd=tmp_path)
    assert code != 0 and ATTACKS["bytes-in-fconv"][1] in out, out[-3000:]
    assert not marker.exists()


def test_fairseq_interactive_refuses(tmp_path, tiny_data_bin, checkpoints):
    marker = tmp_path / "pwned"
    path = crafted(checkpoints["vanilla"], tmp_path / "c.pt", "oc.create-section", marker)
    code, out = run([cli("fairseq-interactive"), tiny_data_bin, "--user-dir", USER_DIR, "--path", path,
                     "--task", "translation_lines", "--cpu", "--source-lang", "src", "--target-lang", "tgt"],
                    expect_ok=False, cwd=tmp_path, input="s1 s2\n")
    assert code != 0 and ATTACKS["oc.create-section"][1] in out, out[-3000:]
    assert not marker.exists()


def test_restore_file_refuses(tmp_path, tiny_data_bin, checkpoints):
    marker = tmp_path / "pwned"
    path = crafted(checkpoints["vanilla"], tmp_path / "c.pt", "code-in-optimizer-field", marker)
    code, out = run(train_command(tiny_data_bin, "transformer_lite", tmp_path / "save", "--restore-file", path),
                    expect_ok=False, cwd=tmp_path)
    assert code != 0 and ATTACKS["code-in-optimizer-field"][1] in out, out[-3000:]
    assert not marker.exists()


@pytest.mark.parametrize("attack", ["oc.create-section", "stride-0-tensor"])
def test_averaging_refuses_and_writes_nothing(tmp_path, checkpoints, attack, capsys):
    marker = tmp_path / "pwned"
    path = crafted(checkpoints["vanilla"], tmp_path / "c.pt", attack, marker)
    out = tmp_path / "avg.pt"
    for inputs in ([checkpoints["vanilla"], path], [path, checkpoints["vanilla"]]):
        assert avg.main(["--inputs", *map(str, inputs), "--output", str(out)]) == 1
        assert ATTACKS[attack][1] in capsys.readouterr().err
    assert not out.exists() and not marker.exists()


def test_analysis_refuses(tmp_path, tiny_data_bin, checkpoints):
    from ea_fairseq_cli.analysis import main

    marker = tmp_path / "pwned"
    path = crafted(checkpoints["vanilla"], tmp_path / "c.pt", "bytes-in-fconv", marker)
    with pytest.raises(SystemExit) as exit_:
        main(["dump", str(path), "--data", tiny_data_bin, "--out", str(tmp_path / "d.npz")])
    assert ATTACKS["bytes-in-fconv"][1] in str(exit_.value.code)
    assert not marker.exists()


def test_warm_start_refuses(tmp_path, checkpoints, capsys):
    from ea_fairseq_cli.warm_start import main

    marker = tmp_path / "pwned"
    path = crafted(checkpoints["vanilla"], tmp_path / "c.pt", "code-in-evaluated-field", marker)
    assert main([str(path), "--arch", "ea_transformer_lite", "--output", str(tmp_path / "w.pt")]) == 1
    assert ATTACKS["code-in-evaluated-field"][1] in capsys.readouterr().err
    assert not (tmp_path / "w.pt").exists() and not marker.exists()


@pytest.mark.parametrize("field,value,why", [
    ("adaptive_softmax_cutoff", "[1000, 'x']", "the text 'x' where fairseq declares int"),
    ("adaptive_softmax_cutoff", "[0] * 1000000000", "more than 100000 items"),
    ("adaptive_softmax_cutoff", "(lambda: 1)()", "function call"),
    ("adaptive_softmax_cutoff", "{1, 2}", "a set"),
    ("adam_betas", "().__class__", "attribute access"),
    ("adam_betas", "(0.9, 1e999)", "not a number or a list of numbers"),  # repr(inf) is not a literal
    ("encoder_xformers_att_config", "{**{}}", "unpacks a dict"),
    ("encoder_xformers_att_config", "{'a': 1}", "do not use xFormers attention"),
    ("left_pad_source", "__debug__", "the text '__debug__' where fairseq declares bool"),
    ("encoder_layers", "'\\x24{common.user_dir}'", "where fairseq declares int"),
    ("source_lang", "../../../tmp/fifo", "not a language code"),
])
def test_errors_say_what_is_wrong(field, value, why):
    """Each value is refused in the section where fairseq reads it."""
    section = {"adam_betas": "optimizer", "left_pad_source": "task", "source_lang": "task"}.get(field, "model")
    named = {"model": {"arch": "transformer"}, "optimizer": {"_name": "adam"}, "task": {"_name": "translation"}}
    state = {"cfg": {section: dict(named[section], **{field: value})}}
    state["cfg"]["model"] = argparse.Namespace(**state["cfg"].get("model", named["model"]))
    with pytest.raises(safety.UnsafeCheckpointError, match=why.replace("(", r"\(")):
        safety.sanitize(state, "x.pt")


def test_evaluated_fields_are_handed_over_as_typed_values_or_text_written_from_their_literal(
        tmp_path, checkpoints, tiny_data_bin, monkeypatch):
    """fairseq receives the parsed literal converted to the field's declared type (a list of
    ints), or ``repr()`` of it where fairseq declares text (``adam_betas``), never the
    checkpoint's string."""
    # the vanilla weights have no adaptive softmax, which the model check refuses
    # (test_checkpoint_inputs); here only the handed-over values are looked at
    from ea_fairseq.checkpoint_safety import hook
    monkeypatch.setattr(hook, "check_model_matches", lambda cfg, weights, source: None)
    state = trusted_state(checkpoints["vanilla"])
    state["cfg"]["model"].adaptive_softmax_cutoff = " [10] + [5 * 4]"
    state["cfg"]["optimizer"]["adam_betas"] = "(0.9, 0.98)"
    torch.save(state, tmp_path / "c.pt")
    loaded = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "c.pt"), arg_overrides={"data": tiny_data_bin})
    assert list(loaded["cfg"].model.adaptive_softmax_cutoff) == [10, 20]  # fairseq's declared List[int]
    assert loaded["cfg"].optimizer.adam_betas == "(0.9, 0.98)"
    model = tasks.setup_task(loaded["cfg"].task).build_model(loaded["cfg"].model)
    assert model.decoder.adaptive_softmax.cutoff[:2] == [10, 20]


@pytest.mark.parametrize("arch,task", [
    ("transformer_wmt_en_de_big", "translation"), ("transformer_iwslt_de_en", "translation"),
    ("transformer_lite", "translation_lines"), ("ran_d", "translation"), ("ea_transformer_base", "translation"),
])
@pytest.mark.parametrize("optimizer", ["adam", "adafactor"])
def test_fairseq_defaults_are_accepted(arch, task, optimizer):
    """Every option fairseq itself stores for the vouched families (betas, expressions,
    names) passes: no false refusal."""
    args = options.parse_args_and_arch(options.get_training_parser(), [
        "/nonexistent", "--arch", arch, "--task", task, "--optimizer", optimizer,
        "--lr-scheduler", "inverse_sqrt", "--user-dir", USER_DIR])
    safety.sanitize({"args": args}, "x.pt")
    safety.sanitize({"cfg": {"model": args, "optimizer": {"adam_betas": "(0.9, 0.98)"}}}, "x.pt")


@pytest.mark.parametrize("arch", ["fconv_iwslt_de_en", "fconv_self_att_wp", "lstm", "lightconv_iwslt_de_en",
                                  "wav2vec2", "transformer_lm", "bart_base", "transformer_align", "no_such_arch"])
@pytest.mark.parametrize("layout", ["arch", "_name", "legacy-args"])
def test_other_families_are_refused_naming_the_trust_switch(arch, layout):
    model = argparse.Namespace(**{"_name" if layout == "_name" else "arch": arch})
    state = {"args": model} if layout == "legacy-args" else {"cfg": {"model": model}}
    with pytest.raises(safety.UnsafeCheckpointError, match=f"= '{arch}'.*set {safety.TRUST_SWITCH}=1"):
        safety.sanitize(state, "x.pt")


def test_other_families_load_with_the_trust_switch_and_a_warning(tmp_path, checkpoints, monkeypatch, caplog):
    path = crafted(checkpoints["vanilla"], tmp_path / "c.pt", "lstm-family", tmp_path / "pwned")
    with pytest.raises(safety.UnsafeCheckpointError, match=f"set {safety.TRUST_SWITCH}=1"):
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    monkeypatch.setenv(safety.TRUST_SWITCH, "1")
    with caplog.at_level("WARNING", logger="ea_fairseq"):
        state = checkpoint_utils.load_checkpoint_to_cpu(str(path))
    assert state["cfg"].model.arch == "lstm_luong_wmt_en_de"
    assert any(f"{safety.TRUST_SWITCH}=1: loading" in r.getMessage() for r in caplog.records)
    for attack in ("pickled-callable", "stride-0-tensor"):  # what the switch leaves on
        path = crafted(checkpoints["vanilla"], tmp_path / "c.pt", attack, tmp_path / "pwned")
        with pytest.raises(safety.UnsafeCheckpointError, match=re.escape(ATTACKS[attack][1])):
            checkpoint_utils.load_checkpoint_to_cpu(str(path))


@pytest.mark.parametrize("value", ["0", "false", "no", "off", "False", "true", "yes", " 1"])
def test_only_the_documented_value_switches_the_checks_off(tmp_path, checkpoints, monkeypatch, value):
    marker = tmp_path / "pwned"
    path = crafted(checkpoints["vanilla"], tmp_path / "c.pt", "code-in-evaluated-field", marker)
    monkeypatch.setenv(safety.TRUST_SWITCH, value)
    with pytest.raises(safety.UnsafeCheckpointError, match="adaptive_softmax_cutoff"):
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    assert not marker.exists()


def test_compressed_records_are_refused(tmp_path, checkpoints):
    """torch.save stores records uncompressed, so none can expand beyond the file's size."""
    import zipfile

    with zipfile.ZipFile(checkpoints["vanilla"]) as src, \
            zipfile.ZipFile(tmp_path / "c.pt", "w", compression=zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    for load in (checkpoint_utils.load_checkpoint_to_cpu, safety.load_checkpoint):
        with pytest.raises(safety.UnsafeCheckpointError, match="compressed records"):
            load(str(tmp_path / "c.pt"))


@pytest.mark.parametrize("content,cause", [
    (b"", "the file is empty"),
    (b"step 1000 loss 3.2\n", "not a torch checkpoint"),
    ("truncated", "a zip archive without its central directory"),
    (b"\x80\x02" + os.urandom(64), "corrupt or not a checkpoint"),
], ids=["empty", "text", "truncated", "damaged-pickle"])
def test_damaged_files_are_reported_as_such_not_as_refusals(tmp_path, checkpoints, content, cause, capsys):
    if content == "truncated":
        data = checkpoints["vanilla"].read_bytes()
        content = data[: len(data) // 2]
    path = tmp_path / "checkpoint_last.pt"
    path.write_bytes(content)
    for load in (checkpoint_utils.load_checkpoint_to_cpu, safety.load_checkpoint):
        with pytest.raises(safety.CorruptCheckpointError, match="corrupt or not a checkpoint") as err:
            load(str(path))
        assert cause in str(err.value) and "refused" not in str(err.value)
    assert avg.main(["--inputs", str(path), str(checkpoints["vanilla"]), "--output", str(tmp_path / "a.pt")]) == 1
    assert "corrupt or not a checkpoint" in capsys.readouterr().err


def test_allow_list_is_scoped_to_checkpoint_loads(checkpoints):
    checkpoint_utils.load_checkpoint_to_cpu(str(checkpoints["vanilla"]))
    assert argparse.Namespace not in torch.serialization.get_safe_globals()
    with pytest.raises(Exception, match="(?i)weights.only"):  # plain torch.load is untouched
        torch.load(checkpoints["vanilla"], weights_only=True)


def test_fairseq_reads_the_file_once(tmp_path, checkpoints, monkeypatch):
    """fairseq's conversions run on the sanitized state: the file is not read a second time."""
    reads = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: reads.append(a) or real(*a, **k))
    checkpoint_utils.load_checkpoint_to_cpu(str(checkpoints["vanilla"]))
    assert len(reads) == 1


@pytest.mark.parametrize("family", ["vanilla", "ea", "pa", "ran"])
def test_normal_checkpoints_of_every_family_load(checkpoints, family, tiny_data_bin):
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoints[family])], arg_overrides={"data": tiny_data_bin})
    state = safety.load_checkpoint(str(checkpoints[family]))
    assert all(torch.equal(v, models[0].state_dict()[k]) for k, v in state["model"].items())


@pytest.mark.parametrize("layout", ["transformer-arch", "hydra-dict", "legacy-args", "omegaconf-container"])
def test_fairseq_transformer_checkpoints_load(tmp_path, checkpoints, tiny_data_bin, layout):
    """fairseq's own ``TransformerModel`` (``--arch transformer``; ``_name`` as hydra writes it;
    the legacy ``args`` layout; an omegaconf container) loads and computes the same."""
    state = trusted_state(checkpoints["vanilla"])
    model_cfg = state["cfg"]["model"]
    model_cfg.arch = model_cfg._name = "transformer"
    if layout == "hydra-dict":
        state["cfg"]["model"] = _model_fields(model_cfg)
    elif layout == "legacy-args":
        _legacy_args_layout(state, None)
        state["args"].adaptive_softmax_cutoff = None
    elif layout == "omegaconf-container":
        state["cfg"] = OmegaConf.create(dict(state["cfg"], model=_model_fields(model_cfg)),
                                        flags={"allow_objects": True})
    torch.save(state, tmp_path / "c.pt")
    (model,), _, _ = checkpoint_utils.load_model_ensemble_and_task(
        [str(tmp_path / "c.pt")], arg_overrides={"data": tiny_data_bin})
    (reference,), _, _ = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoints["vanilla"])], arg_overrides={"data": tiny_data_bin})
    assert type(model) is TransformerModel
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in model.state_dict().items())


# -- property: whatever the configuration holds, loading refuses it or yields plain data ----
LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6),
    st.sampled_from(["${oc.env:HOME}", "a${x}", "${oc.create:{a: 1}}", "[10, 20]", "(0.9, 0.98)", "True",
                     "[(512, 3)] * 2", "__import__('os').getcwd()", "{'a': 1}", "1e999"]),
    st.binary(max_size=3), st.binary(max_size=3).map(bytearray), st.just(torch.Size([2])), st.just(torch.zeros(1)))
FIELDS = ["adaptive_softmax_cutoff", "adam_betas", "left_pad_source", "xformers_att_config", "arch", "x", "y"]


def _containers(value, seen=None):
    seen = set() if seen is None else seen
    if id(value) in seen or not isinstance(value, (list, tuple, dict, argparse.Namespace)):
        return []
    seen.add(id(value))
    children = vars(value).values() if isinstance(value, argparse.Namespace) else (
        value.values() if isinstance(value, dict) else value)
    found = [value] if not isinstance(value, tuple) else []
    for child in list(children):
        found += _containers(child, seen)
    return found


@st.composite
def configurations(draw):
    """Random nesting of plain and other values; then references between the containers
    (shared, and cycles), and sometimes a chain of doubled references."""
    tree = draw(st.recursive(LEAVES, lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.lists(kids, max_size=3).map(tuple),
        st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=4)), kids, max_size=4),
        st.dictionaries(st.sampled_from(FIELDS), kids, max_size=3).map(lambda d: argparse.Namespace(**d))),
        max_leaves=25))
    holders = _containers(tree)
    for _ in range(draw(st.integers(0, 4)) if holders else 0):
        target, ref = draw(st.sampled_from(holders)), draw(st.sampled_from(holders + [tree]))
        if isinstance(target, list):
            target.append(ref)
        elif isinstance(target, dict):
            target[draw(st.sampled_from(FIELDS))] = ref
        else:
            setattr(target, draw(st.sampled_from(FIELDS)), ref)
    for _ in range(draw(st.integers(0, 1)) * draw(st.integers(1, 45))):
        tree = [tree, tree]
    return tree


def _is_plain(value, seen) -> bool:
    if type(value) in (type(None), bool, int, float):
        return True
    if type(value) is str:
        return "${" not in value
    if id(value) in seen:
        return True
    seen.add(id(value))
    if type(value) in (list, tuple):
        return all(_is_plain(v, seen) for v in value)
    if type(value) in (dict, argparse.Namespace):
        items = vars(value).items() if type(value) is argparse.Namespace else value.items()
        for key, v in items:
            if key in safety.EVALUATED_FIELDS and type(v) is str:
                ast.literal_eval(v)  # text written from a literal: a literal again
            if not (_is_plain(key, seen) and _is_plain(v, seen)):
                return False
        return True
    return False


@pytest.fixture(scope="module")
def base_state(checkpoints):
    state = trusted_state(checkpoints["vanilla"])  # its configuration and weights, no optimizer state
    return {key: state[key] for key in ("args", "cfg", "model", "optimizer_history", "extra_state")}


@settings(max_examples=40, deadline=2000, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(value=configurations(), field=st.sampled_from(FIELDS[:4] + ["encoder_layers_to_keep"]),
       section=st.sampled_from(["model", "task"]))
def test_any_configuration_is_refused_or_loads_as_plain_data(base_state, tmp_path_factory, value, field, section):
    state = dict(base_state, cfg=dict(base_state["cfg"]))
    if section == "model":
        state["cfg"]["model"] = argparse.Namespace(**vars(base_state["cfg"]["model"]))
        setattr(state["cfg"]["model"], field, value)
    else:
        state["cfg"]["task"] = dict(base_state["cfg"]["task"], **{field: value})
    path = tmp_path_factory.getbasetemp() / "property.pt"
    torch.save(state, path)
    start = time.perf_counter()
    try:
        loaded = safety.load_checkpoint(str(path))
    except safety.CheckpointError:
        pass
    else:
        assert _is_plain(loaded["cfg"], set())
        assert loaded["model"] is not None
    assert time.perf_counter() - start < 5  # a hang, not a slow machine


# -- the plugin's option errors on fairseq's command line ---------------------------------
@pytest.mark.parametrize("extra,message", [
    (["--arch", "ea_transformer_lite", "--ea-alpha", "-1"], "--ea-alpha must lie in [0, 1], got -1.0"),
    (["--arch", "ea_transformer_lite", "--drop-attention", "element", "--drop-attention-p", "1.5"],
     "--drop-attention-p must lie in [0, 1), got 1.5"),
    (["--arch", "ea_transformer_lite", "--checkpoint-activations"], "--checkpoint-activations recomputes"),
    (["--arch", "transformer_lite", "--drop-attention-p", "0.2"], "--drop-attention-p given without --drop-attention"),
])
def test_option_errors_are_raised_as_option_errors(extra, message):
    """Refused when the model is built, whatever brought the value (command line, hydra,
    a checkpoint): the class the command line prints as one line."""
    from conftest import build_model
    from ea_fairseq.errors import OptionError

    with pytest.raises(OptionError) as err:
        build_model(extra[1], *extra[2:])
    assert message in str(err.value)


def test_option_error_on_the_command_line_is_one_line(tmp_path, tiny_data_bin):
    code, out = run(train_command(tiny_data_bin, "ea_transformer_lite", tmp_path, "--ea-alpha", "-1"),
                    expect_ok=False, cwd=tmp_path)
    assert code == 1 and "Traceback" not in out, out[-3000:]
    assert out.strip().splitlines()[-1] == "fairseq-train: error: --ea-alpha must lie in [0, 1], got -1.0"


def test_ran_overlong_line_with_fairseqs_translation_task_names_the_options(tiny_data_bin, checkpoints):
    """fairseq's own refusal of the line, with a note naming the limit and the way on."""
    code, out = run([cli("fairseq-interactive"), tiny_data_bin, "--user-dir", USER_DIR, "--path", checkpoints["ran"],
                     "--cpu", "--source-lang", "src", "--target-lang", "tgt", "--beam", "2"],
                    expect_ok=False, input=" ".join(["s4"] * 30) + "\n")
    assert code != 0 and "Size of sample #0 is invalid" in out, out[-3000:]
    assert "at most --ran-max-positions 16 tokens" in out and "--task translation_lines" in out


# -- numpy values (fairseq's --eval-bleu keeps its BLEU counts in extra_state['metrics']) --------
NUMERIC_NUMPY = {"counts": np.array([7, 5, 3, 1]), "sys_len": np.int64(9), "bleu": np.float64(12.5),
                 "half": np.array([[1.5, -2.0]], dtype=np.float16), "flags": np.array([True, False]),
                 "column": np.asfortranarray(np.arange(6, dtype=np.uint8).reshape(2, 3)), "zero_d": np.array(2.0),
                 "small": np.float32(0.25), "complex": np.complex64(1 - 2j), "empty": np.zeros((0, 3), np.int32)}


class _Crafted:
    """Pickled as the call ``func(*args)`` (as a crafted file spells a value)."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _with_numpy(src, dst, where, value):
    state = trusted_state(src)
    if where == "extra_state":
        state["extra_state"]["crafted"] = value
    else:
        setattr(state["cfg"]["model"], where, value)
    torch.save(state, dst)
    return dst


def test_numeric_numpy_values_outside_the_configuration_load(tmp_path, checkpoints, tiny_data_bin):
    """Arrays and scalars of booleans and numbers in extra_state load with their values and
    dtypes, through fairseq's loader (generate, the hub), the plugin's and averaging; the
    allow-list is gone after the load (torch alone refuses the file: negative control)."""
    path = _with_numpy(checkpoints["vanilla"], tmp_path / "c.pt", "extra_state", dict(NUMERIC_NUMPY))
    with pytest.raises(Exception, match="(?i)weights.only"):
        torch.load(path, weights_only=True)
    for state in (checkpoint_utils.load_checkpoint_to_cpu(str(path)), safety.load_checkpoint(str(path))):
        loaded = state["extra_state"]["crafted"]
        assert loaded.keys() == NUMERIC_NUMPY.keys()
        for key, value in NUMERIC_NUMPY.items():
            assert type(loaded[key]) is type(value) and loaded[key].dtype == value.dtype, key
            assert loaded[key].shape == value.shape and np.array_equal(loaded[key], value), key
    assert not [entry for entry in torch.serialization.get_safe_globals()
                if isinstance(entry, tuple) and entry[1].startswith("numpy")]
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task([str(path)], arg_overrides={"data": tiny_data_bin})
    assert models
    copy = tmp_path / "d.pt"
    copy.write_bytes(path.read_bytes())
    assert avg.main(["--inputs", str(path), str(copy), "--output", str(tmp_path / "a.pt")]) == 0
    assert np.array_equal(trusted_state(tmp_path / "a.pt")["extra_state"]["crafted"]["counts"],
                          NUMERIC_NUMPY["counts"])


class _Stated(_Crafted):
    """Pickled as ``func(*args)`` filled in with ``state`` (``BUILD``)."""

    def __init__(self, state, func, *args):
        super().__init__(func, *args)
        self.state = state

    def __reduce__(self):
        return self.func, self.args, self.state


def _array(shape, dtype, data):
    """A numpy array as numpy pickles one, with the state given."""
    return _Stated((1, shape, dtype, False, data), np._core.multiarray._reconstruct, np.ndarray, (0,), b"b")


def _live(check):
    """Negative control: numpy's own unpickling makes the value ``check`` describes."""
    return lambda path: check(trusted_state(path)["extra_state"]["crafted"])


HUGE = 1 << 40
# attack -> (where, value, the refusal names, negative control or None)
NUMPY_ATTACKS = {
    "object-array": ("extra_state", np.array([payload("x"), 1], dtype=object), "a numpy dtype 'O8'",
                     _live(lambda v: v.dtype == object)),
    "string-array": ("extra_state", np.array(["en", "de"]), "a numpy dtype 'U2'", _live(lambda v: v.dtype.kind == "U")),
    "structured-array": ("extra_state", np.zeros(2, dtype=[("a", "i8"), ("b", "f4")]), "a numpy dtype 'V12'",
                         _live(lambda v: v.dtype.names == ("a", "b"))),
    "string-scalar": ("extra_state", np.str_("de"), "a numpy dtype 'U2'", _live(lambda v: v == "de")),
    "ndarray-made-directly": ("extra_state", _Crafted(np.ndarray, (HUGE,), np.dtype("i8"), b"\0" * 8, 0, (0,)),
                              "a numpy.ndarray made directly", _live(lambda v: v.size == HUGE)),
    "huge-reconstruct": ("extra_state", _Crafted(np._core.multiarray._reconstruct, np.ndarray, (HUGE,), b"b"),
                         f"_reconstruct(numpy.ndarray, ({HUGE},), ...)", None),
    "huge-declared-array": ("extra_state", _array((HUGE,), np.dtype("i8"), b"\0" * 8),
                            f"a numpy array declaring {8 * HUGE} bytes (shape ({HUGE},), int64) over 8 bytes", None),
    "array-without-data": ("extra_state", _Crafted(np._core.multiarray._reconstruct, np.ndarray, (0,), b"b"),
                           "['crafted']: a numpy array without its data", None),
    "too-many-elements": ("extra_state", np.zeros(safety.LIMIT_STATE_NODES + 1, dtype=bool),
                          f"['crafted']: a numpy array declaring {safety.LIMIT_STATE_NODES + 1} elements", None),
    "array-in-cfg": ("dropout", np.array(0.1), "cfg.model.dropout: a numpy.ndarray value", None),
    "scalar-in-cfg": ("encoder_layers", np.int64(2), "cfg.model.encoder_layers: a numpy.int64 value", None),
}


@pytest.mark.parametrize("attack", sorted(NUMPY_ATTACKS))
def test_numpy_values_other_than_numeric_ones_outside_the_configuration_are_refused(tmp_path, checkpoints, attack):
    """Refused in one line naming the value, nothing of it made; where numpy's own unpickling
    makes it (negative control), the loader does not."""
    where, value, shown, control = NUMPY_ATTACKS[attack]
    path = _with_numpy(checkpoints["vanilla"], tmp_path / "c.pt", where, value)
    for load in (checkpoint_utils.load_checkpoint_to_cpu, safety.load_checkpoint):
        with pytest.raises(safety.UnsafeCheckpointError) as refusal:
            load(str(path))
        assert shown in str(refusal.value) and "Nothing in" in str(refusal.value), str(refusal.value)
        assert "\n" not in str(refusal.value)
    if control is not None:
        assert control(path)


def test_a_stored_dtype_state_does_not_reach_the_array(tmp_path, checkpoints):
    """A dtype's state (``__setstate__``) may flag int64 items as object pointers: the array
    is made with a dtype made afresh from its type code, the flags left behind (numpy's own
    unpickling keeps them: negative control, on the dtype alone)."""
    import pickle

    flagged = _Stated((3, "<", None, None, None, -1, -1, 0x3F), np.dtype, "i8", False, True)
    assert pickle.loads(pickle.dumps(flagged)).hasobject
    data = np.array([3, 1], dtype=np.int64)
    path = _with_numpy(checkpoints["vanilla"], tmp_path / "c.pt", "extra_state", _array((2,), flagged, data.tobytes()))
    loaded = safety.load_checkpoint(str(path))["extra_state"]["crafted"]
    assert type(loaded) is np.ndarray and not loaded.dtype.hasobject and loaded.dtype.flags == data.dtype.flags
    assert np.array_equal(loaded, data)


def test_fairseq_generate_refuses_an_object_array_in_one_line(tmp_path, tiny_data_bin, checkpoints):
    path = _with_numpy(checkpoints["vanilla"], tmp_path / "c.pt", "extra_state", np.array([None], dtype=object))
    code, out = run([cli("fairseq-generate"), tiny_data_bin, "--user-dir", USER_DIR, "--path", path,
                     "--beam", "2", "--cpu", "--max-len-b", "5"], expect_ok=False, cwd=tmp_path)
    assert code != 0 and "Traceback" not in out, out[-3000:]
    assert "a numpy dtype 'O8'" in out.strip().splitlines()[-1]
