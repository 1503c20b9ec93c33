"""The attention families the tests run: the one list (a new variant is one line here).

Each :class:`Family` is an architecture with its options, its mechanism switched on strongly
enough that a leak, a stale cache or a wrong gradient visibly moves the result. The other
test modules pick from :data:`FAMILIES` by these fields, never keep a list of their own:

* ``roles``: which attentions are the plugin's mechanism (``encoder``, ``decoder`` self-
  attention, ``cross`` = encoder-decoder attention); the others are fairseq's own;
* ``accelerator``: whether a CPU accelerator applies (``ea_fairseq.accelerators``: EA in
  float32/float64), so that the decoding properties also run with it switched off;
* ``dtypes``: the precisions the decoding properties run it in (``fp32``, ``fp16``/``bf16`` =
  the model cast as ``--fp16``/``--bf16`` do, ``autocast-fp16``/``autocast-bf16`` = a float32
  model under ``torch.autocast``); the float64 anchor runs every precision;
* ``decoding``: whether the decoding properties run it (not a mechanism that acts in
  training only, nor the same mechanism at another size);
* ``anchor``: whether its outputs and gradients are held to float64 (test_device.py);
* ``cli``: whether it goes through fairseq-train/-generate (test_cli_end_to_end.py; the
  others are saved and loaded in process there);
* ``variant_of``: the family whose modules it builds at other option values or sizes (its
  checkpoint round trip is that family's).
"""
from dataclasses import dataclass
from typing import Dict, FrozenSet, Tuple

ALL_PRECISIONS = ("fp32", "fp16", "bf16", "autocast-fp16", "autocast-bf16")
FP32 = ("fp32",)
BOTH = frozenset({"encoder", "decoder"})
EVERY_ROLE = frozenset({"encoder", "decoder", "cross"})


@dataclass(frozen=True)
class Family:
    arch: str
    options: Tuple[str, ...] = ()
    roles: FrozenSet[str] = frozenset()
    accelerator: bool = False
    dtypes: Tuple[str, ...] = ALL_PRECISIONS
    decoding: bool = True
    anchor: bool = True
    cli: bool = False
    variant_of: str = ""

    def args(self) -> Tuple[str, ...]:
        return (self.arch, *self.options)


EA_ON = ("--ea-alpha", "0.5", "--ea-beta", "0.5", "--ea-decoder-alpha", "0.3")
RAN_ON = ("--ran-max-positions", "32")
SYN_ON = ("--synthesizer-max-positions", "32")
LSRA = ("--lsra-weight-dropout", "0.0")
DROP_ELEMENT = ("--drop-attention", "element", "--drop-attention-p", "0.3", "--drop-attention-window", "3")

#: every family, one line each
FAMILIES: Dict[str, Family] = {
    # fairseq's own transformer: the control every mechanism is compared with
    "vanilla": Family("transformer_lite", dtypes=FP32, cli=True),
    "ea-lite": Family("ea_transformer_lite", EA_ON, EVERY_ROLE, accelerator=True, cli=True),
    # decoder alpha 0 (the papers' decoder): no layer reads A_logit, the fused step returns weights
    "ea-lite-paper-decoder": Family("ea_transformer_lite", EA_ON + ("--ea-decoder-alpha", "0"), EVERY_ROLE,
                                    accelerator=True, dtypes=FP32, anchor=False, variant_of="ea-lite"),
    "ea-lite-k1": Family("ea_transformer_lite", EA_ON + ("--ea-kernel-size", "1"), EVERY_ROLE,
                         accelerator=True, dtypes=FP32, anchor=False, variant_of="ea-lite"),
    "ea-lite-k5": Family("ea_transformer_lite", EA_ON + ("--ea-kernel-size", "5"), EVERY_ROLE,
                         accelerator=True, dtypes=FP32, anchor=False, variant_of="ea-lite"),
    "ea-base": Family("ea_transformer_base", EA_ON, EVERY_ROLE, accelerator=True, decoding=False,
                      variant_of="ea-lite"),
    "pa-lite": Family("pa_transformer_lite", ("--pa-alpha", "0.5"), frozenset({"encoder"})),
    "pa-lite-2-conv-layers": Family("pa_transformer_lite", ("--pa-alpha", "0.5", "--pa-conv-layers", "2"),
                                    frozenset({"encoder"}), dtypes=FP32, anchor=False, variant_of="pa-lite"),
    "ran-e-lite": Family("ran_e_lite", RAN_ON, frozenset({"encoder"})),
    "ran-d-lite": Family("ran_d_lite", RAN_ON, frozenset({"decoder"})),
    "ran-all-lite": Family("ran_all_lite", RAN_ON, BOTH, cli=True),
    "ran-d-lite+ea-encoder": Family("ran_d_lite", RAN_ON + ("--encoder-attention", "ea", "--ea-alpha", "0.5",
                                                            "--ea-beta", "0.5"), BOTH, accelerator=True,
                                    dtypes=FP32, anchor=False),
    "hcsa-lite": Family("hcsa_lite", (), BOTH),
    "syn-r-lite": Family("syn_r_lite", SYN_ON, BOTH),
    "realformer-lite": Family("realformer_lite", (), EVERY_ROLE),
    "resformer-lite": Family("resformer_lite", ("--value-residual-lambdas", "0.7", "0.6"), BOTH),
    "ea-lite+resformer": Family("ea_transformer_lite", ("--ea-decoder-alpha", "0.3", "--value-residual-on",
                                                        "encoder", "decoder"), EVERY_ROLE, accelerator=True,
                                dtypes=FP32, anchor=False),
    "ran-e-lite+realformer-decoder": Family("ran_e_lite", RAN_ON + ("--decoder-attention", "realformer",
                                                                    "--value-residual-on", "encoder"), BOTH,
                                            dtypes=FP32, anchor=False),
    "conv-transformer-lite": Family("conv_transformer_lite", LSRA, BOTH),
    "pa-conv-transformer-lite": Family("pa_conv_transformer_lite", ("--pa-alpha", "0.5") + LSRA, BOTH),
    "lsra+ea-lite+dropattention": Family("ea_transformer_lite", ("--lsra-on", "encoder", "decoder",
                                                                 "--ea-decoder-alpha", "0.3", "--drop-attention",
                                                                 "column") + LSRA, EVERY_ROLE, accelerator=True,
                                         dtypes=FP32, anchor=False),
    "lsra+realformer+resformer": Family("realformer_lite", ("--lsra-on", "encoder", "decoder", "--value-residual-on",
                                                            "encoder", "decoder") + LSRA, EVERY_ROLE,
                                        dtypes=FP32, anchor=False),
    # DropAttention acts in training only; alone it decodes in float32 (its eval-mode path)
    "dropattention-column": Family("transformer_lite", ("--drop-attention", "column", "--drop-attention-p", "0.3",
                                                        "--drop-attention-window", "2"), EVERY_ROLE, dtypes=FP32),
    "dropattention-element-decoder": Family("transformer_lite", ("--drop-attention", "element",
                                                                 "--drop-attention-on", "decoder"),
                                            frozenset({"decoder"}), dtypes=FP32, anchor=False),
    "ea-lite+dropattention-element": Family("ea_transformer_lite", EA_ON + DROP_ELEMENT, EVERY_ROLE,
                                            accelerator=True),
    "ran-all-lite+dropattention": Family("ran_all_lite", RAN_ON + DROP_ELEMENT, BOTH),
    "syn-r-lite+dropattention": Family("syn_r_lite", SYN_ON + DROP_ELEMENT, BOTH),
}

#: the float64 anchor (outputs and gradients) runs these in every precision
ANCHORED = [name for name, f in FAMILIES.items() if f.anchor]
#: the decoding properties run these
DECODING = [name for name, f in FAMILIES.items() if f.decoding]
#: families whose decoder self-attention is the plugin's
PLUGIN_DECODERS = [name for name, f in FAMILIES.items() if "decoder" in f.roles]
#: through fairseq-train and fairseq-generate
CLI = [name for name, f in FAMILIES.items() if f.cli]
#: saved and loaded through the hub in process: every family neither in CLI nor a variant
ROUND_TRIP = [name for name, f in FAMILIES.items() if not f.cli and not f.variant_of]
#: the tiny checkpoints trained by fairseq-train for the tests of trained models
#: (trained_checkpoints.py): name -> (arch, options), each arch at its paper defaults
TRAINED = {"vanilla": (FAMILIES["vanilla"].arch, []), "ea": (FAMILIES["ea-lite"].arch, []),
           "pa": (FAMILIES["pa-lite"].arch, []),
           "ran": (FAMILIES["ran-all-lite"].arch, ["--ran-max-positions", "16"])}  # the toy corpus fits
