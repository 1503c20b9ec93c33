"""Checkpoints loaded on several threads at once: each thread gets its own file's state.

fairseq's ``load_checkpoint_to_cpu`` reads a checkpoint through the plugin's loader, whose
state reaches fairseq's own code through the module ``torch`` it calls (there is no hook on
that path), and reading a file needs torch's allow-list (one per process) and omegaconf's
interpolation gate. Two different checkpoints are loaded through fairseq's real function on
two threads released together by a barrier, many rounds, free-running and with both loads
forced to be inside fairseq's function at the same time; the negative control runs the same
rounds with the state handed over through a module global swapped for the duration of each
call, and the harness finds the loads crossed."""
import os
import threading

import pytest
import torch
from fairseq import checkpoint_utils
from omegaconf import OmegaConf
from omegaconf.base import Container

from ea_fairseq.safety.no_code import checkpoint_globals_allowed, hook, load_checkpoint, reading

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "checkpoints")

ROUNDS = 25  # free-running; the rounds that force both loads into fairseq's function together: 10


@pytest.fixture(scope="module")
def two():
    """Two checkpoints of different families (EA and PA, written by ``fairseq-train``) and the
    state each loads as when it is loaded alone."""
    paths = [os.path.join(FIXTURES, family, "checkpoint.pt") for family in ("ea", "pa")]
    return paths, {path: checkpoint_utils.load_checkpoint_to_cpu(path) for path in paths}


def same(state, expected) -> bool:
    return (state["cfg"]["model"].arch == expected["cfg"]["model"].arch
            and state["model"].keys() == expected["model"].keys()
            and all(torch.equal(value, expected["model"][key]) for key, value in state["model"].items()))


def crossed_loads(load, paths, expected, rounds=ROUNDS):
    """Run ``load(path)`` for each path on its own thread, all released together, ``rounds``
    times; the (round, path, what came back) of every load that did not return its own file's
    state (an exception counts as crossed too)."""
    start = threading.Barrier(len(paths))
    wrong = []

    def worker(path):
        for round_ in range(rounds):
            start.wait(timeout=60)
            try:
                state = load(path)
            except Exception as err:  # noqa: BLE001  (a crossed load may also fail)
                wrong.append((round_, path, repr(err)[:200]))
                continue
            if not same(state, expected[path]):
                wrong.append((round_, path, state["cfg"]["model"].arch))

    threads = [threading.Thread(target=worker, args=(path,)) for path in paths]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not any(thread.is_alive() for thread in threads)
    return wrong


def test_the_two_checkpoints_differ(two):
    paths, expected = two
    assert not same(expected[paths[0]], expected[paths[1]])
    assert expected[paths[0]]["cfg"]["model"].arch != expected[paths[1]]["cfg"]["model"].arch


def test_two_threads_each_load_their_own_checkpoint(two):
    paths, expected = two
    assert crossed_loads(checkpoint_utils.load_checkpoint_to_cpu, paths, expected) == []


def test_loads_inside_fairseqs_function_at_the_same_time_stay_apart(two, monkeypatch):
    """Both threads hold their sanitized state and are inside fairseq's function when either
    asks torch for it (they meet there each round)."""
    paths, expected = two
    meet = threading.Barrier(len(paths))
    real = hook._TorchForCheckpointUtils.load

    def load_after_meeting(self, *args, **kwargs):
        if getattr(hook._pending, "states", None):
            meet.wait(timeout=60)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(hook._TorchForCheckpointUtils, "load", load_after_meeting)
    assert crossed_loads(checkpoint_utils.load_checkpoint_to_cpu, paths, expected, rounds=10) == []
    assert meet.n_waiting == 0 and not meet.broken


def test_negative_control_a_module_global_swapped_per_call_crosses_the_loads(two, monkeypatch):
    """The harness detects crossed loads: fairseq's same function, handed the sanitized state
    through ``checkpoint_utils.torch`` swapped for the duration of each call."""
    paths, expected = two
    original = checkpoint_utils.load_checkpoint_to_cpu.__wrapped__
    monkeypatch.setattr(checkpoint_utils, "torch", checkpoint_utils.torch)  # restored afterwards
    meet = threading.Barrier(len(paths))
    inside = threading.Barrier(len(paths))

    class Handing:
        def __init__(self, state):
            self.state = state

        def load(self, *args, **kwargs):
            # Both threads have read the global (the last one swapped in) before either
            # restores its own, so both get that one's state: the other thread's load crosses
            # every round, whatever the scheduling.
            inside.wait(timeout=60)
            return self.state

        def __getattr__(self, name):
            return getattr(torch, name)

    def swapping_load(path):
        state = load_checkpoint(path)
        reading_, checkpoint_utils.torch = checkpoint_utils.torch, Handing(state)
        meet.wait(timeout=60)  # both threads have swapped the global in
        try:
            return original(path)
        finally:
            checkpoint_utils.torch = reading_

    wrong = crossed_loads(swapping_load, paths, expected, rounds=5)
    # One thread per round got the other file's state: the harness sees that as crossed.
    assert sorted(round_ for round_, *_ in wrong) == list(range(5)), wrong
    assert {arch for *_, arch in wrong} <= {"ea_transformer_lite", "pa_transformer_lite"}, wrong


def test_other_callers_of_the_module_torch_get_torch(two, tmp_path):
    """Outside the plugin's loader (another thread, or fairseq's other functions),
    ``checkpoint_utils.torch.load`` is torch's own, with torch's defaults."""
    paths, _ = two
    torch.save({"w": torch.arange(3)}, tmp_path / "plain.pt")
    assert torch.equal(checkpoint_utils.torch.load(tmp_path / "plain.pt")["w"], torch.arange(3))
    with pytest.raises(Exception, match="(?i)weights.only"):
        checkpoint_utils.torch.load(paths[0])  # a fairseq configuration: not on torch's allow-list
    assert checkpoint_utils.torch.float32 is torch.float32


def test_allow_list_stays_while_another_thread_still_reads(two):
    """torch keeps one allow-list per process: a thread leaving its read does not take it
    away from another thread that is still reading; it is gone after the last."""
    paths, _ = two
    entered, left = threading.Event(), threading.Event()

    def short_read():
        with checkpoint_globals_allowed():
            entered.set()
        left.set()

    before = torch.serialization.get_safe_globals()
    with checkpoint_globals_allowed():
        thread = threading.Thread(target=short_read)
        thread.start()
        assert entered.wait(30) and left.wait(30)
        thread.join()
        state = torch.load(paths[0], weights_only=True)  # needs the fairseq classes
        assert state["cfg"]["model"].arch == "ea_transformer_lite"
    # torch may put its own classes on the list meanwhile (the first weights-only load of a
    # process registers its distributed-tensor types): what was there stays, the plugin's go.
    after = torch.serialization.get_safe_globals()
    ours = set(reading.checkpoint_globals()) - set(before)
    assert ours and set(before) <= set(after) and not ours & set(after)


def test_negative_control_torchs_own_scoped_allow_list_is_taken_away_by_another_thread(two):
    paths, _ = two
    allowed = reading.checkpoint_globals()
    entered, left = threading.Event(), threading.Event()

    def short_read():
        with torch.serialization.safe_globals(allowed):
            entered.set()
        left.set()

    with torch.serialization.safe_globals(allowed):
        thread = threading.Thread(target=short_read)
        thread.start()
        assert entered.wait(30) and left.wait(30)
        thread.join()
        with pytest.raises(Exception, match="(?i)weights.only"):
            torch.load(paths[0], weights_only=True)


def test_interpolations_resolve_in_other_threads_while_a_checkpoint_is_unpickled():
    """omegaconf's gate refuses only in the thread that reads a checkpoint, and is gone after."""
    original = Container._maybe_resolve_interpolation
    inside, done = threading.Event(), threading.Event()
    seen = {}

    def reader():
        with reading._no_interpolation_resolved() as attempted:
            inside.set()
            done.wait(30)
            try:
                OmegaConf.create({"a": 1, "b": "${a}"}).b
            except reading._InterpolationDuringLoad:
                seen["refused here"] = list(attempted)

    thread = threading.Thread(target=reader)
    thread.start()
    assert inside.wait(30)
    assert OmegaConf.create({"a": 1, "b": "${a}"}).b == 1  # this thread: resolved as omegaconf does
    done.set()
    thread.join()
    assert seen == {"refused here": ["${a}"]}
    assert Container._maybe_resolve_interpolation is original
