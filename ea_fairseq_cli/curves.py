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
import logging
import re
from typing import Dict, Iterator, List

from ._safety import open_inside

logger = logging.getLogger(__name__)

# Every pattern anchored or led by a literal, with no quantifier over a group: each line parsed
# in time linear in its length (the body of a json record is json.loads's, also linear).
_JSON = re.compile(r"\| (?P<tag>train_inner|train|valid\w*) \| \{")
_INNER = re.compile(r"epoch (?P<epoch>\d+):\s+\d+ / \d+ (?=\w+=)")
_PIPES = re.compile(r"epoch (?P<epoch>\d+) \| ")
_VALID = re.compile(r"valid on '(?P<subset>[^']+)' subset")
LIMIT_LINE = 1 << 16  # characters of a log line: fairseq's longest records are a few thousand


def _lines(f) -> Iterator[str]:
    """The lines of ``f``, each read at most :data:`LIMIT_LINE` characters at a time: a longer
    line is skipped (read through, never held), with a warning."""
    skipped = 0
    while True:
        line = f.readline(LIMIT_LINE + 1)
        if not line:
            break
        if len(line) > LIMIT_LINE:
            skipped += 1
            while line and not line.endswith("\n"):
                line = f.readline(LIMIT_LINE + 1)
            continue
        yield line.rstrip("\n")
    if skipped:
        logger.warning("%s: %d lines longer than %d characters skipped (not fairseq-train's)",
                       f.name, skipped, LIMIT_LINE)


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
    with open_inside(path, None, "r", encoding="utf-8", errors="replace") as f:
        for line in _lines(f):
            m = _JSON.search(line)
            body = line[m.end() - 1:].rstrip() if m else ""
            if body.endswith("}"):
                try:
                    stats = json.loads(body)
                except (ValueError, RecursionError):
                    continue
                if not isinstance(stats, dict):
                    continue
                tag = m.group("tag")
                prefix = "" if tag == "train_inner" else tag + "_"
                pairs = [(k[len(prefix):], v) for k, v in stats.items() if k.startswith(prefix) and k != "epoch"]
                records.setdefault(tag, []).append(_record(stats.get("epoch", 0), pairs))
                continue
            m = _INNER.search(line)
            if m:
                pairs = [p.strip().split("=", 1) for p in line[m.end():].split(",") if "=" in p]
                records.setdefault("train_inner", []).append(_record(m.group("epoch"), pairs))
                continue
            m = _PIPES.search(line)
            if m:
                fields = [p.strip() for p in line[m.end():].split(" | ")]
                tag = "train"
                valid = _VALID.fullmatch(fields[0]) if fields else None
                if valid:
                    tag = valid.group("subset")
                    fields.pop(0)
                pairs = [p.split(" ", 1) for p in fields if " " in p]
                record = _record(m.group("epoch"), pairs)
                if "loss" in record and "num_updates" in record:
                    records.setdefault(tag, []).append(record)
    return records


def has_curves(records: Dict[str, List[dict]]) -> bool:
    return any("loss" in r and "num_updates" in r for rs in records.values() for r in rs)
