#!/usr/bin/env python3
"""Speed and memory of every architecture against its fairseq twin, side by side in one run.

    python benchmarks/benchmark.py                    # full run (about 15 min on 2 cores)
    python benchmarks/benchmark.py --quick            # small smoke run
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
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from fairseq.sequence_generator import SequenceGenerator

from ea_fairseq.models import fairseq_speedups
from ea_fairseq.models.building import build_model

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
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ADAM = {"lr": 1e-4, "betas": (0.9, 0.98)}
CPU = torch.device("cpu")


# -- building ---------------------------------------------------------------------------
def build(arch: str, vocab: int, seed: int = 1):
    """``arch`` with a placeholder vocabulary; a fairseq twin's decoder gets the plugin's
    beam-reorder bookkeeping too (``fairseq_speedups``), so ratios compare attention only."""
    model, _ = build_model(arch, "--share-all-embeddings", vocab=vocab, seed=seed)
    if not isinstance(model.decoder, fairseq_speedups.ListedStateHolders):
        fairseq_speedups.list_state_holders(model.decoder)
    return model, model.encoder.dictionary


def place(model, device=CPU, dtype="fp32"):
    """The model cast as fairseq's trainer and fairseq-generate cast it for ``--fp16`` /
    ``--bf16`` (``model.half()`` / ``model.bfloat16()``), then moved to ``device``."""
    if dtype == "fp16":
        model = model.half()
    elif dtype == "bf16":
        model = model.bfloat16()
    return model.to(device)


def on(device, tensors):
    """The tensors of a batch (token ids and lengths: never cast) on ``device``."""
    return tuple(t.to(device) for t in tensors)


def synchronizer(device):
    """What a timed callable runs last so that the timer read after it covers the work it
    queued: ``torch.cuda.synchronize`` on CUDA; nothing on CPU, whose work is done on return."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def synced(fn, device):
    """``fn`` followed by the device's synchronisation (``fn`` itself on CPU)."""
    if device.type != "cuda":
        return fn
    sync = synchronizer(device)

    def run():
        fn()
        sync()

    return run


def mixed_precision_optimizer(params, dtype, device):
    """fairseq's ``FP16Optimizer`` over the fp16/bf16 ``params``, as ``--fp16``/``--bf16``
    build it (configuration: fairseq's defaults, one worker, no update frequency), with
    torch's Adam on the float32 master weights (the optimizer of the float32 path).

    fairseq keeps one flat master tensor for ``--fp16``, but flattening asks for the current
    CUDA device, so on CPU the copy is per parameter (``--fp16-no-flatten-grads``), as it is
    for ``--bf16`` everywhere. fp16 gets fairseq's dynamic loss scaler; bf16 none."""
    from fairseq.dataclass.configs import CommonConfig, DistributedTrainingConfig, OptimizationConfig
    from fairseq.optim import FairseqOptimizer
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    class TorchAdam(FairseqOptimizer):
        supports_flat_params = True  # one flat tensor is a parameter like any other

        def __init__(self, fp32_params):
            super().__init__(SimpleNamespace())
            self._optimizer = torch.optim.Adam(fp32_params, **ADAM)

    params = [p for p in params if p.requires_grad]
    flatten = dtype == "fp16" and device.type == "cuda"
    fp32_params = FP16Optimizer.build_fp32_params(SimpleNamespace(), params, flatten=flatten)
    inner = TorchAdam(list(fp32_params.values()) if flatten else fp32_params)
    cfg = SimpleNamespace(optimizer=SimpleNamespace(),
                          common=CommonConfig(fp16=dtype == "fp16", bf16=dtype == "bf16"),
                          optimization=OptimizationConfig(),
                          distributed_training=DistributedTrainingConfig(distributed_world_size=1))
    opt = FP16Optimizer(cfg, params, inner, fp32_params)
    opt.skipped_updates = 0
    return opt


def optimizer(model, device=CPU, dtype="fp32"):
    """Adam for a float32 model; fairseq's mixed-precision optimizer around it otherwise."""
    if dtype == "fp32":
        return torch.optim.Adam(model.parameters(), **ADAM)
    return mixed_precision_optimizer(model.parameters(), dtype, device)


def batch(d, tokens: int = 0, seed: int = 0, lo: int = 10, hi: int = 40, sentences: int = 0):
    """Sentences of IWSLT-like lengths, left-padded: ``sentences`` of them, or as many as
    make up ``tokens`` source tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while (len(lengths) < sentences) if sentences else (sum(lengths) < tokens):
        lengths.append(int(torch.randint(lo, hi + 1, (1,), generator=g)))
    bsz, width = len(lengths), max(lengths)
    src = torch.full((bsz, width), d.pad(), dtype=torch.long)
    tgt = torch.full((bsz, width + 1), d.pad(), dtype=torch.long)
    prev = torch.full((bsz, width + 1), d.pad(), dtype=torch.long)
    for i, n in enumerate(lengths):
        s = torch.randint(d.nspecial, len(d), (n,), generator=g)
        src[i, width - n:] = s
        t = torch.randint(d.nspecial, len(d), (n,), generator=g)
        tgt[i, :n], tgt[i, n] = t, d.eos()
        prev[i, 0], prev[i, 1 : n + 1] = d.eos(), t
    return src, torch.tensor(lengths), prev, tgt


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of returning it to the OS.

    By default every block above 32 MiB (the vocabulary-sized loss tensors) is unmapped
    when freed and page-faulted back, zeroed, on the next update: measured here, that
    is a third of a CPU training step's time and most of its run-to-run spread. Kept,
    both models are timed on their computation (which, if anything, makes a mechanism's
    own overhead a larger share). Returns whether the setting took (glibc only).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
        ok = libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 40)
        return bool(ok and libc.mallopt(m_top_pad, 1 << 28))
    except (OSError, AttributeError, TypeError):
        return False


# -- measurements -----------------------------------------------------------------------
def train_step(model, opt, data, pad):
    """One update. With fairseq's mixed-precision optimizer, the update fairseq's trainer
    makes: the loss scaled in backward, the gradient norm taken (which copies the gradients
    to the float32 master weights and checks them for overflow), then the step; an update
    whose gradients overflow is skipped (and counted), the loss scale lowered."""
    src, lengths, prev, tgt = data
    mixed = hasattr(opt, "fp32_optimizer")
    if mixed:
        opt.zero_grad()
    else:
        opt.zero_grad(set_to_none=True)
    logits = model(src, lengths, prev)[0]
    lprobs = F.log_softmax(logits.float(), dim=-1).view(-1, logits.size(-1))
    target = tgt.view(-1)
    keep = target.ne(pad)
    nll = -lprobs.gather(1, target.unsqueeze(1)).squeeze(1)
    smooth = -lprobs.mean(dim=-1)
    loss = (0.9 * nll + 0.1 * smooth)[keep].sum()
    if not mixed:
        loss.backward()
        opt.step()
        return
    opt.backward(loss)
    try:
        opt.clip_grad_norm(0.0)  # max_norm 0: no clipping, as fairseq's default --clip-norm
    except OverflowError:
        opt.zero_grad()
        opt.skipped_updates += 1
        return
    opt.step()


def interleaved(fns: dict, repeats: int, warmup: int = 1):
    """Run each callable ``repeats`` times, interleaved; seconds per run, by name.

    The order alternates between repeats (A B, B A, ...), so that neither side always runs
    first: what one run leaves behind (caches, the allocator, the machine's drift) then
    falls on both alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {k: [] for k in fns}
    for r in range(repeats):
        order = list(fns.items())
        for k, fn in order if r % 2 == 0 else reversed(order):
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times


def summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def ratio_to_twin(times, arch, twin):
    """Speed ratios (twin's time / arch's time) of the interleaved repeats, summarised."""
    return summary([t_twin / t_arch for t_arch, t_twin in zip(times[arch], times[twin])])


# fairseq batches sentences of similar length (its batch_by_size walks length-sorted
# indices), so a training batch has little padding; these source/target length ranges
# stand for the short, middle and long batches of an IWSLT-like epoch.
LENGTH_BUCKETS = ((10, 13), (22, 25), (34, 37))


def bench_training(arch, twin, vocab, tokens, updates, repeats, buckets=LENGTH_BUCKETS,
                   device=CPU, dtype="fp32"):
    data = None
    fns, opts = {}, {}
    for name in (arch, twin):
        model, d = build(name, vocab)
        model = place(model, device, dtype)
        model.train()
        opts[name] = opt = optimizer(model, device, dtype)
        if data is None:  # the same batches for both models
            data = [batch(d, tokens, seed=i, lo=lo, hi=hi) for i, (lo, hi) in enumerate(buckets)]
            tok = sum(int(b[3].ne(d.pad()).sum()) for b in data)
            data = [on(device, b) for b in data]

        def run(model=model, opt=opt, pad=d.pad()):
            for _ in range(updates):
                for b in data:
                    train_step(model, opt, b, pad)

        fns[name] = synced(run, device)
    times = interleaved(fns, repeats)
    per = {k: summary([tok * updates / t for t in v]) for k, v in times.items()}
    out = {"tokens_per_update": tok // len(data), "batches": [list(b) for b in buckets],
           "tokens_per_s": per, "ratio": ratio_to_twin(times, arch, twin)}
    if dtype != "fp32":  # updates skipped for an fp16 overflow (warm-up included)
        out["skipped_updates"] = {k: opt.skipped_updates for k, opt in opts.items()}
    return out


def memory_probe(arch, vocab, tokens, updates, dtype="fp32"):
    """Peak resident-set growth of training ``arch`` (on CPU) in this (fresh) process, in MiB."""
    model, d = build(arch, vocab)
    model = place(model, CPU, dtype)
    model.train()
    opt = optimizer(model, CPU, dtype)
    lo, hi = LENGTH_BUCKETS[-1]  # the longest batches set the peak
    data = batch(d, tokens, lo=lo, hi=hi)
    train_step(model, opt, data, d.pad())  # allocate optimizer state before the baseline
    gc.collect()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open("/proc/self/statm") as f:
        rss_now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    for _ in range(updates):
        train_step(model, opt, data, d.pad())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_mib": peak / 1024, "step_peak_mib": (peak - min(base, rss_now)) / 1024}


def cuda_memory_probe(arch, vocab, tokens, device, dtype="fp32"):
    """Peak CUDA memory of one training step of ``arch`` on the longest batch, in MiB:
    ``peak_mib`` all that is allocated at the step's peak (weights, optimizer state,
    activations), ``step_peak_mib`` its growth over what is allocated just before the step.
    Only this model is alive on the device meanwhile (nothing else of this process's is)."""
    gc.collect()
    torch.cuda.empty_cache()
    model, d = build(arch, vocab)
    model = place(model, device, dtype)
    model.train()
    opt = optimizer(model, device, dtype)
    lo, hi = LENGTH_BUCKETS[-1]  # the longest batches set the peak
    data = on(device, batch(d, tokens, lo=lo, hi=hi))
    # allocate optimizer state before the baseline: until an update is made (an fp16
    # overflow skips one, and with it the allocation)
    for _ in range(8):
        skipped = getattr(opt, "skipped_updates", 0)
        train_step(model, opt, data, d.pad())
        if getattr(opt, "skipped_updates", 0) == skipped:
            break
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    train_step(model, opt, data, d.pad())
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del model, opt, data
    gc.collect()
    torch.cuda.empty_cache()
    return {"peak_mib": peak / 2**20, "step_peak_mib": (peak - base) / 2**20}


def bench_memory(arch, twin, vocab, tokens, device=CPU, dtype="fp32"):
    out = {}
    for name in (arch, twin):
        if device.type == "cuda":
            out[name] = cuda_memory_probe(name, vocab, tokens, device, dtype)
            continue
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--memory-probe", name, "--vocab", str(vocab),
             "--tokens", str(tokens), "--dtype", dtype],
            capture_output=True, text=True, check=True,
        )
        out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**out, "ratio": out[arch]["step_peak_mib"] / max(out[twin]["step_peak_mib"], 1e-9)}


def bench_generation(arch, twin, vocab, beams, batch_sizes, length, repeats, device=CPU, dtype="fp32"):
    results = []
    models = {}
    for name in (arch, twin):
        model, d = build(name, vocab)
        models[name] = place(model, device, dtype), d
    for beam in beams:
        for bsz in batch_sizes:
            n_sent = max(bsz, 8)
            fns = {}
            for name, (model, d) in models.items():
                model.eval()
                src, lengths = on(device, batch(d, seed=1, lo=length, hi=length, sentences=n_sent)[:2])
                gen = SequenceGenerator([model], d, beam_size=beam, max_len_a=0, max_len_b=length,
                                        min_len=length)

                def run(gen=gen, src=src, lengths=lengths, bsz=bsz):
                    with torch.no_grad():
                        for i in range(0, src.size(0), bsz):
                            gen.forward({"net_input": {"src_tokens": src[i : i + bsz],
                                                       "src_lengths": lengths[i : i + bsz]}})

                fns[name] = synced(run, device)
            # one sentence at a time: short runs, the noisiest; twice the repeats and one more
            times = interleaved(fns, repeats if bsz > 1 else 2 * repeats + 1)
            results.append({
                "beam": beam, "batch": bsz, "sentences": n_sent, "vocab": vocab,
                "sentences_per_s": {k: summary([n_sent / t for t in v]) for k, v in times.items()},
                "ratio": ratio_to_twin(times, arch, twin),
            })
    return results


def bench_scaling(archs, vocab, steps_at, bsz, repeats, device=CPU, dtype="fp32"):
    """Milliseconds of one incremental decoding step at prefix length t."""
    out = {}
    max_t = max(steps_at)
    sync = synchronizer(device)
    for name in archs:
        model, d = build(name, vocab)
        model = place(model, device, dtype)
        model.eval()
        src, lengths = on(device, batch(d, seed=2, lo=20, hi=20, sentences=bsz)[:2])
        per_t = {t: [] for t in steps_at}
        with torch.no_grad():
            enc = model.encoder(src, src_lengths=lengths)
            for _ in range(repeats):
                state = {}
                prev = torch.full((bsz, 1), d.eos(), dtype=torch.long, device=device)
                for t in range(max_t + 1):
                    sync()  # the previous step's argmax and concatenation are not timed
                    t0 = time.perf_counter()
                    logits, _ = model.decoder(prev, encoder_out=enc, incremental_state=state)
                    sync()
                    dt = time.perf_counter() - t0
                    if t in per_t:
                        per_t[t].append(dt * 1000)
                    nxt = logits[:, -1].argmax(-1, keepdim=True)
                    prev = torch.cat([prev, nxt], dim=1)
        out[name] = {t: statistics.median(v) for t, v in per_t.items()}
    return out


# -- attention paths ------------------------------------------------------------------------
ROLES = (("encoder", "self_attn", "encoder self"), ("decoder", "self_attn", "decoder self"),
         ("decoder", "encoder_attn", "decoder cross"))


def attention_paths(model, data, device):
    """Which implementation each attention ran, detected in one training forward (train
    mode, autograd on, as in an update) and one incremental decoding step: per role
    (encoder self, decoder self, decoder cross), ``fused`` where every layer's attention went
    through ``F.multi_head_attention_forward`` (fairseq's call into torch's fused attention;
    ``+ SDPA`` where that ran ``F.scaled_dot_product_attention``), ``unfused`` where none
    did (the attention computed its weights itself), ``mixed`` otherwise."""
    src, lengths, prev, _ = data
    active, seen = [], {}  # the attention running now; (role, path) -> calls
    roles = {}
    for stack_name, slot, role in ROLES:
        for layer in getattr(getattr(model, stack_name), "layers", ()):
            module = getattr(layer, slot, None)
            if module is not None:
                roles[module] = role

    def enter(module, args):
        active.append(module)
        seen.setdefault(roles[module], {"calls": 0, "fused": 0, "sdpa": 0})["calls"] += 1

    def leave(module, args, output):
        active.pop()

    def counting(name, original):
        def counted(*args, **kwargs):
            if active:
                seen[roles[active[-1]]][name] += 1
            return original(*args, **kwargs)
        return counted

    patched = {"multi_head_attention_forward": "fused", "scaled_dot_product_attention": "sdpa"}
    originals = {fn: getattr(F, fn) for fn in patched}
    handles = [h for m in roles for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    out = {}
    try:
        for fn, key in patched.items():
            setattr(F, fn, counting(key, originals[fn]))
        model.train()
        model(src, lengths, prev)
        out["training"], seen = dict(seen), {}
        model.eval()
        with torch.no_grad():
            encoder_out = model.encoder(src, src_lengths=lengths)
            model.decoder(prev[:, :1], encoder_out=encoder_out, incremental_state={})
        out["decoding"] = dict(seen)
    finally:
        for fn, original in originals.items():
            setattr(F, fn, original)
        for h in handles:
            h.remove()

    def verdict(counts):
        if counts["fused"] == 0:
            return "unfused"
        path = "fused" + (" + SDPA" if counts["sdpa"] == counts["fused"] else "")
        return path if counts["fused"] == counts["calls"] else f"mixed ({counts['fused']}/{counts['calls']} fused)"

    return {phase: {role: verdict(c) for role, c in roles_seen.items()} for phase, roles_seen in out.items()}


def detect_attention_paths(arch, twin, vocab, device=CPU, dtype="fp32"):
    """:func:`attention_paths` of ``arch`` and its twin, as placed for this run."""
    paths = {}
    for name in (arch, twin):
        model, d = build(name, vocab)
        model = place(model, device, dtype)
        data = on(device, batch(d, sentences=4, lo=10, hi=13, seed=0))
        paths[name] = attention_paths(model, data, device)
        del model
    return paths


# -- reporting --------------------------------------------------------------------------
def machine(device=CPU, dtype="fp32"):
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    out = {
        "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
        "device": device.type, "dtype": dtype, "cuda": torch.version.cuda,
    }
    if device.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(device)
        out["cudnn"] = torch.backends.cudnn.version()
        out["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    return out


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
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny settings: checks the pipeline, not speed")
    ap.add_argument("--only", nargs="+", choices=sorted(PAIRS), help="architectures to measure")
    ap.add_argument("--skip", nargs="+", default=[], choices=["training", "memory", "generation", "scaling"])
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
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device cuda: torch.cuda.is_available() is False here (torch {torch.__version__}, "
                 f"built for CUDA {torch.version.cuda}); run on a machine with an NVIDIA GPU and a "
                 "CUDA build of torch, or leave out --device for the CPU benchmark")
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_probe:
        probe = memory_probe(args.memory_probe, args.vocab, args.tokens, updates=2, dtype=args.dtype)
        print(json.dumps(probe))
        return
    kept = keep_freed_memory() if not args.system_allocator else False
    if args.fairseq_reorder:
        fairseq_speedups.use_fairseq_reorder()  # arch and twin alike

    quick = args.quick
    archs = args.only or (["ea_transformer_lite", "ran_all_lite"] if quick else list(PAIRS))
    report = {"machine": {**machine(device, args.dtype), "freed_memory_kept": kept,
                          "fairseq_reorder": args.fairseq_reorder},
              "busy": busy_processes(),
              "attention_paths": {}, "training": {}, "memory": {},
              "generation": {}, "scaling": {}}
    for arch in archs:
        twin, family = PAIRS[arch]
        vocab = 1000 if quick else VOCAB[family]
        tokens = 300 if quick else (4096 if family == "lite" else 2048)
        print(f"[bench] {arch} vs {twin} (vocab {vocab}, {args.device} {args.dtype})",
              file=sys.stderr, flush=True)
        on_device = {"device": device, "dtype": args.dtype}
        report["attention_paths"][arch] = detect_attention_paths(arch, twin, vocab, **on_device)
        if "training" not in args.skip:
            report["training"][arch] = bench_training(arch, twin, vocab, tokens, updates=1,
                                                      repeats=2 if quick else args.training_repeats, **on_device)
        if "memory" not in args.skip:
            report["memory"][arch] = bench_memory(arch, twin, vocab, tokens, **on_device)
        if "generation" not in args.skip:
            rows = []
            vocabs = [vocab] if quick or not args.small_vocab else [vocab, 1000]
            for v in vocabs:
                rows += bench_generation(arch, twin, v, beams=args.beams or ([5] if quick else [5, 1]),
                                         batch_sizes=args.batch_sizes or ([1, 4] if quick else [1, 32, 128]),
                                         length=6 if quick else 25,
                                         repeats=1 if quick else args.generation_repeats, **on_device)
            report["generation"][arch] = rows
    if "scaling" not in args.skip:
        scaled = [a for a in archs if a.startswith(("ea_transformer_lite", "ran_all_lite", "ran_d_lite"))]
        if scaled:
            steps = [8, 16] if quick else [8, 16, 32, 64, 128, 255]
            report["scaling"] = bench_scaling(scaled + [LITE_TWIN], 1000 if quick else VOCAB["lite"],
                                              steps, bsz=8 if quick else 40, repeats=1 if quick else 3,
                                              device=device, dtype=args.dtype)
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
        for section in ("attention_paths", "training", "memory", "scaling"):
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
