"""Shared helpers: build plugin and fairseq models from command-line style arguments."""
import os
import sys

import pytest
import torch

from ea_fairseq import side_effects
from ea_fairseq.models import building
from ea_fairseq.models.building import parse_options as parse  # noqa: F401  (tests' shorthand)

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
TEST_VOCAB = 44  # the tests' small vocabulary: 40 words and fairseq's 4 special symbols

# The tests by subject, a folder each, none of them a package: pytest's default ("prepend")
# import mode imports a test file under its basename, its folder put on sys.path, as it does this
# file (tests/ on sys.path: the helpers are ``support.<module>``, these ``conftest``). Every
# subject folder is put there here, before any test module is imported, so that a test module
# that uses another's fixture or helper imports it by its basename whatever folder either is in
# (``from test_analysis import tiny_checkpoint``), and does so in a file run alone as in the whole
# suite. A test file's basename is therefore unique across tests/ (pytest refuses two files with
# one basename).
SUBJECTS = ("attention", "ops", "device", "cli", "recipes", "benchmarks", "safety")
for _subject in SUBJECTS:
    if os.path.join(TESTS, _subject) not in sys.path:
        sys.path.append(os.path.join(TESTS, _subject))

# At most two threads per test process, the cores shared among pytest-xdist's workers
# (scripts/test.sh runs one worker per core), and the same number for the fairseq-train,
# fairseq-generate and benchmark subprocesses the tests start: OpenMP threads of several
# processes on the same cores spin against each other, a test then takes ten times as long.
# Set, not defaulted (an exported OMP_NUM_THREADS is replaced too): pytest-xdist's controller
# imports this file as well (no worker count: all the cores) before it starts the workers,
# which inherit its environment.
THREADS = max(1, min(2, os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
torch.set_num_threads(THREADS)
os.environ["OMP_NUM_THREADS"] = str(THREADS)
# tests that run fairseq-train's main in their own process stop it mid-epoch, as the plugin's
# command lines do: its prefetch thread is stopped at exit instead of aborting the worker
side_effects.prefetching_finished_at_exit()


def device_under_test() -> torch.device:
    """``EA_FAIRSEQ_TEST_DEVICE`` (``cpu``, ``cuda``, ``cuda:1``, ...), by default CUDA where
    torch sees it and the CPU otherwise: the device suite and the decoding properties run there."""
    name = os.environ.get("EA_FAIRSEQ_TEST_DEVICE", "").strip() or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"EA_FAIRSEQ_TEST_DEVICE={name}, but torch {torch.__version__} sees no CUDA device; "
                           "unset it to test on the CPU")
    return device


DEVICE = device_under_test()
ON_CUDA = DEVICE.type == "cuda"


def make_dictionary(size: int = TEST_VOCAB):
    return building.placeholder_dictionary(size)


def build_model(arch: str, *extra: str, seed: int = 1, dictionary=None):
    """Build ``arch`` the way fairseq-train does (options parser, arch defaults, task dicts)."""
    return building.build_model(arch, *extra, seed=seed, dictionary=dictionary or make_dictionary())


def random_batch(dictionary, src_lengths, tgt_len, seed=0, left_pad=True, device="cpu"):
    """A left-padded source batch and right-aligned target prefixes, as fairseq builds them
    (drawn on the CPU, so every ``device`` gets the same tokens)."""
    g = torch.Generator().manual_seed(seed)
    pad, eos, nspecial = dictionary.pad(), dictionary.eos(), dictionary.nspecial
    bsz, max_len = len(src_lengths), max(src_lengths)
    src = torch.full((bsz, max_len), pad, dtype=torch.long)
    for i, n in enumerate(src_lengths):
        toks = torch.randint(nspecial, len(dictionary), (n - 1,), generator=g)
        row = torch.cat([toks, torch.tensor([eos])])
        if left_pad:
            src[i, max_len - n:] = row
        else:
            src[i, :n] = row
    prev = torch.randint(nspecial, len(dictionary), (bsz, tgt_len), generator=g)
    prev[:, 0] = eos
    return src.to(device), torch.tensor(src_lengths).to(device), prev.to(device)


@pytest.fixture(scope="session", autouse=True)
def cpu_accelerators_built():
    """The CPU backend's C++ extension, built ahead (``python -m ea_ops.build``, which
    scripts/test.sh runs; here where a checkout has none yet: a test setup, never a forward
    pass) and loaded once before the first test, so that no test's duration includes either."""
    from ea_ops import build, library

    if library.library_path() is None:
        try:
            build.build()
        except build.BuildError:
            pass  # no compiler: the reference runs, and the tests that need the extension say so
    return library.extension()


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny models (``pytestmark = pytest.mark.usefixtures("one_thread")``): on
    a CPU a second thread costs more in synchronisation than it saves, and on a busy machine
    spins for most of a test's CPU time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def dictionary():
    return make_dictionary()


def cli(name: str) -> str:
    """A fairseq console script of the environment running the tests."""
    return os.path.join(os.path.dirname(sys.executable), name)


def write_synthetic_corpus(directory: str, sizes=(("train", 400), ("valid", 40), ("test", 24)), seed=0):
    """A learnable toy translation task: the target is the reversed source with a
    fixed word mapping, so a few hundred updates already give BLEU well above zero."""
    import random

    rng = random.Random(seed)
    words = [f"s{i}" for i in range(50)]
    for split, n in sizes:
        with open(os.path.join(directory, f"{split}.src"), "w") as fs, \
                open(os.path.join(directory, f"{split}.tgt"), "w") as ft:
            for _ in range(n):
                sent = [rng.choice(words) for _ in range(rng.randint(3, 10))]
                fs.write(" ".join(sent) + "\n")
                ft.write(" ".join("t" + w[1:] for w in reversed(sent)) + "\n")


@pytest.fixture(scope="session")
def tiny_data_bin(tmp_path_factory):
    """The synthetic corpus binarized by fairseq-preprocess's ``main``, in this process (as the
    recipes' examples/translation/binarize.py runs it; fairseq is imported here already)."""
    from fairseq import options
    from fairseq_cli import preprocess

    raw = str(tmp_path_factory.mktemp("raw"))
    write_synthetic_corpus(raw)
    dest = os.path.join(raw, "bin")
    args = options.get_preprocessing_parser().parse_args(
        ["--source-lang", "src", "--target-lang", "tgt",
         "--trainpref", f"{raw}/train", "--validpref", f"{raw}/valid", "--testpref", f"{raw}/test",
         "--destdir", dest, "--joined-dictionary", "--workers", "1"])
    before = list(preprocess.logger.handlers)
    try:
        preprocess.main(args)
    finally:  # its DESTDIR/preprocess.log handler, closed
        for handler in list(preprocess.logger.handlers):
            if handler not in before:
                preprocess.logger.removeHandler(handler)
                handler.close()
    return dest


def decoder_out(model, src, src_lengths, prev):
    model.eval()
    with torch.no_grad():
        return model(src, src_lengths, prev)[0]


def incremental_logprobs(model, src, lengths, prev, reorder_at=None, new_order=None, grad=False):
    """Step through ``prev`` one token at a time; optionally reorder the beams once (or,
    with a list of orders, several times in a row before the next step).

    ``grad=True`` decodes with autograd on, which keeps mechanisms off their
    decoding-only shortcuts (e.g. RAN's precomputed step weights)."""
    model.eval()
    with torch.set_grad_enabled(grad):
        enc = model.encoder(src, src_lengths=lengths)
        state = {}
        steps = []
        for t in range(prev.size(1)):
            if reorder_at is not None and t == reorder_at:
                for order in new_order if isinstance(new_order, list) else [new_order]:
                    model.decoder.reorder_incremental_state_scripting(state, order)
                    enc = model.encoder.reorder_encoder_out(enc, order)
                    prev = prev.index_select(0, order)
                    steps = [s.index_select(0, order) for s in steps]
            out, _ = model.decoder(prev[:, : t + 1], encoder_out=enc, incremental_state=state)
            steps.append(out[:, -1])
    return torch.stack(steps, dim=1), prev


def beam_reorder_gap(model, dictionary, new_order, device="cpu") -> float:
    """Two sentences x two beams; reorder mid-sentence like SequenceGenerator (within a
    sentence, or dropping a finished sentence; a list of orders: several reorders before
    one step) and return the largest difference between the incremental steps and a full
    pass over the reordered prefixes."""
    src, lengths, _ = random_batch(dictionary, [5, 9], 8, device=device)
    src, lengths = src.repeat_interleave(2, 0), lengths.repeat_interleave(2, 0)
    _, _, prev = random_batch(dictionary, [5, 9, 5, 9], 8, seed=7, device=device)
    orders = [torch.tensor(o, device=device) for o in (new_order if isinstance(new_order[0], list) else [new_order])]
    model.decoder.set_beam_size(2)
    steps, prev_reordered = incremental_logprobs(model, src, lengths, prev, 4, orders)
    model.decoder.set_beam_size(1)
    for order in orders:
        src, lengths = src.index_select(0, order), lengths.index_select(0, order)
    full = decoder_out(model, src, lengths, prev_reordered)
    return (steps - full).abs().max().item()


def causality_gap(model, dictionary, t: int, device="cpu"):
    """(largest change before t, largest change at t) when target tokens >= t change."""
    src, lengths, prev = random_batch(dictionary, [6, 8], 10, device=device)
    base = decoder_out(model, src, lengths, prev)
    changed = prev.clone()
    changed[:, t:] = (changed[:, t:] + 1 - 4) % (len(dictionary) - 4) + 4
    out = decoder_out(model, src, lengths, changed)
    return (out[:, :t] - base[:, :t]).abs().max().item(), (out[:, t] - base[:, t]).abs().max().item()


def batch_invariance_gap(model, dictionary, device="cpu", left_pad=True) -> float:
    """Largest difference between sentences decoded alone and inside a batch whose sources
    are left-padded (fairseq's default) or right-padded (``--left-pad-source False``)."""
    src, lengths, prev = random_batch(dictionary, [4, 11, 8], 7, left_pad=left_pad, device=device)
    batch = decoder_out(model, src, lengths, prev)
    gaps = []
    for i, n in enumerate(lengths.tolist()):
        alone_src = src[i : i + 1, -n:] if left_pad else src[i : i + 1, :n]
        alone = decoder_out(model, alone_src, lengths[i : i + 1], prev[i : i + 1])
        gaps.append((alone - batch[i : i + 1]).abs().max().item())
    return max(gaps)


def assert_decodes_consistently(model, dictionary, gap: float) -> None:
    """Causal (a later target token moves nothing before it, and does move its own
    position), incremental decoding with two beam-reorder patterns equal to the full pass,
    and a sentence alone equal to it in a left-padded batch, all within ``gap``."""
    before, at = causality_gap(model, dictionary, 4)
    assert before == 0.0 and at > 1e-3
    assert beam_reorder_gap(model, dictionary, [1, 1, 3, 2]) <= gap
    assert beam_reorder_gap(model, dictionary, [3, 2]) <= gap
    assert batch_invariance_gap(model, dictionary) <= gap


def cpu_autocast_supports(dtype) -> bool:
    """Whether CPU autocast runs matmuls in ``dtype`` (an unsupported dtype only warns
    and leaves autocast off)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.autocast("cpu", dtype=dtype):
                return (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == dtype
        except RuntimeError:
            return False


# The files that run real commands end to end, heaviest first. scripts/test.sh runs each file
# in one xdist worker (--dist loadfile) and hands out the files in collection order
# (--no-loadscope-reorder; xdist's default order, most tests first, leaves these files with few
# long tests to the end, where one worker runs them while the other idles): these go first, so
# the workers finish together. An order only: a file missing here runs after them, as collected.
HEAVY_FIRST = (
    "test_hydra.py", "test_quality_benchmark.py", "test_recipe_iwslt14.py", "test_benchmark.py",
    "test_cli_end_to_end.py", "test_recipes.py", "test_trainer_checkpoints.py", "test_safe_loading.py",
    "test_decoding_properties.py", "test_recipe_walk_through.py", "test_device_fp16.py", "test_analysis.py",
    "test_recipe_wmt14.py", "test_tools_quiet.py", "test_archives.py", "test_figures.py",
    "test_checkpoint_schema.py", "test_recipe_cpu_feedback.py", "test_ran_precision.py", "test_warm_start.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    order = {id(item): n for n, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(os.path.basename(str(item.path)), len(rank)), order[id(item)]))
