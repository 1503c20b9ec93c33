"""The configuration fields fairseq evaluates (:data:`EVALUATED_FIELDS`: ``eval()``,
``ast.literal_eval()``, ``utils.eval_str_list()``), and the literal parser that reads them.

fairseq only ever evaluates text written here: a string in such a field is parsed as a literal
(:func:`_literal`: literals, ``+`` and ``*`` between them, sizes bounded), checked against the
field's form, and replaced by ``repr()`` of the parsed value. That text is checked as fairseq
receives it: it may hold no ``${`` (an escape such as ``\\x24{`` in the checkpoint's string
becomes ``${`` once parsed, which omegaconf would resolve before fairseq evaluates the text).
"""
import argparse
import ast
import functools
import math
import typing
from typing import Any, Dict, Tuple

from .reading import UnsafeCheckpointError, _shown

LIMIT_CHARS = 10_000  # an evaluated string longer than this is refused unread
LIMIT_ITEMS = 100_000  # ... or one whose value would hold more items than this
_SCALARS = (type(None), bool, int, float, str)


class _Refused(Exception):
    """A value that is not what its field may hold (the reason: the exception's text)."""


def _is_int(x) -> bool:
    return type(x) is int


def _is_number(x) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


class Form(typing.NamedTuple):
    """What fairseq does with a field, and which literal values are well-formed there."""

    use: str  # what fairseq does with it (for the error message)
    expected: str  # the form, in words
    check: typing.Callable[[Any], bool]
    example: str


def _ints(x) -> bool:
    return _is_int(x) or (type(x) in (list, tuple) and all(_is_int(i) for i in x))


def _numbers(x) -> bool:
    return _is_number(x) or (type(x) in (list, tuple) and all(_is_number(i) for i in x))


def _literal_data(x) -> bool:
    if type(x) in (list, tuple):
        return all(_literal_data(i) for i in x)
    if type(x) is dict:
        return all(_literal_data(k) and _literal_data(v) for k, v in x.items())
    return type(x) in _SCALARS and (type(x) is not float or math.isfinite(x))


_INTS = dict(expected="an integer or a list of integers", check=_ints, example="'[10000, 50000]'")
_NUMBERS = dict(expected="a number or a list of numbers", check=_numbers, example="'(0.9, 0.98)'")
_DICT = dict(expected="a dict literal", check=lambda x: type(x) is dict and _literal_data(x), example="'{}'")
_BOOL = dict(expected="True or False", check=lambda x: type(x) is bool, example="'True'")
_DATA = dict(expected="a Python literal", check=_literal_data, example="'[1, 2]'")

# field name -> Form: every configuration field that fairseq 0.12 passes to eval() (or
# ast.literal_eval()) when it builds a model of the families below, their optimizers, tasks
# and criterions, wherever the name occurs in ``args`` or ``cfg``
EVALUATED_FIELDS: Dict[str, Form] = {}
for _names, _use, _kind in (
    (("adaptive_softmax_cutoff", "adaptive_input_cutoff"), "utils.eval_str_list() when the decoder is built", _INTS),
    (("pipeline_balance", "pipeline_devices", "pipeline_encoder_balance", "pipeline_encoder_devices",
      "pipeline_decoder_balance", "pipeline_decoder_devices"),
     "utils.eval_str_list() when pipeline parallelism is set up", _INTS),
    (("xformers_att_config", "encoder_xformers_att_config", "decoder_xformers_att_config"),
     "utils.eval_str_dict() in MultiheadAttention", _DICT),
    (("optimizer_overrides",), "ast.literal_eval() when training resumes", _DICT),
    (("model_overrides",), "eval() in fairseq-generate, fairseq-interactive and fairseq-validate", _DICT),
    (("adam_betas", "adamax_betas", "lamb_betas", "adafactor_eps"), "eval() when the optimizer is built", _NUMBERS),
    (("left_pad_source", "left_pad_target"), "utils.eval_bool() in the multilingual tasks", _BOOL),
    (("wer_args",), "eval() in the CTC criterion", _DATA),
    (("encoder_layers", "decoder_layers", "encoder_attention", "decoder_attention", "self_attention",
      "project_input", "gated_attention", "downsample", "pretrained"),
     "eval() when a convolutional (fconv) model is built (utils.eval_bool(), an LSTM's decoder_attention)", _DATA),
    (("feature_encoder_spec", "character_filters"), "eval() when the model's data or embedder is built", _DATA),
):
    for _name in _names:
        EVALUATED_FIELDS[_name] = Form(use=_use, **_kind)
del _names, _use, _kind, _name


def _literal(text: str) -> Any:
    """The value of ``text`` if it is a literal expression, else :class:`_Refused`.

    Literals as ``ast.literal_eval`` reads them, plus ``+`` and ``*`` between them, as in
    fairseq's own defaults (``"[(512, 3)] * 20"``), sizes bounded.
    """
    if len(text) > LIMIT_CHARS:
        raise _Refused(f"it is longer than {LIMIT_CHARS} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise _Refused("it is not a Python literal")
    for node in ast.walk(tree):  # name the most telling construct first
        if isinstance(node, (ast.Call, ast.Attribute, ast.Lambda)):
            raise _Refused(f"it contains {_SYNTAX[type(node)]}: code, not a literal")
    try:
        return _value(tree.body)
    except RecursionError:
        raise _Refused("it is nested too deeply")


_SYNTAX = {ast.Call: "a function call", ast.Attribute: "an attribute access", ast.Name: "a name",
           ast.Lambda: "a lambda", ast.Subscript: "a subscript", ast.BoolOp: "'and'/'or'",
           ast.Compare: "a comparison", ast.JoinedStr: "an f-string", ast.Set: "a set"}


LIMIT_INT = 10 ** 18  # an integer an evaluated field may hold


def _value(node) -> Any:
    return _weighed(node)[0]


def _weighed(node) -> Tuple[Any, int]:
    """``(value, size)`` of a literal node; ``size`` counts every item the value holds,
    nested ones included and a string's characters, so ``[[0] * 10**5] * 10**5`` is refused
    before it is built."""
    if isinstance(node, ast.Constant) and type(node.value) in _SCALARS:
        value = node.value
        return value, _bounded(len(value) if type(value) is str else 1, value)
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_weighed(e) for e in node.elts]
        values = [v for v, _ in items]
        return (values if isinstance(node, ast.List) else tuple(values)), _bounded(1 + sum(w for _, w in items))
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise _Refused("it unpacks a dict with '**' (code, not a literal)")
        keys = [_weighed(k) for k in node.keys]
        if any(type(k) not in _SCALARS for k, _ in keys):
            raise _Refused("it has a key that is not a plain value")
        values = [_weighed(v) for v in node.values]
        return (dict(zip((k for k, _ in keys), (v for v, _ in values))),
                _bounded(1 + sum(w for _, w in keys) + sum(w for _, w in values)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        operand, weight = _weighed(node.operand)
        if type(operand) in (int, float):
            return (-operand if isinstance(node.op, ast.USub) else operand), weight
        raise _Refused("it puts a sign before something that is not a number")
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        (left, wl), (right, wr) = _weighed(node.left), _weighed(node.right)
        if isinstance(node.op, ast.Mult) and (_is_int(left) != _is_int(right)):
            count, weight = (left, wr) if _is_int(left) else (right, wl)
            size = _bounded(max(count, 0) * weight)  # the sequence's size, repeated
        else:
            size = _bounded(wl + wr)
        try:
            value = left + right if isinstance(node.op, ast.Add) else left * right
        except TypeError:
            raise _Refused("it applies '+' or '*' to values that do not combine")
        return value, _bounded(size, value)
    what = _SYNTAX.get(type(node), f"'{type(node).__name__}' syntax")
    raise _Refused(f"it contains {what}: code, not a literal")


def _bounded(size: int, value: Any = None) -> int:
    if size > LIMIT_ITEMS:
        raise _Refused(f"its value would hold more than {LIMIT_ITEMS} items")
    if _is_int(value) and abs(value) > LIMIT_INT:
        raise _Refused(f"it holds an integer beyond {LIMIT_INT}")
    return size


def _evaluated_value(name: str, value: Any) -> Any:
    """What fairseq gets in evaluated field ``name``: a string becomes ``repr()`` of the
    literal it holds (checked against the field's form); other values must have the form."""
    form = EVALUATED_FIELDS[name]
    if value is None:
        return None
    if type(value) is str:
        parsed = _literal(value)
        if not form.check(parsed):
            raise _Refused(f"it is not {form.expected}")
        text = repr(parsed)
    else:
        if not form.check(value):
            raise _Refused(f"it is not {form.expected}")
        text = repr(value)
    if "${" in text:
        raise _Refused("once its escapes are read it holds '${', an omegaconf interpolation that would be "
                       "resolved (and could close a quote) before fairseq evaluates the text")
    return text if type(value) is str else value


def _rewrite_evaluated(node, path: str, source: str) -> None:
    """Replace, in place, every evaluated field of the plain configuration ``node``."""
    if type(node) is argparse.Namespace:
        items, set_ = list(vars(node).items()), functools.partial(setattr, node)
    elif type(node) is dict:
        items, set_ = list(node.items()), node.__setitem__
    elif type(node) in (list, tuple):
        for i, item in enumerate(node):
            _rewrite_evaluated(item, f"{path}[{i}]", source)
        return
    else:
        return
    for name, value in items:
        here = f"{path}.{name}"
        if name in EVALUATED_FIELDS:
            try:
                set_(name, _evaluated_value(name, value))
            except _Refused as why:
                form = EVALUATED_FIELDS[name]
                raise UnsafeCheckpointError(
                    f"{source}: refused: {here} = {_shown(value)}: {why}. fairseq passes this field to "
                    f"{form.use}, so a checkpoint may only hold {form.expected} there (e.g. {form.example}). "
                    "Nothing in the checkpoint was run; if you wrote this checkpoint yourself, correct "
                    "that field (or re-save from a trusted run).") from None
        else:
            _rewrite_evaluated(value, here, source)

