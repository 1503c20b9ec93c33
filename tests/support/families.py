"""The attention families the tests run: the one list (a new variant is one line here).

Each :class:`Family` is an architecture with its options, its mechanism switched on strongly
enough that a leak, a stale cache or a wrong gradient visibly moves the result. The other
test modules pick from :data:`FAMILIES` by these fields, never keep a list of their own:

* ``roles``: which attentions are the plugin's mechanism (``encoder``, ``decoder`` self-
  attention, ``cross`` = encoder-decoder attention); the others are fairseq's own;
* ``accelerator``: whether a CPU accelerator applies (``ea_ops.accelerators``: EA in
  float32/float64), so that the decoding properties also run with it switched off;
* ``dtypes``: the precisions the decoding properties run it in (``fp32``, ``fp16``/``bf16`` =
  the model cast as ``--fp16``/``--bf16`` do, ``autocast-fp16``/``autocast-bf16`` = a float32
  model under ``torch.autocast``); the float64 anchor runs every precision;
* ``decoding``: whether the decoding properties run it (not a mechanism that acts in
  training only, nor the same mechanism at another size);
* ``anchor``: whether its outputs and gradients are held to float64 (test_device.py);
* ``cli``: whether it goes through fairseq-train/-generate (test_cli_end_to_end.py; the
  others are saved and loaded in process there; fairseq's own transformer goes through
  those commands with the plugin loaded in test_quality_benchmark.py and the recipes' tests);
* ``variant_of``: the family whose modules it builds at other option values or sizes (its
  checkpoint round trip is that family's);
* ``twin``: fairseq's transformer of the same size: every parameter or buffer of the family
  that the twin does not have (by name) is the mechanism's;
* ``mechanism``: those parameters' names (``fnmatch`` patterns), each with the spread of the
  noise :meth:`Family.perturb` adds to it;
* ``held``: the mechanism's scalar settings (``module.attribute`` patterns) that are the
  configuration under test and keep their value (e.g. the papers' decoder α = 0);
* ``reduces``: the options with which the mechanism computes its twin's function from the
  twin's weights (EA with α = β = 0, a one-layer RealFormer, ...), ``None`` where none does;
* ``paper_archs``: the family's mechanism at the papers' other sizes (its parameter count is
  checked there too: :func:`added_parameters`);
* ``parameters``: for the variant the line introduces, ``(variant, formula)``: the parameters
  it adds to one role's ``layers`` attentions beyond fairseq's, written from its paper
  (:func:`added_parameters` sums them over a model's roles);
* ``fixture``: its checkpoint fixture's folder in ``tests/fixtures/checkpoints`` (the arch
  trained at make_fixtures.py's sizes and options; test_checkpoint_fixtures.py);
* ``maps``: the maps the analysis tool records beside each attention's weights
  (``ea_fairseq.analysis``; test_analysis.py captures the families that name them, ``None``
  the others).

The decoding properties run every family perturbed (:meth:`Family.perturb`): every
mechanism parameter and every scalar setting (:data:`SETTINGS`: α, β, λ, σ, DropAttention's
p and window) moved off its initial value, so that a mechanism which starts as the identity
(a layer norm's scale of 1, a bias of 0) or at a round value is exercised as trained;
test_families.py checks that nothing is left where it started.
"""
import fnmatch
import functools
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Iterable, Iterator, Optional, Tuple

import torch

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
    twin: str = "transformer_lite"
    mechanism: Tuple[Tuple[str, float], ...] = ()
    held: Tuple[str, ...] = ()
    reduces: Optional[Tuple[str, ...]] = None
    maps: Optional[FrozenSet[str]] = None
    paper_archs: Tuple[str, ...] = ()
    fixture: str = ""
    parameters: Tuple[Tuple[str, Callable], ...] = ()

    def args(self) -> Tuple[str, ...]:
        return (self.arch, *self.options)

    def mechanism_tensors(self, model, twin) -> Dict[str, torch.Tensor]:
        """name -> every parameter and buffer of ``model`` that ``twin`` (this family's
        fairseq twin, built at the same size) does not have."""
        own = dict(twin.named_parameters())
        own.update(twin.named_buffers())
        tensors = dict(model.named_parameters())
        tensors.update(model.named_buffers())
        return {name: t for name, t in tensors.items() if name not in own}

    def spread(self, name: str) -> float:
        """The noise :meth:`perturb` adds to mechanism tensor ``name``; a tensor no pattern
        of :attr:`mechanism` names is an error that says what to add."""
        for pattern, spread in self.mechanism:
            if fnmatch.fnmatchcase(name, pattern):
                return spread
        raise KeyError(f"{name} is a mechanism parameter (fairseq's {self.twin} has none of that name) that "
                       f"{self.arch} {' '.join(self.options)} does not list: add its pattern and spread to "
                       "the family's `mechanism` in tests/support/families.py")

    def perturbed(self, model, *sizes: str, seed: int = 3) -> None:
        """:meth:`perturb` ``model``, built with ``sizes`` (fairseq's options only), from ``seed``."""
        self.perturb(model, twin_model(self.twin, *sizes), torch.Generator().manual_seed(seed))

    def perturb(self, model, twin, generator: torch.Generator) -> None:
        """Move every mechanism parameter and buffer (floating: plus noise of its spread;
        integer, e.g. HC-SA's offsets: minus 1 to its spread) and every scalar setting not
        :attr:`held` (a value drawn in :data:`SETTINGS`' range, other than the current one)."""
        with torch.no_grad():
            for name, t in self.mechanism_tensors(model, twin).items():
                spread = self.spread(name)
                if t.is_floating_point():
                    noise = torch.randn(t.shape, generator=generator, dtype=torch.float64) * spread
                    t.add_(noise.to(device=t.device, dtype=t.dtype))
                else:
                    shift = torch.randint(1, int(spread) + 1, t.shape, generator=generator)
                    t.sub_(shift.to(device=t.device, dtype=t.dtype))
        for module, attribute, value in settings(model):
            if not any(fnmatch.fnmatchcase(f"{module_name(model, module)}.{attribute}", p) for p in self.held):
                setattr(module, attribute, draw(attribute, value, generator))


@functools.lru_cache(maxsize=None)
def twin_model(arch: str, *options: str):
    """fairseq's ``arch`` built with ``options`` (the sizes of the family it is the twin of)."""
    from ea_fairseq.models import building

    return building.build_model(arch, *options, seed=1, dictionary=building.placeholder_dictionary(44))[0]


def build_perturbed(name: str, *sizes: str, dictionary, seed: int = 3):
    """Family ``name`` built with ``sizes`` (fairseq's options only: its twin is built with
    them too) and perturbed (:meth:`Family.perturb`, from ``seed``); returns (model, args)."""
    from ea_fairseq.models import building

    family = FAMILIES[name]
    model, args = building.build_model(*family.args(), *sizes, seed=1, dictionary=dictionary)
    family.perturbed(model, *sizes, seed=seed)
    return model, args


def _no_projections(args) -> int:
    """A position-only attention has no query and key projections: -2(d² + d)."""
    return -2 * (args.encoder_embed_dim ** 2 + args.encoder_embed_dim)


def ea_parameters(args, role: str, layers: int) -> int:
    """EA: per attention a k x k heads-to-heads convolution, H²k² + H (EA Table 5)."""
    h = args.encoder_attention_heads
    return 0 if getattr(args, f"ea_no_{role}_conv", False) else layers * (h * h * args.ea_kernel_size ** 2 + h)


def pa_parameters(args, role: str, layers: int) -> int:
    """PA: per block after the first, ``--pa-conv-layers`` 3 x 3 convolutions (PA §3.3)."""
    h = args.encoder_attention_heads
    return (layers - 1) * args.pa_conv_layers * (h * h * 9 + h)


def ran_parameters(args, role: str, layers: int) -> int:
    """RAN: per stack A_1 (H·L²), the transition W, b (L² + L) and its layer norm (2L); per
    layer no query and key projections (RAN Eqs. 3-4)."""
    L = args.ran_max_positions
    return layers * _no_projections(args) + args.encoder_attention_heads * L * L + L * L + L + 2 * L


def hcsa_parameters(args, role: str, layers: int) -> int:
    """HC-SA: no query and key projections; the authors' value and output projections without
    biases (-2d) unless ``--hcsa-normalize visible``."""
    no_bias = 2 * args.encoder_embed_dim if args.hcsa_normalize == "none" else 0
    return layers * (_no_projections(args) - no_bias)


def synthesizer_parameters(args, role: str, layers: int) -> int:
    """Syn-R: no query and key projections; H x L x L logits per layer (Tay et al.)."""
    return layers * (_no_projections(args) + args.encoder_attention_heads * args.synthesizer_max_positions ** 2)


def no_parameters(args, role: str, layers: int) -> int:
    """A mechanism on fairseq's parameters alone (RealFormer's residual logits)."""
    return 0


def added_parameters(args, families: Optional[Iterable["Family"]] = None) -> Optional[int]:
    """The parameters a model built with ``args`` has beyond its fairseq twin: per attention
    role, the formula the family line that introduces its variant states (``parameters``),
    from the papers' descriptions. fairseq's attention (``vanilla``, ``dot_product``) and
    value residual learning add none; DropAttention adds none. ``None`` with LSRA (its kernels
    per layer: test_conv_transformer.py)."""
    if getattr(args, "lsra_on", None):
        return None
    formulas = {"vanilla": no_parameters, "dot_product": no_parameters}
    for family in FAMILIES.values() if families is None else families:
        formulas.update(family.parameters)
    layers = {"encoder": args.encoder_layers, "decoder": args.decoder_layers, "cross": args.decoder_layers}
    added = 0
    for role, n in layers.items():
        kind = getattr(args, f"{role}_attention", "vanilla")  # (fairseq's transformer: none)
        if kind not in formulas:
            raise KeyError(f"no family line states the parameters the {kind} attention adds: give the line that "
                           "introduces it parameters=((VARIANT, formula(args, role, layers)),) in tests/support/families.py")
        added += formulas[kind](args, role, n)
    return added


#: the plugin's scalar mechanism settings (attributes of its modules) -> the range
#: :meth:`Family.perturb` draws a new value from; a float setting not named here, nor in
#: :data:`NOT_SETTINGS`, is an error that says to add it
SETTINGS = {
    "alpha": (0.1, 0.9),  # EA's α (Eq. 4), PA's α
    "beta": (0.1, 0.9),  # EA's β
    "lambdas": (0.2, 1.0),  # ResFormer's λ1, λ2
    "std": (0.5, 2.0),  # HC-SA's σ
    "p": (0.05, 0.5),  # DropAttention's rate (training only)
    "window": (1, 4),  # DropAttention's window (an integer)
}
#: float attributes of the plugin's modules that are sizes, not mechanism settings
NOT_SETTINGS = frozenset({"scaling", "embed_scale"})


def is_plugin_module(module) -> bool:
    return type(module).__module__.startswith("ea_fairseq.")


def settings(model) -> Iterator[Tuple[torch.nn.Module, str, object]]:
    """(module, attribute, value) of every scalar mechanism setting of ``model``'s plugin
    modules: attributes named in :data:`SETTINGS`, and every other float (or tuple of floats)
    attribute outside :data:`NOT_SETTINGS` (which then has no range: :func:`draw` says so)."""
    for module in model.modules():
        if not is_plugin_module(module):
            continue
        for attribute, value in vars(module).items():
            if attribute.startswith("_") or attribute in NOT_SETTINGS or isinstance(value, bool):
                continue
            floats = isinstance(value, float) or (
                isinstance(value, tuple) and value and all(isinstance(v, float) for v in value))
            if attribute in SETTINGS and isinstance(value, (int, float, tuple)) or floats:
                yield module, attribute, value


def module_name(model, module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def draw(attribute: str, value, generator: torch.Generator):
    """A value of setting ``attribute`` in its range, other than ``value`` (each element of a tuple)."""
    if attribute not in SETTINGS:
        raise KeyError(f"{attribute}={value!r} is a scalar mechanism setting without a range: add it to "
                       "SETTINGS in tests/support/families.py (or to NOT_SETTINGS if it is a size)")
    low, high = SETTINGS[attribute]
    if isinstance(value, tuple):
        return tuple(draw(attribute, v, generator) for v in value)
    if isinstance(value, int):
        choices = [v for v in range(low, high + 1) if v != value]
        return choices[int(torch.randint(len(choices), (), generator=generator))]
    while True:
        new = low + (high - low) * float(torch.rand((), generator=generator, dtype=torch.float64))
        if new != value:
            return new


EA_ON = ("--ea-alpha", "0.5", "--ea-beta", "0.5", "--ea-decoder-alpha", "0.3")
RAN_ON = ("--ran-max-positions", "32")
SYN_ON = ("--synthesizer-max-positions", "32")
LSRA = ("--lsra-weight-dropout", "0.0")
DROP_ELEMENT = ("--drop-attention", "element", "--drop-attention-p", "0.3", "--drop-attention-window", "3")

# the mechanisms' parameters (beside fairseq's twin), as (name pattern, spread of the noise)
MAP_CONV = (("*attn.conv.weight", 0.5), ("*attn.conv.bias", 0.5))  # EA's (and PA's) 3x3 map convolutions
PA_CNN = (("*.predictor.*", 0.5),)  # PA's CNN (Eq. 4), in every encoder layer but the first
RAN_MATRICES = (("*.recurrent_matrices.*", 0.5),)  # A_1, W, b and the layer norm of Eq. 3
SYN_R = (("*self_attn.logits", 0.5),)
HCSA_OFFSETS = (("*self_attn.head_offsets", 2),)  # each head's centre moves back 1 or 2 positions
# LSRA: the light convolution branch, and the attention branch's projections (named anew)
LSRA_BRANCHES = (("*self_attn.conv.weight", 0.5), ("*self_attn.conv.linear_*", 0.05),
                 ("*self_attn.attention.*_proj.*", 0.05))
PA_MAPS = frozenset({"dot_product", "prediction", "logits"})
LSRA_MAP_CONV = (("*self_attn.attention.conv.*", 0.5),)  # EA's map convolution in LSRA's attention branch

#: every family, one line each
FAMILIES: Dict[str, Family] = {
    # fairseq's own transformer: the control every mechanism is compared with
    "vanilla": Family("transformer_lite", dtypes=FP32, maps=frozenset(), fixture="vanilla"),
    "ea-lite": Family("ea_transformer_lite", EA_ON, EVERY_ROLE, accelerator=True, cli=True, mechanism=MAP_CONV,
                      reduces=("--ea-alpha", "0", "--ea-beta", "0", "--ea-decoder-alpha", "0"),
                      maps=frozenset({"dot_product", "convolution", "logits"}), fixture="ea",
                      parameters=(("ea", ea_parameters),)),
    # decoder alpha 0 (the papers' decoder): no layer reads A_logit, the fused step returns weights
    "ea-lite-paper-decoder": Family("ea_transformer_lite", EA_ON + ("--ea-decoder-alpha", "0"), EVERY_ROLE,
                                    accelerator=True, dtypes=FP32, anchor=False, variant_of="ea-lite",
                                    mechanism=MAP_CONV, held=("decoder.*.alpha",)),
    "ea-lite-k1": Family("ea_transformer_lite", EA_ON + ("--ea-kernel-size", "1"), EVERY_ROLE,
                         accelerator=True, dtypes=FP32, anchor=False, variant_of="ea-lite", mechanism=MAP_CONV),
    "ea-lite-k5": Family("ea_transformer_lite", EA_ON + ("--ea-kernel-size", "5"), EVERY_ROLE,
                         accelerator=True, dtypes=FP32, anchor=False, variant_of="ea-lite", mechanism=MAP_CONV),
    "ea-base": Family("ea_transformer_base", EA_ON, EVERY_ROLE, accelerator=True, decoding=False,
                      variant_of="ea-lite", twin="transformer", mechanism=MAP_CONV),
    "pa-lite": Family("pa_transformer_lite", ("--pa-alpha", "0.5"), frozenset({"encoder"}), mechanism=PA_CNN,
                      reduces=("--pa-alpha", "0"), maps=PA_MAPS, fixture="pa", parameters=(("pa", pa_parameters),)),
    "pa-lite-2-conv-layers": Family("pa_transformer_lite", ("--pa-alpha", "0.5", "--pa-conv-layers", "2"),
                                    frozenset({"encoder"}), dtypes=FP32, anchor=False, variant_of="pa-lite",
                                    mechanism=PA_CNN),
    "ran-e-lite": Family("ran_e_lite", RAN_ON, frozenset({"encoder"}), mechanism=RAN_MATRICES,
                         paper_archs=("ran_e",), fixture="ran_e", parameters=(("ran", ran_parameters),)),
    "ran-d-lite": Family("ran_d_lite", RAN_ON, frozenset({"decoder"}), mechanism=RAN_MATRICES,
                         paper_archs=("ran_d",), fixture="ran_d"),
    "ran-all-lite": Family("ran_all_lite", RAN_ON, BOTH, cli=True, mechanism=RAN_MATRICES,
                           maps=frozenset({"recurrent"}), paper_archs=("ran_all",), fixture="ran_all"),
    "ran-d-lite+ea-encoder": Family("ran_d_lite", RAN_ON + ("--encoder-attention", "ea", "--ea-alpha", "0.5",
                                                            "--ea-beta", "0.5"), BOTH, accelerator=True,
                                    dtypes=FP32, anchor=False, mechanism=RAN_MATRICES + MAP_CONV),
    "hcsa-lite": Family("hcsa_lite", (), BOTH, mechanism=HCSA_OFFSETS, maps=frozenset({"gaussian"}),
                        paper_archs=("hcsa",), fixture="hcsa", parameters=(("hcsa", hcsa_parameters),)),
    "syn-r-lite": Family("syn_r_lite", SYN_ON, BOTH, mechanism=SYN_R, maps=frozenset({"synthesized"}),
                         paper_archs=("syn_r",), fixture="syn_r",
                         parameters=(("synthesizer", synthesizer_parameters),)),
    # one layer: no previous scores; λ = (0, 1): V_n alone
    "realformer-lite": Family("realformer_lite", (), EVERY_ROLE,
                              reduces=("--encoder-layers", "1", "--decoder-layers", "1"),
                              maps=frozenset({"dot_product", "logits"}), paper_archs=("realformer_base",),
                              fixture="realformer", parameters=(("realformer", no_parameters),)),
    "resformer-lite": Family("resformer_lite", ("--value-residual-lambdas", "0.7", "0.6"), BOTH,
                             reduces=("--value-residual-lambdas", "0", "1"), maps=frozenset(),
                             paper_archs=("resformer_base",), fixture="resformer"),
    "ea-lite+resformer": Family("ea_transformer_lite", ("--ea-decoder-alpha", "0.3", "--value-residual-on",
                                                        "encoder", "decoder"), EVERY_ROLE, accelerator=True,
                                dtypes=FP32, anchor=False, mechanism=MAP_CONV),
    "ran-e-lite+realformer-decoder": Family("ran_e_lite", RAN_ON + ("--decoder-attention", "realformer",
                                                                    "--value-residual-on", "encoder"), BOTH,
                                            dtypes=FP32, anchor=False, mechanism=RAN_MATRICES),
    "conv-transformer-lite": Family("conv_transformer_lite", LSRA, BOTH, mechanism=LSRA_BRANCHES, fixture="lsra"),
    "pa-conv-transformer-lite": Family("pa_conv_transformer_lite", ("--pa-alpha", "0.5") + LSRA, BOTH,
                                      mechanism=LSRA_BRANCHES + PA_CNN, maps=PA_MAPS),
    "lsra+ea-lite+dropattention": Family("ea_transformer_lite", ("--lsra-on", "encoder", "decoder",
                                                                 "--ea-decoder-alpha", "0.3", "--drop-attention",
                                                                 "column") + LSRA, EVERY_ROLE, accelerator=True,
                                         dtypes=FP32, anchor=False, mechanism=LSRA_BRANCHES + LSRA_MAP_CONV + MAP_CONV),
    "lsra+realformer+resformer": Family("realformer_lite", ("--lsra-on", "encoder", "decoder", "--value-residual-on",
                                                            "encoder", "decoder") + LSRA, EVERY_ROLE,
                                        dtypes=FP32, anchor=False, mechanism=LSRA_BRANCHES),
    # DropAttention acts in training only; alone it decodes in float32 (its eval-mode path)
    "dropattention-column": Family("transformer_lite", ("--drop-attention", "column", "--drop-attention-p", "0.3",
                                                        "--drop-attention-window", "2"), EVERY_ROLE, dtypes=FP32,
                                   reduces=(), fixture="drop_attention"),  # in eval mode
    "dropattention-element-decoder": Family("transformer_lite", ("--drop-attention", "element",
                                                                 "--drop-attention-on", "decoder"),
                                            frozenset({"decoder"}), dtypes=FP32, anchor=False),
    "ea-lite+dropattention-element": Family("ea_transformer_lite", EA_ON + DROP_ELEMENT, EVERY_ROLE,
                                            accelerator=True, mechanism=MAP_CONV),
    # one role each: Syn-R encoder, HC-SA decoder, EA cross-attention, DropAttention around them
    "syn-r-encoder+hcsa-decoder+dropattention": Family("ea_transformer_lite", SYN_ON + (
        "--encoder-attention", "synthesizer", "--decoder-attention", "hcsa") + DROP_ELEMENT, EVERY_ROLE,
        accelerator=True, dtypes=FP32, anchor=False, mechanism=SYN_R + HCSA_OFFSETS + MAP_CONV),
    "ran-all-lite+dropattention": Family("ran_all_lite", RAN_ON + DROP_ELEMENT, BOTH, mechanism=RAN_MATRICES),
    "syn-r-lite+dropattention": Family("syn_r_lite", SYN_ON + DROP_ELEMENT, BOTH, mechanism=SYN_R),
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
#: the checkpoint fixtures (test_checkpoint_fixtures.py), and those an accelerator computes
FIXTURES = [f.fixture for f in FAMILIES.values() if f.fixture]
ACCELERATED_FIXTURES = [f.fixture for f in FAMILIES.values() if f.fixture and f.accelerator]
#: the tiny checkpoints trained by fairseq-train for the tests of trained models
#: (trained_checkpoints.py): name -> (arch, options), each arch at its paper defaults
TRAINED = {"vanilla": (FAMILIES["vanilla"].arch, []), "ea": (FAMILIES["ea-lite"].arch, []),
           "pa": (FAMILIES["pa-lite"].arch, []),
           "ran": (FAMILIES["ran-all-lite"].arch, ["--ran-max-positions", "16"])}  # the toy corpus fits
