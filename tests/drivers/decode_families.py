"""Decode with each of several checkpoints through fairseq-generate, fairseq-interactive and the
hub, in one process (one import of torch and fairseq instead of one per run); prints one JSON
object: family -> {"generate": H-/P- lines, "interactive": H-/P- lines, "hub": translations},
or, for a run that raised, the exception's type and first line in place of its lines; and
``plugin_loaded``: ["ea_fairseq"] where the plugin was imported, [] where it was not.

Argument: a JSON object: ``data`` (a data-bin), ``checkpoints`` (family -> checkpoint file),
``lines`` (interactive's and the hub's input), ``user_dir`` (the plugin's folder, or null: plain
fairseq, which this driver never imports the plugin into) and ``control`` (true: first load
every checkpoint with fairseq's loader as it is, recording what it raises, and only then set
TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 for the decoding runs)."""
import contextlib
import io
import json
import os
import re
import sys

from fairseq import checkpoint_utils, distributed_utils, hub_utils, options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq_cli import generate, interactive

DECODE = ["--beam", "2", "--max-len-a", "0", "--max-len-b", "5", "--cpu", "--source-lang", "src",
          "--target-lang", "tgt", "--num-workers", "0"]
LINES = re.compile(r"^[HP]-\d+\t.*$", flags=re.M)


def failure(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def tool(main, parser, argv, stdin=""):
    """A fairseq command line's ``main`` run here: its H-/P- lines, in the order printed."""
    args = options.parse_args_and_arch(parser, argv)
    out, before = io.StringIO(), sys.stdin
    sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out):
            distributed_utils.call_main(convert_namespace_to_omegaconf(args), main)
    finally:
        sys.stdin = before
    return LINES.findall(out.getvalue())


def hub(family, checkpoint, data, user_dir, lines):
    """The translations of the hub: fairseq's TransformerModel.from_pretrained for the transformer,
    hub_utils.from_pretrained and GeneratorHubInterface (what every from_pretrained builds) for the others.
    The beam is set when the model is loaded too: fconv's decoder is prepared for the configured beam
    (BeamableMM), and fails with another one in ``translate``."""
    folder, name = os.path.split(checkpoint)
    extra = {"beam": 2, **({"user_dir": user_dir} if user_dir else {})}
    if family == "transformer":
        from fairseq.models.transformer import TransformerModel

        model = TransformerModel.from_pretrained(folder, checkpoint_file=name, data_name_or_path=data, **extra)
    else:
        loaded = hub_utils.from_pretrained(folder, checkpoint_file=name, data_name_or_path=data, **extra)
        model = hub_utils.GeneratorHubInterface(loaded["args"], loaded["task"], loaded["models"])
    return model.translate(lines, beam=2, max_len_a=0, max_len_b=5)


def run(family, checkpoint, spec):
    data, user_dir, lines = spec["data"], spec["user_dir"], spec["lines"]
    plugin = ["--user-dir", user_dir] if user_dir else []
    results = {}
    for what, call in (
            ("generate", lambda: tool(generate.main, options.get_generation_parser(), [
                data, *plugin, "--path", checkpoint, *DECODE, "--gen-subset", "test",
                "--required-batch-size-multiple", "1", "--batch-size", "8"])),
            ("interactive", lambda: tool(interactive.main, options.get_interactive_generation_parser(), [
                data, *plugin, "--path", checkpoint, *DECODE, "--input", "-", "--buffer-size", "2",
                "--batch-size", "2"], stdin="".join(line + "\n" for line in lines))),
            ("hub", lambda: hub(family, checkpoint, data, user_dir, lines))):
        try:
            results[what] = call()
        except Exception as error:  # noqa: BLE001  (reported, the test says what it expected)
            results[what] = failure(error)
    return results


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    report = {}
    if spec.get("control"):
        os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
        report["control"] = {}
        for family, checkpoint in spec["checkpoints"].items():
            try:
                checkpoint_utils.load_model_ensemble_and_task([checkpoint], arg_overrides={"data": spec["data"]})
                report["control"][family] = "loaded"
            except Exception as error:  # noqa: BLE001
                report["control"][family] = f"{type(error).__name__}: {error}"[:4000]
        os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    for family, checkpoint in spec["checkpoints"].items():
        report[family] = run(family, checkpoint, spec)
    report["plugin_loaded"] = sorted({name.split(".")[0] for name in sys.modules if name.split(".")[0] == "ea_fairseq"})
    print("\n" + json.dumps(report))
