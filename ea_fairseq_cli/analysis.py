"""``ea-fairseq-analysis {dump,metrics,plot,flops} ...``; ``plot curves`` draws learning curves from fairseq-train logs (also ``python -m ea_fairseq_cli.analysis``; see docs/analysis.md)."""
import argparse
import json
import logging
import os
import sys
from typing import List, Optional

from . import add_version_option
from ._safety import replaced, write_text
from .inputs import need_file, need_files, need_folder

logger = logging.getLogger("ea_fairseq.analysis")


# -- shared options -------------------------------------------------------------------------
def _add_source_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", help="data directory with the dictionaries (and the binarized "
                                  "splits); default: the checkpoint's own directory (the data "
                                  "directory a checkpoint records is never opened)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--split", default=None,
                     help="binarized split of --data to read, e.g. test or valid (default: test "
                          "for dump, valid for metrics)")
    src.add_argument("--input", metavar="FILE",
                     help="source sentences, one per line, already tokenized and BPE'd the way "
                          "the model's data was (mapped through the model's dictionary)")
    p.add_argument("--reference", metavar="FILE",
                   help="with --input: reference translations (same preprocessing) to "
                        "teacher-force; without it the beam hypothesis is used")
    p.add_argument("--hypothesis", action="store_true",
                   help="teacher-force the decoder on the best beam hypothesis instead of the "
                        "reference")
    p.add_argument("--beam", type=int, default=5, help="beam size for --hypothesis (default 5)")
    p.add_argument("--max-len-a", type=float, default=0.0,
                   help="hypothesis length limit a*src_len+b, as fairseq-generate (default 0)")
    p.add_argument("--max-len-b", type=int, default=200, help="(default 200)")
    p.add_argument("--source-lang", help="override the checkpoint's source language")
    p.add_argument("--target-lang", help="override the checkpoint's target language")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def _load(path: str, args):
    from ea_fairseq.analysis.maps import load_model

    overrides = {k: getattr(args, k) for k in ("source_lang", "target_lang") if getattr(args, k)}
    return load_model(path, args.data, overrides)


def _dataset(task, args, default_split: str):
    from ea_fairseq.analysis.maps import read_lines, split_dataset, text_dataset

    if args.input:
        refs = read_lines(args.reference) if args.reference else None
        if refs is None:
            args.hypothesis = True
        return text_dataset(task, read_lines(args.input), refs), args.input
    if args.reference:
        raise SystemExit("--reference goes with --input")
    split = args.split or default_split
    return split_dataset(task, split), split


def _threads(args) -> None:
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


# -- dump -----------------------------------------------------------------------------------
def _check_ids(ids: Optional[List[int]], count: int, source: str) -> None:
    """``--ids`` within the ``count`` sentences of ``source``, before anything is written."""
    outside = [i for i in ids or () if not 0 <= i < count]
    if outside:
        from ._safety import OptionError

        held = f"has {count} sentences, ids 0..{count - 1}" if count else "has no sentences"
        raise OptionError(f"--ids {' '.join(map(str, outside))}: {source} {held}")


def cmd_dump(args) -> int:
    from ea_fairseq.analysis.maps import dump
    from ea_fairseq.safety.no_code import architecture

    _threads(args)
    model, task, cfg = _load(args.checkpoint, args)
    dataset, source = _dataset(task, args, "test")
    _check_ids(args.ids, len(dataset), f"--input {source}" if args.input else f"the split {source}")
    ids = args.ids if args.ids else list(range(min(len(dataset), 5)))
    meta = dump(model, task, dataset, ids, args.out, hypothesis=args.hypothesis, beam=args.beam,
                max_len=(args.max_len_a, args.max_len_b),
                extra_meta={"checkpoint": os.path.abspath(args.checkpoint), "data": source,
                            "arch": architecture(getattr(cfg, "model", None))})
    for s in meta["sentences"]:
        kinds = "; ".join(f"{a}: {', '.join(k)}" for a, k in s["maps"].items())
        print(f"sentence {s['id']}: {len(s['source'])} source / {len(s['target'])} target tokens; {kinds}")
    skipped = meta["skipped_longer_than_max_positions"]
    if skipped:
        print(f"skipped {len(skipped)} sentence(s) longer than the model's max_positions: {skipped}")
    print(f"wrote {args.out} and {os.path.splitext(args.out)[0]}.json")
    return 0


# -- metrics --------------------------------------------------------------------------------
def _model_name(path: str) -> str:
    parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
    stem = os.path.splitext(os.path.basename(path))[0]
    return f"{parent}/{stem}" if parent else stem


def cmd_metrics(args) -> int:
    from ea_fairseq.analysis import metrics as M

    _threads(args)
    names = args.names or [_model_name(c) for c in args.checkpoints]
    if len(names) != len(args.checkpoints):
        raise SystemExit("--names needs one name per checkpoint")
    results = {}
    source = None
    for name, path in zip(names, args.checkpoints):
        model, task, _ = _load(path, args)
        dataset, source = _dataset(task, args, "valid")
        results[name] = M.evaluate(
            model, task, dataset, hypothesis=args.hypothesis, beam=args.beam,
            max_tokens=args.max_tokens, max_sentences=args.batch_size, limit=args.limit,
            js_mode=args.js_heads, progress=not args.no_progress_bar, desc=name,
            max_len=(args.max_len_a, args.max_len_b),
        )
    report = M.markdown(results)
    prefix = args.out
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    write_text(prefix + ".md", report)
    M.write_csv(prefix + ".csv", M.layer_rows(results))
    M.write_csv(prefix + ".js.csv", M.js_rows(results))
    with replaced(prefix + ".json", "w") as f:
        json.dump({"data": source, "decoder_targets": "beam hypothesis" if args.hypothesis else "reference",
                   "checkpoints": dict(zip(names, map(os.path.abspath, args.checkpoints))),
                   "models": results}, f, indent=1)
    print(report)
    print(f"wrote {prefix}.md, {prefix}.csv, {prefix}.js.csv, {prefix}.json")
    return 0


# -- plot -----------------------------------------------------------------------------------
def _read_metrics(paths: List[str]) -> dict:
    merged = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for name, r in data["models"].items():
            key = name if name not in merged else f"{name} ({os.path.basename(path)})"
            merged[key] = r
    return merged


def _plot_dump(args, plots, written: List[str]) -> None:
    """``plot maps``/``plot kinds``: each figure of the dump, named by :func:`plots.figure_path`;
    at most :data:`plots.LIMIT_FIGURES` of them."""
    from ea_fairseq.analysis.dumps import AttentionDump, DumpError

    dump = AttentionDump(args.dump)
    sids = args.sentence if args.sentence else sorted(dump.sentences)
    figures = []  # (sid, attention, kind or head): all of them counted before one is drawn
    for sid in sids:
        if sid not in dump.sentences:
            raise SystemExit(f"sentence {sid} is not in {args.dump} ({sorted(dump.sentences)})")
        for attention, kinds in dump.sentences[sid].kinds.items():
            if args.attention and attention not in args.attention:
                continue
            figures += ([(sid, attention, head) for head in args.heads or [1]] if args.what == "kinds" else
                        [(sid, attention, kind) for kind in kinds if "all" in args.kind or kind in args.kind])
            if len(figures) > plots.LIMIT_FIGURES:
                raise DumpError(f"{args.dump}: more than the {plots.LIMIT_FIGURES} figures one command draws; "
                                "pick some with --sentence, --attention or --kind")
    os.makedirs(args.out_dir, exist_ok=True)
    for sid, attention, which in figures:
        if args.what == "kinds":
            out = plots.figure_path(args.out_dir, f"s{sid}", attention, f"head{which}")
            written.append(plots.plot_kinds(dump, sid, attention, which, args.kind, out, args.layers,
                                            args.window_start))
        else:
            out = plots.figure_path(args.out_dir, f"s{sid}", attention, which)
            written.append(plots.plot_maps(dump, sid, attention, which, out, args.layers, args.heads,
                                           args.scale, args.window_start))


def cmd_plot(args) -> int:
    from . import metric_plots, plots

    written = []
    if args.what in ("maps", "kinds"):
        from ea_fairseq.analysis.dumps import DumpError

        try:
            _plot_dump(args, plots, written)
        except DumpError as err:  # a file that is not such a dump: one line, nothing more written
            raise SystemExit(f"ea-fairseq-analysis plot {args.what}: error: {err}") from None
    elif args.what == "entropy":
        written.append(metric_plots.plot_entropy(_read_metrics(args.metrics), args.out, args.metric))
    elif args.what == "curves":
        from .curves import has_curves, parse_log

        dirs = [os.path.basename(os.path.dirname(os.path.abspath(p))) for p in args.logs]
        names = args.names or (dirs if len(set(dirs)) == len(dirs) else list(args.logs))
        if len(names) != len(args.logs):
            raise SystemExit("--names needs one name per log")
        runs = {}
        for name, path in zip(names, args.logs):
            records = parse_log(path)
            if not has_curves(records):
                raise SystemExit(f"ea-fairseq-analysis plot curves: no training statistics in {path} "
                                 "(a fairseq-train log, --log-format json or simple; train.sh writes "
                                 "SAVE_DIR/train.log)")
            runs[name] = records
        written.append(metric_plots.plot_curves(runs, args.out))
    elif args.what == "js":
        results = _read_metrics(args.metrics)
        if args.attention:
            results = {m: {a: r for a, r in per.items() if a in args.attention} for m, per in results.items()}
        written.append(metric_plots.plot_js(results, args.out))
    if not written:
        raise SystemExit("nothing to plot (check --attention / --kind)")
    for w in written:
        print(f"wrote {w}")
    return 0


# -- flops ----------------------------------------------------------------------------------
def cmd_flops(args) -> int:
    import shlex

    from ea_fairseq.models.building import build_model
    from ea_fairseq.analysis import flops as F

    results = []
    extra = shlex.split(args.model_args or "")
    archs = args.arch if args.arch is not None else ([] if args.checkpoint else F.plugin_architectures())
    for arch in archs:
        model, _ = build_model(arch, *extra, vocab=args.vocab, meta=True)
        results.append(F.count_model(model, args.src_len, args.tgt_len, name=arch))
    for path in args.checkpoint or []:
        from ea_fairseq.analysis.maps import load_model

        model, _, _ = load_model(path, args.data)
        results.append(F.count_model(model, args.src_len, args.tgt_len, name=_model_name(path)))
    conventions = list(F.CONVENTIONS) if args.convention == "all" else [args.convention]
    report = F.markdown_report(results, conventions, args.with_output_projection)
    print(report)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        write_text(args.out + ".md", report)
        with replaced(args.out + ".json", "w") as f:
            json.dump({
                "src_len": args.src_len, "tgt_len": args.tgt_len,
                "conventions": {c: F.CONVENTIONS[c].description for c in conventions},
                "categories": F.CATEGORIES,
                "models": [dict(row, breakdown=F.breakdown(r), uncounted=r.uncounted)
                           for row, r in zip(F.report_rows(results, conventions,
                                                           args.with_output_projection), results)],
            }, f, indent=1)
        print(f"wrote {args.out}.md and {args.out}.json")
    return 0


# -- parser ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ea-fairseq-analysis",
        description="Attention analysis for ea_fairseq models: maps, layer-wise metrics, plots, "
                    "params/FLOPs.",
    )
    add_version_option(parser, "ea-fairseq-analysis")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("dump", help="dump every layer's and head's attention maps to .npz")
    p.add_argument("checkpoint")
    _add_source_options(p)
    p.add_argument("--ids", type=int, nargs="+", help="sentence ids (dataset index / 0-based line "
                                                      "number of --input; default: the first 5)")
    p.add_argument("--out", required=True, help="output .npz (tokens also in the .json beside it)")
    p.set_defaults(func=cmd_dump)

    p = sub.add_parser("metrics", help="entropy, JS divergence, Div, Disagreement per layer")
    p.add_argument("checkpoints", nargs="+")
    _add_source_options(p)
    p.add_argument("--names", nargs="+", help="model names for the tables (default: dir/file)")
    p.add_argument("--max-tokens", type=int, default=4000)
    p.add_argument("--batch-size", type=int, default=None, help="max sentences per batch")
    p.add_argument("--limit", type=int, default=None, help="only the first N sentences")
    p.add_argument("--js-heads", choices=("mean", "paired"), default="mean",
                   help="JS between layers of the head-averaged distributions (mean, default) "
                        "or averaged over same-index head pairs (paired)")
    p.add_argument("--no-progress-bar", action="store_true")
    p.add_argument("--out", required=True, help="output prefix: PREFIX.md/.csv/.js.csv/.json")
    p.set_defaults(func=cmd_metrics)

    p = sub.add_parser("plot", help="heatmaps, entropy per layer, JS-divergence matrices")
    plot = p.add_subparsers(dest="what", required=True)
    for what, help_ in (("maps", "heatmaps per layer and head of a dump"),
                        ("kinds", "per layer, one head's weights beside the mechanism's maps "
                                  "(EA: logits, convolution, dot_product; EA Fig. 11)")):
        q = plot.add_parser(what, help=help_)
        q.add_argument("dump")
        q.add_argument("--sentence", type=int, nargs="+", help="sentence ids (default: all in the dump)")
        q.add_argument("--attention", nargs="+", help="encoder.self decoder.self decoder.cross")
        if what == "maps":
            q.add_argument("--kind", nargs="+", default=["weights"],
                           help="weights (default), a mechanism's maps (dot_product, convolution, "
                                "logits, prediction, recurrent ...) or all")
            q.add_argument("--scale", choices=("auto", "figure", "layer", "panel"), default="auto",
                           help="one colour scale fitted to every panel (figure), one per layer (layer), one "
                                "per panel (panel), or auto (default): layer where a signed map's layers "
                                "differ in magnitude more than threefold, else figure; weights on a square-root scale "
                                "from 0 to the largest shown")
        else:
            q.add_argument("--kind", nargs="+", help="kinds to show (default: all in the dump)")
        q.add_argument("--layers", type=int, nargs="+", help="1-based layers (default all)")
        q.add_argument("--heads", type=int, nargs="+",
                       help="1-based heads (default: all for maps, head 1 for kinds)")
        q.add_argument("--window-start", type=int, default=1, metavar="N",
                       help="a sentence longer than a figure can label readably is cropped to the tokens "
                            "that fit (the title says which): show them from token N on (default 1)")
        q.add_argument("--out-dir", required=True)
        q.set_defaults(func=cmd_plot)
    q = plot.add_parser("entropy", help="per-layer metric of several models (metrics JSON files)")
    q.add_argument("metrics", nargs="+")
    q.add_argument("--metric", default="entropy", choices=("entropy", "div", "disagreement"))
    q.add_argument("--out", required=True)
    q.set_defaults(func=cmd_plot)
    q = plot.add_parser("curves", help="learning curves (train/valid loss, valid BLEU if logged) "
                                       "from fairseq-train logs")
    q.add_argument("logs", nargs="+", metavar="LOG", help="fairseq-train logs (e.g. SAVE_DIR/train.log)")
    q.add_argument("--names", nargs="+", help="run names for the legend (default: each log's directory, "
                                              "or its path where two share one)")
    q.add_argument("--out", "-o", required=True, help="output PNG")
    q.set_defaults(func=cmd_plot)
    q = plot.add_parser("js", help="JS-divergence matrices (metrics JSON files)")
    q.add_argument("metrics", nargs="+")
    q.add_argument("--attention", nargs="+")
    q.add_argument("--out", required=True)
    q.set_defaults(func=cmd_plot)

    p = sub.add_parser("flops", help="non-embedding params and FLOPs, beside EA Table 5")
    p.add_argument("--arch", nargs="+", help="architectures (default: transformer and every "
                                             "architecture of the plugin)")
    p.add_argument("--checkpoint", nargs="+", help="count trained checkpoints too")
    p.add_argument("--data", help="with --checkpoint: data directory with the dictionaries")
    p.add_argument("--model-args", help="extra model options, e.g. \"--encoder-layers 2\"")
    p.add_argument("--src-len", type=int, default=30)
    p.add_argument("--tgt-len", type=int, default=30)
    p.add_argument("--convention", default="all", choices=("all", "table5", "matmul"))
    p.add_argument("--with-output-projection", action="store_true",
                   help="also count the projection onto the vocabulary (needs --vocab)")
    p.add_argument("--vocab", type=int, default=1000, help="vocabulary size of the built models")
    p.add_argument("--out", help="also write PREFIX.md and PREFIX.json")
    p.set_defaults(func=cmd_flops)
    return parser


CHECKPOINT = "a checkpoint fairseq-train wrote (e.g. SAVE_DIR/checkpoint_best.pt)"


def check_inputs(args) -> None:
    """Every file and folder the command line reads, before torch or fairseq is loaded: one
    line for a mistake (outputs' folders are created)."""
    program = f"ea-fairseq-analysis {args.command}" + (f" {args.what}" if args.command == "plot" else "")
    if args.command == "plot":
        if args.what in ("maps", "kinds"):
            need_file(program, args.dump, "a dump that ea-fairseq-analysis dump wrote (its .npz)")
        elif args.what in ("entropy", "js"):
            need_files(program, args.metrics, "metrics files that ea-fairseq-analysis metrics wrote "
                                              "(PREFIX.json)")
        else:
            need_files(program, args.logs, "a fairseq-train log (train.sh writes SAVE_DIR/train.log)")
        return
    need_files(program, [args.checkpoint] if args.command == "dump" else
               args.checkpoints if args.command == "metrics" else args.checkpoint, CHECKPOINT)
    need_folder(program, args.data, "--data the data directory with the model's dictionaries (dict.*.txt)")
    need_file(program, getattr(args, "input", None), "--input the source sentences, one per line")
    need_file(program, getattr(args, "reference", None), "--reference the reference translations, one per line")


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                        level=logging.WARNING, stream=sys.stderr)
    args = build_parser().parse_args(argv)
    check_inputs(args)
    from ._safety import OptionError

    refused = (OptionError,)
    if not (args.command == "plot" and args.what in ("entropy", "js", "curves")):
        from ea_fairseq import load_plugin  # (JSON and log files in, PNG out: no fairseq, no torch)

        load_plugin()
        from ea_fairseq.safety.no_code import CheckpointError

        refused += (CheckpointError,)
    try:
        return args.func(args)
    except refused as err:  # a refused checkpoint, data file or log: its reason, not a traceback
        raise SystemExit(f"ea-fairseq-analysis {args.command}: error: {err}")


if __name__ == "__main__":
    sys.exit(main())
