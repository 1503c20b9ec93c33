"""``--task translation_lines``: fairseq's ``translation`` task for ``fairseq-interactive``
sessions that must survive a line the model cannot take.

fairseq's ``translation`` task ends an interactive session with an exception when a line is
longer than the model accepts (a RAN model's limit is ``--ran-max-positions``, 256 by
default; fairseq's transformer takes 1024), unless ``--skip-invalid-size-inputs-valid-test``
is given, which skips it with a warning that counts samples of the current buffer. This task
reports each such line by its number in the session and translates the others; everything
else, including ``fairseq-generate`` on a binarized split (an error there unless
``--skip-invalid-size-inputs-valid-test``: a test set is not silently shortened), is
fairseq's ``translation``.

An empty input line (or one of spaces only) is passed through: its ``H-`` and ``D-`` lines
are empty, with score 0, where fairseq's ``translation`` has the model translate the lone
``</s>`` into words no input asked for. Its rows are left out of the batch the model
decodes (the other lines' hypotheses are the same as without them), and the first empty
line of a session is logged once.
"""
import logging

import torch
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

logger = logging.getLogger(__name__)


@register_task("translation_lines", dataclass=TranslationConfig)
class LineByLineTranslationTask(TranslationTask):
    def __init__(self, cfg, src_dict, tgt_dict):
        super().__init__(cfg, src_dict, tgt_dict)
        self.lines_read = 0  # interactive input lines seen in this session
        self._first_line = None  # session index of the lines being batched now
        self._interactive = False  # fairseq-interactive's input: empty lines are passed through
        self._empty_reported = False

    def get_interactive_tokens_and_lengths(self, lines, encode_fn):
        # only fairseq-interactive reads its input through here
        self._first_line = self.lines_read
        self.lines_read += len(lines)
        self._interactive = True
        tokens, lengths = super().get_interactive_tokens_and_lengths(lines, encode_fn)
        empty = next((i for i, n in enumerate(lengths) if n <= 1), None)  # </s> alone
        if empty is not None and not self._empty_reported:
            self._empty_reported = True
            logger.info(f"input line {self._first_line + empty + 1}: empty, passed through as an empty "
                        "translation (score 0), as is every empty line of this session")
        return tokens, lengths

    def inference_step(self, generator, models, sample, prefix_tokens=None, constraints=None):
        lengths = sample["net_input"]["src_lengths"] if self._interactive else None
        if lengths is None or bool((lengths > 1).all()):
            return super().inference_step(generator, models, sample, prefix_tokens, constraints)
        rows = len(lengths)
        keep = (lengths > 1).nonzero().squeeze(1)

        def kept(value):
            if torch.is_tensor(value) and value.dim() > 0 and len(value) == rows:
                return value.index_select(0, keep.to(value.device))
            return value

        hypos = iter(super().inference_step(
            generator, models, {**sample, "net_input": {k: kept(v) for k, v in sample["net_input"].items()}},
            kept(prefix_tokens), kept(constraints)) if len(keep) else ())
        eos = torch.tensor([self.target_dictionary.eos()], device=lengths.device)
        empty = {"tokens": eos, "score": torch.tensor(0.0), "attention": None,
                 "alignment": torch.empty(0, 2, dtype=torch.long), "positional_scores": torch.zeros(1)}
        return [next(hypos) if n > 1 else [dict(empty)] for n in lengths.tolist()]

    def build_dataset_for_inference(self, src_tokens, src_lengths, constraints=None):
        dataset = super().build_dataset_for_inference(src_tokens, src_lengths, constraints)
        dataset.first_input_line, self._first_line = self._first_line, None
        return dataset

    def filter_indices_by_size(self, indices, dataset, max_positions=None, ignore_invalid_inputs=False):
        first = getattr(dataset, "first_input_line", None)
        if first is None or max_positions is None:  # not interactive input
            return super().filter_indices_by_size(indices, dataset, max_positions, ignore_invalid_inputs)
        indices, ignored = dataset.filter_indices_by_size(indices, max_positions)
        limit = max_positions[0] if isinstance(max_positions, tuple) else max_positions
        for i in ignored:
            logger.warning(
                f"input line {first + int(i) + 1}: {int(dataset.src_sizes[i])} tokens with </s>, "
                f"more than the {limit} this model takes (for RAN: --ran-max-positions); "
                "not translated, the session goes on")
        return indices
