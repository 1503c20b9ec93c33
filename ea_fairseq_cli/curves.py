"""Learning curves of fairseq-train runs, read from their logs.

fairseq-train logs its statistics in one of two forms (``--log-format``):

* ``json``: ``... | INFO | train_inner | {"epoch": 1, "loss": "8.13", "num_updates": "5", ...}``;
  the per-epoch records ``train`` and ``valid`` prefix every key with their name
  (``"train_loss"``, ``"valid_loss"``, ``"valid_bleu"``, ``"valid_num_updates"``);
* ``simple`` (and tqdm's per-epoch lines): ``epoch 001:  5 / 8 loss=8.13, ..., num_updates=5``
  for ``train_inner``, ``epoch 001 | loss 7.48 | ... | num_updates 8`` at the end of an epoch,
  ``epoch 001 | valid on 'valid' subset | loss 5.95 | bleu 12.3 | ... | num_updates 8``.

:func:`parse_log` returns, per record kind (``train_inner``, ``train``, and one per validation
subset), a list of ``{"epoch", "num_updates", "loss", ...}`` dicts with float values (fairseq's
losses are in base 2). ``--eval-bleu`` adds ``bleu`` to the validation records.
"""
import json
import re
from typing import Dict, List

_JSON = re.compile(r"\| (?P<tag>train_inner|train|valid\w*) \| (?P<body>\{.*\})\s*$")
_INNER = re.compile(r"epoch (?P<epoch>\d+):\s+\d+ / \d+ (?P<body>\w+=.*)$")
_PIPES = re.compile(r"epoch (?P<epoch>\d+) \| (?P<body>.*)$")
_VALID = re.compile(r"^valid on '(?P<subset>[^']+)' subset$")


def _number(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _record(epoch, pairs) -> dict:
    record = {"epoch": float(epoch)}
    for key, value in pairs:
        number = _number(value)
        if number is not None:
            record[key] = number
    return record


def parse_log(path: str) -> Dict[str, List[dict]]:
    """Statistics of a fairseq-train log, by record kind, in the order they were logged."""
    records: Dict[str, List[dict]] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            m = _JSON.search(line)
            if m:
                try:
                    stats = json.loads(m.group("body"))
                except json.JSONDecodeError:
                    continue
                tag = m.group("tag")
                prefix = "" if tag == "train_inner" else tag + "_"
                pairs = [(k[len(prefix):], v) for k, v in stats.items() if k.startswith(prefix) and k != "epoch"]
                records.setdefault(tag, []).append(_record(stats.get("epoch", 0), pairs))
                continue
            m = _INNER.search(line)
            if m:
                pairs = [p.strip().split("=", 1) for p in m.group("body").split(",") if "=" in p]
                records.setdefault("train_inner", []).append(_record(m.group("epoch"), pairs))
                continue
            m = _PIPES.search(line)
            if m:
                fields = [p.strip() for p in m.group("body").split(" | ")]
                tag = "train"
                if fields and _VALID.match(fields[0]):
                    tag = _VALID.match(fields.pop(0)).group("subset")
                pairs = [p.split(" ", 1) for p in fields if " " in p]
                record = _record(m.group("epoch"), pairs)
                if "loss" in record and "num_updates" in record:
                    records.setdefault(tag, []).append(record)
    return records


def has_curves(records: Dict[str, List[dict]]) -> bool:
    return any("loss" in r and "num_updates" in r for rs in records.values() for r in rs)
