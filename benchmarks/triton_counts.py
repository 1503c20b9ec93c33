"""What EA's Triton kernels (:mod:`ea_ops.triton`) will ask of a GPU, counted on any machine:
the compiled variants that one epoch of training and one beam-5 decode make Triton build, and
the registers of each variant compiled for sm_90.

* **Variants** are counted with Triton's own binder for sm_90 (the function Triton derives
  from a kernel's signature to key its compile cache: argument types, the specialisation of
  integers and pointers, the constexprs, the launch options). EA-Lite's real forward and
  backward run on the batches of one epoch of a data-bin (fairseq's batching, ``--max-tokens``)
  and a beam-5 generation of 100 steps runs on its test split, with the kernels' launches
  recorded instead of run (their outputs zeroed): on a CPU, the dispatcher gives the kernels
  these calls under ``TRITON_INTERPRET=1`` (:func:`ea_ops.triton.interpret_on_cpu`). A launch
  whose key is new is a compile on a GPU.
* **Registers**: every variant seen, and the same constexprs at EA-Base's 8 heads and keys up
  to 256, compiled for sm_90 (``triton.compile``, cuobjdump's resource count: both in the
  triton wheel) in a process without the interpreter.

Run (minutes on a CPU; the data-bin of ``bash scripts/demo.sh`` or any translation data-bin)::

    TRITON_INTERPRET=1 python benchmarks/triton_counts.py DATA_BIN --update

``--update`` writes the tables into ``benchmarks/triton_counts.md``.
"""
import argparse
import collections
import contextlib
import os
import sys
import tempfile
from pathlib import Path

import torch

from ea_ops.triton.variants import KERNELS, Launches, registers

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "benchmarks" / "triton_counts.md"
def _task(data: str):
    from fairseq.tasks.translation import TranslationConfig, TranslationTask
    pairs = sorted(p.name.split(".")[1] for p in Path(data).glob("train.*-*.*.idx"))
    if not pairs:
        sys.exit(f"triton_counts: no train.SRC-TGT.*.idx in {data}: give a data-bin fairseq-preprocess wrote")
    src, tgt = pairs[0].split("-")
    task = TranslationTask.setup_task(TranslationConfig(data=data, source_lang=src, target_lang=tgt,
                                                        train_subset="train", dataset_impl=None,
                                                        required_seq_len_multiple=1))
    for split in ("train", "test"):
        task.load_dataset(split)
    return task


def _batches(task, split, max_tokens, multiple=8):
    dataset = task.dataset(split)
    itr = task.get_batch_iterator(dataset, max_tokens=max_tokens, required_batch_size_multiple=multiple,
                                  max_positions=(1024, 1024), seed=1).next_epoch_itr(shuffle=False)
    return list(itr)


def training_epoch(model, task, max_tokens, launches):
    """One epoch's forward and backward, once per configuration of a batch: its lengths and
    whether it pads its sources and targets (what the kernels' arguments depend on; the number
    of sentences only sizes the grid). A batch runs as two of its sentences, the longest and
    the shortest source, in the batch's lengths."""
    from ea_ops.triton import interpret_on_cpu
    seen, shapes = set(), set()
    pad = task.source_dictionary.pad()
    for sample in _batches(task, "train", max_tokens):
        net = sample["net_input"]
        config = (net["src_tokens"].size(1), net["prev_output_tokens"].size(1),
                  bool(net["src_tokens"].eq(pad).any()), bool(net["prev_output_tokens"].eq(pad).any()))
        shapes.add(config[:2])
        if config in seen:
            continue
        seen.add(config)
        two = net["src_lengths"].argsort()[[0, -1]]
        net = {name: value.index_select(0, two) for name, value in net.items()}
        model.zero_grad(set_to_none=True)
        with interpret_on_cpu(), launches.recorded():
            out, _ = model(**net)
            out.float().sum().backward()
    return len(shapes), len(seen)


def beam_decode(model, task, launches, sentences, steps=100, beam=5):
    """fairseq's SequenceGenerator, beam 5, exactly ``steps`` steps, over the first
    ``sentences`` test sentences, one sentence a batch (None: the whole test split in fairseq's
    batches)."""
    from fairseq.sequence_generator import SequenceGenerator
    from ea_ops.triton import interpret_on_cpu
    generator = SequenceGenerator([model], task.target_dictionary, beam_size=beam, max_len_a=0, max_len_b=steps,
                                  min_len=steps)
    batches = _batches(task, "test", 4096, multiple=1)
    if sentences is not None:
        dataset = task.dataset("test")
        batches = [dataset.collater([dataset[i]]) for i in range(sentences)]
    with torch.no_grad(), interpret_on_cpu(), launches.recorded():
        for sample in batches:
            generator.generate([model], sample)
    return len(batches)


def model_for(task, arch="ea_transformer_lite"):
    from ea_fairseq.models.building import build_model
    model, _ = build_model(arch, "--share-all-embeddings", dictionary=task.source_dictionary)
    return model


@contextlib.contextmanager
def memory_traffic():
    """Inside the block, every load and store the interpreter runs is counted: kernel ->
    [bytes issued, distinct bytes] (the elements a mask lets through times their size; the
    distinct addresses of one launch once: what a cache that held the whole map would fetch)."""
    from triton.runtime import interpreter
    builder, kernel_name = interpreter.InterpreterBuilder, [None]
    counted = collections.defaultdict(lambda: [0, 0])
    touched = collections.defaultdict(set)
    load, store = builder.create_masked_load, builder.create_masked_store

    def count(ptrs, mask):
        size = ptrs.get_element_ty().primitive_bitwidth // 8
        addresses = ptrs.data[mask.data] if mask.data.shape == ptrs.data.shape else ptrs.data.ravel()
        counted[kernel_name[0]][0] += addresses.size * size
        touched[kernel_name[0]].update(addresses.tolist())
        counted[kernel_name[0]][1] = len(touched[kernel_name[0]]) * size

    def counted_load(self, ptrs, mask, *args):
        count(ptrs, mask)
        return load(self, ptrs, mask, *args)

    def counted_store(self, ptrs, value, mask, *args):
        count(ptrs, mask)
        return store(self, ptrs, value, mask, *args)

    builder.create_masked_load, builder.create_masked_store = counted_load, counted_store
    try:
        yield counted, kernel_name
    finally:
        builder.create_masked_load, builder.create_masked_store = load, store


def bytes_per_element(heads=4, length=25, bsz=2, dtype=torch.float16):
    """Bytes the kernels read and write per element of the (B, H, T, S) map, for one attention
    of each layout, forward and backward, as EA-Lite runs them in training (a previous map,
    a bias, key padding, the weights asked for and the map handed on)."""
    from ea_ops import EvolvingAttentionParams
    from ea_ops.triton import evolving_attention as kernels, operators as host
    rows = []
    for layout in ("full", "causal", "rows"):
        g = torch.Generator().manual_seed(0)
        logits, previous = (torch.randn(bsz, heads, length, length, generator=g).to(dtype).requires_grad_()
                            for _ in range(2))
        weight = (torch.randn(heads, heads, 3, 3, generator=g) / 4).to(dtype).requires_grad_()
        bias = torch.zeros(heads, dtype=dtype, requires_grad=True)
        masked = torch.zeros(bsz, 1, 1, length, dtype=torch.bool)
        masked[1, ..., :2] = True
        if layout == "causal":
            masked = masked | torch.ones(length, length, dtype=torch.bool).triu(1)
        values = torch.randn(bsz * heads, length, 8, generator=g).to(dtype)
        names = KERNELS["evolving_attention"]
        saved = {name: getattr(kernels, name) for name in names}
        with memory_traffic() as (counted, current):
            for name in names:
                setattr(kernels, name, _Named(saved[name], name, current))
            try:
                out = host.full_pass(logits, previous, masked, masked,  # neutral: as the operation passes it
                                     EvolvingAttentionParams(0.3, 0.6, weight, bias, layout),
                                     values=values, hand_on=True)
                (out.context.float().sum() + out.carried.float().sum()).backward()
            finally:
                for name in names:
                    setattr(kernels, name, saved[name])
        elements = logits.numel()
        rows.append((layout, {name: (issued / elements, distinct / elements)
                              for name, (issued, distinct) in counted.items()}))
    return rows


class _Named:
    """A kernel whose launches set the name the traffic is counted under."""

    def __init__(self, kernel, name, current):
        self.kernel, self.name, self.current = kernel, name, current

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.current[0] = self.name
            return launch(*args, **kwargs)
        return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", help="a translation data-bin (fairseq-preprocess's output)")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--no-registers", action="store_true", help="count variants only")
    parser.add_argument("--update", action="store_true", help=f"write the report into {REPORT.name}")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("triton_counts: run with TRITON_INTERPRET=1 (the dispatcher then gives CPU calls to the kernels)")
    torch.manual_seed(1)
    torch.set_num_threads(1)  # what is counted does not depend on speed; other work keeps the other cores
    task = _task(args.data)
    model = model_for(task)
    rows = []
    epoch = Launches()
    shapes, configs = training_epoch(model.train(), task, args.max_tokens, epoch)
    rows.append((f"one epoch of training, {shapes} (T, S) shapes, {configs} batch configurations", epoch))
    one = Launches()
    beam_decode(model.eval(), task, one, sentences=1)
    rows.append(("beam-5 decode of 100 steps, one sentence", one))
    everything = Launches()
    batches = beam_decode(model.eval(), task, everything, sentences=None)
    rows.append((f"beam-5 decode of 100 steps, the test split ({batches} batches)", everything))
    names = [name for names in KERNELS.values() for name in names]
    lines = ["| workload | " + " | ".join(f"`{n}`" for n in names) + " | all |", "|---" * (len(names) + 2) + "|"]
    for label, launches in rows:
        lines.append(f"| {label} | " + " | ".join(f"{launches.count(n)} ({launches.launches[n]} launches)"
                                                  for n in names) + f" | **{launches.count()}** |")
    union = Launches()  # the variants of both, each once
    for launches in (epoch, everything):
        for n, keys in launches.variants.items():
            union.variants[n].update(keys)
    lines.append(f"| epoch and the test split's decode together | | | | | **{union.count()}** |")
    report = "\n".join(lines)
    traffic = bytes_per_element()
    report += ("\n\n| layout (EA-Lite's sizes, fp16) | " + " | ".join(f"`{n}`" for n in KERNELS["evolving_attention"])
               + " | a training update's attention |\n|---|---|---|---|---|\n")
    report += "\n".join(
        f"| {layout} | " + " | ".join(f"{issued:.0f} ({distinct:.0f})" for issued, distinct in counted.values())
        + f" | {sum(i for i, _ in counted.values()):.0f} ({sum(d for _, d in counted.values()):.0f}) |"
        for layout, counted in traffic)
    report += ("\n\nBytes per element of the (B, H, T, S) map, B = 2, H = 4, T = S = 25: every load and store "
               "the kernels issue (in parentheses: each address once per launch, what a cache that held the "
               "maps would fetch).")
    if not args.no_registers:
        try:
            usage = registers(union.specialisations())
        except RuntimeError as e:
            sys.exit(f"triton_counts: {str(e).strip().splitlines()[-1]}")
        worst = collections.defaultdict(lambda: (0, 0, 0))
        for name, fields in usage:
            reg, stack, local = int(fields["REG"]), int(fields["STACK"]), int(fields["LOCAL"])
            worst[name] = tuple(max(a, b) for a, b in zip(worst[name], (reg, stack, local)))
        report += "\n\n| kernel (every variant above, sm_90) | variants | most registers | most stack bytes | " \
                  "most local bytes |\n|---|---|---|---|---|\n"
        report += "\n".join(f"| `{n}` | {sum(1 for m, _ in usage if m == n)} | {r} | {s} | {lo} |"
                            for n, (r, s, lo) in worst.items())
    print(report)
    if args.update:
        _write(report)


def _write(report):
    """The report between the markers of benchmarks/triton_counts.md, renamed into place."""
    start, end = "<!-- triton_counts.py: begin -->", "<!-- triton_counts.py: end -->"
    text = REPORT.read_text()
    head, rest = text.split(start)
    _, tail = rest.split(end)
    with tempfile.NamedTemporaryFile("w", dir=REPORT.parent, delete=False) as f:
        f.write(f"{head}{start}\n{report}\n{end}{tail}")
    os.replace(f.name, REPORT)


if __name__ == "__main__":
    main()
