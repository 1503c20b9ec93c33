#!/usr/bin/env python3
"""Speed and memory of every architecture against its fairseq twin, side by side in one run.

    python benchmarks/benchmark.py                    # full run (about 15 min on 2 cores)
    python benchmarks/benchmark.py --quick            # small smoke run (2+2-layer models)
    python benchmarks/benchmark.py --only ea_transformer_lite ran_all_lite
    python benchmarks/benchmark.py --device cuda --dtype fp16 --only ea_transformer_lite

Every figure that matters is a *ratio* to the vanilla twin of the same dimensions
(``transformer_lite`` for the Lite family, fairseq's ``transformer`` for base-sized),
measured in the same process on the same batches with the same seed, the two models'
runs interleaved and repeated; medians are reported with min-max spread. Both reorder
their beam caches the same way (the plugin's list of state holders, given to the twin's
fairseq decoder as well; ``--fairseq-reorder``: fairseq's walk over every module, for both). Absolute
numbers are printed with a description of the machine and of its load: run the
benchmark alone (a concurrent job distorts CPU timings many times over).

Measured:
* training: tokens/s of full updates (forward, label-smoothed loss, backward, Adam) over
  one short, one middle and one long batch, each of sentences of similar length as
  fairseq's length-sorted batching makes them; peak memory of training the long batch
  (resident-set growth in a fresh subprocess per model);
* generation: sentences/s with fairseq's SequenceGenerator, beam 5 and 1, batch sizes
  1/32/128, incremental decoding, every hypothesis forced to the same length so all
  models decode the same number of steps; with a realistic vocabulary (10k joint BPE
  for Lite, 32k for base) and a small one;
* scaling: time of one incremental decoding step as the prefix grows (t = 8 ... 256);
* attention path: which implementation each side's attentions ran in a training forward and
  a decoding step (fairseq's call into torch's fused attention, or the unfused weights a
  mechanism needs), detected on the device and in the precision of the run.

Device and precision (``--device``, ``--dtype``; default CPU, float32):
* models and batches live on the device; on CUDA every timed callable ends with
  ``torch.cuda.synchronize()``, so a timer is read only once the GPU's work is done;
* fp16/bf16 train as fairseq's ``--fp16``/``--bf16`` do: the model cast with
  ``model.half()``/``.bfloat16()``, the loss in float32 (log-softmax of ``.float()`` logits),
  and fairseq's own ``FP16Optimizer`` keeping float32 master weights (the same torch Adam as
  the float32 path runs on them), with fairseq's dynamic loss scaling for fp16 (initial scale
  128; an overflowing update is skipped, as fairseq skips it, and counted) and none for bf16;
  the master copy is flat for fp16 on CUDA, per parameter otherwise (fairseq's flattening
  needs a CUDA device; ``--bf16`` never flattens). Arch and twin are trained identically;
* generation runs the cast model, as ``fairseq-generate --fp16/--bf16`` does;
* memory on CUDA: the peak of ``torch.cuda.max_memory_allocated()`` over one training step
  of the longest batch, in this process (its growth over what is allocated before the step,
  whose arch/twin ratio is reported, and in all), instead of the resident-set probe.

Writes ``<out>/benchmark.json`` and ``<out>/benchmark.md`` for the default CPU float32
run, ``<out>/benchmark-<device>-<dtype>.{json,md}`` for any other, so that ``--append``
never mixes rows measured on different devices or in different precisions.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

LITE_TWIN, BASE_TWIN = "transformer_lite", "transformer"
PAIRS = {  # arch -> (twin, family)
    "ea_transformer_lite": (LITE_TWIN, "lite"),
    "pa_transformer_lite": (LITE_TWIN, "lite"),
    "ran_e_lite": (LITE_TWIN, "lite"),
    "ran_d_lite": (LITE_TWIN, "lite"),
    "ran_all_lite": (LITE_TWIN, "lite"),
    "ea_transformer_base": (BASE_TWIN, "base"),
    "ran_all": (BASE_TWIN, "base"),
    "ran_d": (BASE_TWIN, "base"),
}
VOCAB = {"lite": 10000, "base": 32000}
DTYPES = ("bf16", "fp16", "fp32")
QUICK_LAYERS = 2  # --quick: encoder and decoder layers of every model (a smoke run, not a measurement)


def load_measurements():
    """benchmarks/measure.py (torch, fairseq, the plugin): loaded once the command line is parsed."""
    spec = importlib.util.spec_from_file_location("ea_fairseq_benchmark_measure", os.path.join(HERE, "measure.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

def setting(run) -> tuple:
    """(device, dtype) of a run; runs recorded before either was an option ran on CPU in float32."""
    m = run["machine"]
    return m.get("device", "cpu"), m.get("dtype", "fp32")


def report_name(device: str, dtype: str) -> str:
    """File name (without extension) of the report of runs on ``device`` in ``dtype``."""
    return "benchmark" if (device, dtype) == ("cpu", "fp32") else f"benchmark-{device}-{dtype}"


def busy_processes():
    """Other processes using CPU right now (what could distort the timings)."""
    out = subprocess.run(["ps", "-eo", "pid,ppid,pcpu,comm", "--sort=-pcpu"], capture_output=True, text=True)
    rows = []
    for line in out.stdout.splitlines()[1:]:
        pid, ppid, pcpu, comm = line.split(None, 3)
        # not this process, nor the ps it runs to ask
        if os.getpid() not in (int(pid), int(ppid)) and float(pcpu) >= 5.0:
            rows.append(f"{comm} ({pcpu}% cpu)")
    return rows


def fmt(s, digits=2):
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def merge_generation_rows(earlier: list, later: list) -> list:
    """One arch's generation rows of two runs: a later row replaces the earlier one of the
    same vocabulary, beam and batch size; the rest stay (a run may add batch sizes)."""
    key = lambda r: (r["vocab"], r["beam"], r["batch"])  # noqa: E731
    merged = {key(r): r for r in earlier}
    merged.update({key(r): r for r in later})
    return sorted(merged.values(), key=lambda r: (-r["vocab"], -r["beam"], r["batch"]))


def markdown(report) -> str:
    device, dtype = setting(report["runs"][-1])
    cuda, mixed = device == "cuda", dtype != "fp32"
    lines = ["## Benchmark: ratios to the vanilla twin (higher is faster)"
             + ("" if (device, dtype) == ("cpu", "fp32") else f", {device} {dtype}"), ""]
    for run in report["runs"]:
        m = run["machine"]
        on_gpu = (f"{m['device_name']} (CUDA {m['cuda']}, cuDNN {m['cudnn']}), {m['dtype']}; host "
                  if m.get("device") == "cuda" else "")
        in_dtype = f", {m['dtype']}" if setting(run)[0] == "cpu" and setting(run)[1] != "fp32" else ""
        lines += [
            f"Run of {', '.join(run['archs'])}: {on_gpu}{m['cpu']}, {m['cores']} cores, torch {m['torch']} "
            f"with {m['torch_threads']} threads{in_dtype}; load average {m['loadavg_start'][0]:.2f} at start, "
            f"{run['loadavg_end'][0]:.2f} at end; other busy processes: {', '.join(run['busy']) or 'none'}; "
            + ("freed memory kept for reuse (no page-fault churn; `--system-allocator` to compare)."
               if m.get("freed_memory_kept") else "glibc's default allocator.")
            + (" Decoders reordered their caches with fairseq's walk over every module "
               "(`--fairseq-reorder`)." if m.get("fairseq_reorder") else ""),
            "",
        ]
    lines += ["Each cell: median (min–max) over interleaved repeats, alternating which side runs first "
              "(their number: `n` in benchmark.json; generation at batch 1, whose runs are the "
              "shortest and noisiest, takes twice as many and one more).", ""]
    if report.get("training"):
        buckets = next(iter(report["training"].values())).get("batches", [])
        lines += ["### Training (full updates: forward, loss, backward, Adam"
                  + (f"; {dtype} model, float32 loss and master weights: fairseq's FP16Optimizer)"
                     if mixed else ")"), "",
                  "One batch per sentence-length range "
                  + ", ".join(f"{lo}–{hi}" for lo, hi in buckets)
                  + " (similar lengths per batch, as fairseq batches them); "
                  + ("memory: peak CUDA memory allocated in a training step on the longest batch, "
                     "its growth over what is allocated before the step (ratio; MiB) and in all (peak)."
                     if cuda else "memory: resident-set growth of a training step on the longest batch."), "",
                  "| arch | twin | tokens/update | arch tokens/s | twin tokens/s | speed ratio | memory ratio |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        skipped = []
        for arch, r in report["training"].items():
            twin = PAIRS[arch][0]
            mem = report.get("memory", {}).get(arch)
            memory = "–"
            if mem:
                memory = (f"{mem['ratio']:.2f} ({mem[arch]['step_peak_mib']:.0f} vs "
                          f"{mem[twin]['step_peak_mib']:.0f} MiB")
                if cuda:
                    memory += f"; peak {mem[arch]['peak_mib']:.0f} vs {mem[twin]['peak_mib']:.0f} MiB"
                memory += ")"
            lines.append(
                f"| {arch} | {twin} | {r['tokens_per_update']} | {r['tokens_per_s'][arch]['median']:.0f} | "
                f"{r['tokens_per_s'][twin]['median']:.0f} | {fmt(r['ratio'])} | {memory} |")
            skipped += [f"{name} {n}" for name, n in r.get("skipped_updates", {}).items() if n]
        lines.append("")
        if skipped:
            lines += ["Updates skipped for an fp16 gradient overflow (warm-up included): "
                      + ", ".join(skipped) + ".", ""]
    if report.get("attention_paths"):
        lines += ["### Attention path each side ran (detected in one training forward and one decoding step)", "",
                  "fused: fairseq called `F.multi_head_attention_forward` (torch's fused attention; + SDPA: "
                  "it ran `F.scaled_dot_product_attention`); unfused: the attention computed its weights itself.", "",
                  "| model | training | decoding |", "| --- | --- | --- |"]
        for arch, sides in report["attention_paths"].items():
            for name, phases in sides.items():
                cells = ["; ".join(f"{role}: {path}" for role, path in phases.get(phase, {}).items()) or "–"
                         for phase in ("training", "decoding")]
                lines.append(f"| {name}{'' if name == arch else f' (twin of {arch})'} | {cells[0]} | {cells[1]} |")
        lines.append("")
    if report.get("generation"):
        lines += ["### Generation (fairseq SequenceGenerator, incremental, fixed output length)", "",
                  "| arch | vocab | beam | batch | arch sent/s | twin sent/s | speed ratio |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for arch, rows in report["generation"].items():
            twin = PAIRS[arch][0]
            for r in rows:
                lines.append(
                    f"| {arch} | {r['vocab']} | {r['beam']} | {r['batch']} | "
                    f"{r['sentences_per_s'][arch]['median']:.1f} | {r['sentences_per_s'][twin]['median']:.1f} | "
                    f"{fmt(r['ratio'])} |")
        lines.append("")
    if report.get("scaling"):
        steps = sorted({int(t) for v in report["scaling"].values() for t in v})
        lines += ["### One decoding step at prefix length t (ms)", "",
                  "| arch | " + " | ".join(f"t={t}" for t in steps) + " |",
                  "| --- |" + " --- |" * len(steps)]
        for arch, v in report["scaling"].items():
            v = {int(t): ms for t, ms in v.items()}  # JSON keeps the step numbers as strings
            lines.append(f"| {arch} | " + " | ".join(f"{v[t]:.2f}" for t in steps) + " |")
        lines.append("")
    for arch, p in report.get("profile", {}).items():
        lines += profile_markdown(arch, PAIRS[arch][0], p)
    return "\n".join(lines)


def profile_markdown(arch, twin, p) -> list:
    """The profile of ``arch`` and its twin: totals side by side, then each one's top rows."""
    phases = (("training", f"{p['updates']} training update{'s' * (p['updates'] != 1)} of {p['tokens_per_update']} tokens"),
              ("generation", f"one beam search, beam {p['beam']}, batch 1, {p['length']} tokens"))
    what = p[arch]["training"]["what"]
    lines = [f"### Where the time goes: {arch} vs {twin} (torch.profiler, {what}, self time)", "",
             "| phase | arch ms | twin ms | ratio | arch calls | twin calls | ratio |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for phase, label in phases:
        a, t = p[arch][phase], p[twin][phase]
        lines.append(f"| {label} | {a['total_ms']:.2f} | {t['total_ms']:.2f} | "
                     f"{a['total_ms'] / max(t['total_ms'], 1e-9):.2f} | {a['calls']} | {t['calls']} | "
                     f"{a['calls'] / max(t['calls'], 1):.2f} |")
    lines.append("")
    for phase, label in phases:
        for name in (arch, twin):
            rows = p[name][phase]["top"]
            lines += [f"{name}, {label}: top {len(rows)}", "", "| name | ms | share | calls |",
                      "| --- | --- | --- | --- |"]
            lines += [f"| {r['name'][:90].replace('|', '/')} | {r['ms']:.3f} | {100 * r['share']:.1f}% | "
                      f"{r['calls']} |" for r in rows]
            lines.append("")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"tiny settings ({QUICK_LAYERS}+{QUICK_LAYERS}-layer models): checks the pipeline, not speed")
    ap.add_argument("--only", nargs="+", choices=sorted(PAIRS), help="architectures to measure")
    ap.add_argument("--skip", nargs="+", default=[], choices=["training", "memory", "generation", "scaling"])
    ap.add_argument("--profile", action="store_true",
                    help="also profile each model and its twin (torch.profiler): the top 20 CUDA kernels "
                         "(on cuda) or operations (on cpu) by self time, over --profile-updates "
                         "training updates and over one beam search, with totals and call counts")
    ap.add_argument("--profile-updates", type=int, default=5, help="training updates profiled (default: 5)")
    ap.add_argument("--beams", nargs="+", type=int, help="beam sizes (default: 5 1)")
    ap.add_argument("--batch-sizes", nargs="+", type=int, help="generation batch sizes (default: 1 32 128)")
    ap.add_argument("--small-vocab", action="store_true", help="also generate with a 1k vocabulary")
    ap.add_argument("--training-repeats", type=int, default=9,
                    help="interleaved repeats of the training measurement")
    ap.add_argument("--generation-repeats", type=int, default=5,
                    help="interleaved repeats per generation cell (batch 1: twice this, plus one)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where models and batches live (default: cpu); on cuda, timers are read "
                         "after torch.cuda.synchronize() and memory is torch's peak CUDA allocation")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                    help="precision (default: fp32); fp16/bf16 train as fairseq's --fp16/--bf16 do "
                         "(cast model, float32 loss, FP16Optimizer with float32 master weights) and "
                         "generate with the cast model; both also run on CPU")
    ap.add_argument("--out", default=HERE,
                    help="output directory: benchmark.{json,md} for cpu fp32, "
                         "benchmark-<device>-<dtype>.{json,md} otherwise")
    ap.add_argument("--append", action="store_true",
                    help="merge into the report of the same device and dtype already in --out "
                         "(e.g. base-sized archs run separately)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--fairseq-reorder", action="store_true",
                    help="every decoder, the plugin's and the twins', reorders its caches with "
                         "fairseq's walk over all modules (default: both over a list made once per run)")
    ap.add_argument("--system-allocator", action="store_true",
                    help="leave glibc's allocator as it is (default: keep freed memory for reuse, "
                         "which removes page-fault noise from the timings; memory probes always leave it)")
    ap.add_argument("--memory-probe", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    import torch

    m = load_measurements()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device cuda: torch.cuda.is_available() is False here (torch {torch.__version__}, "
                 f"built for CUDA {torch.version.cuda}); run on a machine with an NVIDIA GPU and a "
                 "CUDA build of torch, or leave out --device for the CPU benchmark")
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_probe:
        probe = m.memory_probe(args.memory_probe, args.vocab, args.tokens, updates=2, dtype=args.dtype,
                                 layers=args.layers)
        print(json.dumps(probe))
        return
    kept = m.keep_freed_memory() if not args.system_allocator else False
    if args.fairseq_reorder:
        m.fairseq_speedups.use_fairseq_reorder()  # arch and twin alike

    quick = args.quick
    layers = QUICK_LAYERS if quick else None  # None: each arch's own depth
    archs = args.only or (["ea_transformer_lite", "ran_all_lite"] if quick else list(PAIRS))
    report = {"machine": {**m.machine(device, args.dtype), "freed_memory_kept": kept,
                          "fairseq_reorder": args.fairseq_reorder},
              "busy": busy_processes(),
              "attention_paths": {}, "training": {}, "memory": {},
              "generation": {}, "scaling": {}, "profile": {}}
    for arch in archs:
        twin, family = PAIRS[arch]
        vocab = 1000 if quick else VOCAB[family]
        tokens = 300 if quick else (4096 if family == "lite" else 2048)
        print(f"[bench] {arch} vs {twin} (vocab {vocab}, {args.device} {args.dtype})",
              file=sys.stderr, flush=True)
        on_device = {"device": device, "dtype": args.dtype, "layers": layers}
        report["attention_paths"][arch] = m.detect_attention_paths(arch, twin, vocab, **on_device)
        if "training" not in args.skip:
            report["training"][arch] = m.bench_training(arch, twin, vocab, tokens, updates=1,
                                                      repeats=2 if quick else args.training_repeats, **on_device)
        if "memory" not in args.skip:
            report["memory"][arch] = m.bench_memory(arch, twin, vocab, tokens, **on_device)
        if "generation" not in args.skip:
            rows = []
            vocabs = [vocab] if quick or not args.small_vocab else [vocab, 1000]
            for v in vocabs:
                rows += m.bench_generation(arch, twin, v, beams=args.beams or ([5] if quick else [5, 1]),
                                         batch_sizes=args.batch_sizes or ([1, 4] if quick else [1, 32, 128]),
                                         length=6 if quick else 25,
                                         repeats=1 if quick else args.generation_repeats, **on_device)
            report["generation"][arch] = rows
        if args.profile:
            report["profile"][arch] = m.profile_pair(arch, twin, vocab, tokens, updates=1 if quick else args.profile_updates,
                                                     beam=(args.beams or [5])[0], length=6 if quick else 25, **on_device)
    if "scaling" not in args.skip:
        scaled = [a for a in archs if a.startswith(("ea_transformer_lite", "ran_all_lite", "ran_d_lite"))]
        if scaled:
            steps = [8, 16] if quick else [8, 16, 32, 64, 128, 255]
            report["scaling"] = m.bench_scaling(scaled + [LITE_TWIN], 1000 if quick else VOCAB["lite"],
                                              steps, bsz=8 if quick else 40, repeats=1 if quick else 3,
                                              device=device, dtype=args.dtype, layers=layers)
    report["loadavg_end"] = os.getloadavg()
    os.makedirs(args.out, exist_ok=True)
    name = report_name(args.device, args.dtype)
    path = os.path.join(args.out, name + ".json")
    run = {"machine": report.pop("machine"), "busy": report.pop("busy"),
           "loadavg_end": report.pop("loadavg_end"), "archs": archs}
    report["runs"] = [run]
    if args.append and os.path.exists(path):
        with open(path) as f:
            earlier = json.load(f)
        mixed = sorted({setting(r) for r in earlier.get("runs", [])} - {(args.device, args.dtype)})
        if mixed:
            sys.exit(f"--append: {path} holds runs on {mixed}, not {args.device} {args.dtype}; "
                     "give another --out, or run without --append")
        for section in ("attention_paths", "training", "memory", "scaling", "profile"):
            report[section] = {**earlier.get(section, {}), **report[section]}
        generation = dict(earlier.get("generation", {}))
        for arch, rows in report["generation"].items():
            generation[arch] = merge_generation_rows(generation.get(arch, []), rows)
        report["generation"] = generation
        report["runs"] = earlier.get("runs", []) + [run]
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    md = markdown(report)
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
