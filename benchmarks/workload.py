"""What benchmarks/measure.py runs its measurements on: each architecture and its fairseq twin
built as fairseq-train builds them, placed and cast as fairseq casts them for --fp16/--bf16,
their optimizers (fairseq's mixed-precision update where asked), batches of IWSLT-like
lengths, the device's synchronisation, and glibc's setting that keeps freed memory."""
from types import SimpleNamespace

import torch

from ea_fairseq.models import fairseq_speedups
from ea_fairseq.models.building import build_model

ADAM = {"lr": 1e-4, "betas": (0.9, 0.98)}
CPU = torch.device("cpu")


# -- building ---------------------------------------------------------------------------
def build(arch: str, vocab: int, seed: int = 1, layers=None):
    """``arch`` with a placeholder vocabulary (and ``layers`` encoder and decoder layers in
    place of its own, where given); a fairseq twin's decoder gets the plugin's beam-reorder
    bookkeeping too (``fairseq_speedups``), so ratios compare attention only."""
    depth = ("--encoder-layers", str(layers), "--decoder-layers", str(layers)) if layers else ()
    model, _ = build_model(arch, "--share-all-embeddings", *depth, vocab=vocab, seed=seed)
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
