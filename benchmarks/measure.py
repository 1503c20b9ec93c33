"""The measurements of benchmarks/benchmark.py (which parses the command line first, so that
``--help`` answers without importing torch): each architecture against its fairseq twin,
interleaved timings of training updates and beam search, memory peaks, attention paths,
profiles. What they run on (the models, their optimizers, the batches) is
benchmarks/workload.py."""
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from fairseq.sequence_generator import SequenceGenerator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # workload.py beside it, however this file is loaded
from workload import CPU, batch, build, keep_freed_memory, on, optimizer, place, synced, synchronizer  # noqa: E402,F401
from ea_fairseq.models import fairseq_speedups  # noqa: E402,F401  (benchmark.py's --fairseq-reorder switches it)

CLI = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmark.py")


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
                   device=CPU, dtype="fp32", layers=None):
    data = None
    fns, opts = {}, {}
    for name in (arch, twin):
        model, d = build(name, vocab, layers=layers)
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


def memory_probe(arch, vocab, tokens, updates, dtype="fp32", layers=None):
    """Peak resident-set growth of training ``arch`` (on CPU) in this (fresh) process, in MiB."""
    model, d = build(arch, vocab, layers=layers)
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


def cuda_memory_probe(arch, vocab, tokens, device, dtype="fp32", layers=None):
    """Peak CUDA memory of one training step of ``arch`` on the longest batch, in MiB:
    ``peak_mib`` all that is allocated at the step's peak (weights, optimizer state,
    activations), ``step_peak_mib`` its growth over what is allocated just before the step.
    Only this model is alive on the device meanwhile (nothing else of this process's is)."""
    gc.collect()
    torch.cuda.empty_cache()
    model, d = build(arch, vocab, layers=layers)
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


def bench_memory(arch, twin, vocab, tokens, device=CPU, dtype="fp32", layers=None):
    out = {}
    for name in (arch, twin):
        if device.type == "cuda":
            out[name] = cuda_memory_probe(name, vocab, tokens, device, dtype, layers)
            continue
        proc = subprocess.run(
            [sys.executable, CLI, "--memory-probe", name, "--vocab", str(vocab),
             "--tokens", str(tokens), "--dtype", dtype, *(["--layers", str(layers)] if layers else [])],
            capture_output=True, text=True, check=True,
        )
        out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**out, "ratio": out[arch]["step_peak_mib"] / max(out[twin]["step_peak_mib"], 1e-9)}


def bench_generation(arch, twin, vocab, beams, batch_sizes, length, repeats, device=CPU, dtype="fp32",
                     layers=None):
    results = []
    models = {}
    for name in (arch, twin):
        model, d = build(name, vocab, layers=layers)
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


def bench_scaling(archs, vocab, steps_at, bsz, repeats, device=CPU, dtype="fp32", layers=None):
    """Milliseconds of one incremental decoding step at prefix length t."""
    out = {}
    max_t = max(steps_at)
    sync = synchronizer(device)
    for name in archs:
        model, d = build(name, vocab, layers=layers)
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


def detect_attention_paths(arch, twin, vocab, device=CPU, dtype="fp32", layers=None):
    """:func:`attention_paths` of ``arch`` and its twin, as placed for this run."""
    paths = {}
    for name in (arch, twin):
        model, d = build(name, vocab, layers=layers)
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


# -- profile --------------------------------------------------------------------------------
def profile_table(events, device, top: int):
    """What ran on ``device``, from a torch.profiler ``key_averages()``: the kernels on CUDA
    (rows the GPU ran, with their self time on it), operations on CPU (aten's and the custom
    autograd functions', with their self CPU time); the ``top`` rows by time, and the totals
    over all rows."""
    from torch.autograd import DeviceType

    cuda = device.type == "cuda"
    rows = [e for e in events if not e.is_user_annotation
            and (e.device_type == DeviceType.CUDA if cuda else e.device_type == DeviceType.CPU)]
    timed = [(e.key, (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1000.0, e.count) for e in rows]
    timed = [r for r in timed if r[1] > 0 or not cuda]
    timed.sort(key=lambda r: -r[1])
    total_ms, calls = sum(r[1] for r in timed), sum(r[2] for r in timed)
    return {"what": "CUDA kernels" if cuda else "CPU operations", "total_ms": total_ms, "calls": calls,
            "top": [{"name": name, "ms": ms, "calls": n, "share": ms / total_ms if total_ms else 0.0}
                    for name, ms, n in timed[:top]]}


def profile_pair(arch, twin, vocab, tokens, updates, beam, length, device=CPU, dtype="fp32", top=20,
                 layers=None):
    """Where the time goes: torch.profiler over ``updates`` training updates (the middle
    length bucket, after one warm-up update) and over one beam search (batch 1, ``beam``,
    ``length`` tokens), for ``arch`` and its twin on the same batches."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = synchronizer(device)
    out = {}
    for name in (arch, twin):
        model, d = build(name, vocab, layers=layers)
        model = place(model, device, dtype)
        lo, hi = LENGTH_BUCKETS[1]
        data = on(device, batch(d, tokens, seed=0, lo=lo, hi=hi))
        model.train()
        opt = optimizer(model, device, dtype)
        train_step(model, opt, data, d.pad())  # warm-up: optimizer state, caches, autotuning
        sync()
        with profile(activities=activities) as prof:
            for _ in range(updates):
                train_step(model, opt, data, d.pad())
            sync()
        training = profile_table(prof.key_averages(), device, top)
        model.eval()
        src, lengths = on(device, batch(d, seed=1, lo=length, hi=length, sentences=1)[:2])
        gen = SequenceGenerator([model], d, beam_size=beam, max_len_a=0, max_len_b=length, min_len=length)
        sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}
        with torch.no_grad():
            gen.forward(sample)  # warm-up
            sync()
            with profile(activities=activities) as prof:
                gen.forward(sample)
                sync()
        out[name] = {"training": training, "generation": profile_table(prof.key_averages(), device, top)}
        del model, opt
    return {**out, "updates": updates, "tokens_per_update": int(data[3].ne(d.pad()).sum()), "beam": beam,
            "length": length}
