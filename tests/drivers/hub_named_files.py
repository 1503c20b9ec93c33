"""Load model directories through fairseq's hub (``from_pretrained`` from a directory, with the
plugin imported first) and print one JSON line each: the outcome (loaded / refused / error),
the message, the seconds it took and, when loaded, a translation; then the process's peak RSS.
The loads run with 2 GiB of address space beyond what the process holds (a reader of /dev/zero
let through ends in MemoryError, not in the machine's memory).
With ``--controls FIFO ZERO_LINK``, fairseq's own readers (unguarded) on the same payloads:
whether a dictionary or BPE reader on the FIFO still waits after 2 s, and whether the
dictionary reader on the link to /dev/zero runs out of 512 MiB of address space.

usage: hub_named_files.py USER_DIR CASE_JSON... [--controls FIFO ZERO_LINK]
  CASE_JSON: {"dir": ..., "checkpoint": ..., "bpe": null | "sentencepiece" | "subword_nmt"}
"""
import json
import os
import resource
import sys
import threading
import time


def load(user_dir, case):
    from fairseq.models.transformer import TransformerModel

    from ea_fairseq.safety.data_files import DataFileError

    extra = {"bpe": case["bpe"]} if case.get("bpe") else {}
    start = time.perf_counter()
    result = {"dir": case["dir"], "outcome": "loaded", "message": ""}
    try:
        hub = TransformerModel.from_pretrained(case["dir"], checkpoint_file=case["checkpoint"], user_dir=user_dir,
                                               source_lang="src", target_lang="tgt", **extra)
        result["translation"] = hub.translate("s1 s2 s3", beam=2, max_len_a=0, max_len_b=4)
    except DataFileError as err:
        result.update(outcome="refused", message=str(err))
    except Exception as err:
        result.update(outcome="error", message=f"{type(err).__name__}: {err}"[:300])
    result["seconds"] = time.perf_counter() - start
    print(json.dumps(result), flush=True)


def waits(reader, fifo):
    """True if ``reader()`` on the FIFO still waits after 2 s; then lets it go (a writer)."""
    thread = threading.Thread(target=lambda: _quiet(reader), daemon=True)
    thread.start()
    thread.join(2.0)
    waiting = thread.is_alive()
    with open(fifo, "w"):
        pass
    thread.join(5.0)
    return waiting


def _quiet(reader):
    try:
        reader()
    except BaseException:  # once let go: an empty file (subword-nmt exits on it)
        pass


def _address_space() -> int:
    """This process's virtual memory size in bytes."""
    return int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def controls(fifo, zero_link):
    from argparse import Namespace

    from fairseq.data import Dictionary, encoders

    read_dictionary = Dictionary.add_from_file.__wrapped__
    build_bpe = encoders.build_bpe.__wrapped__
    print(json.dumps({"control": "dictionary-fifo", "waits": waits(lambda: read_dictionary(Dictionary(), fifo), fifo)}))
    print(json.dumps({"control": "bpe-fifo", "waits": waits(
        lambda: build_bpe(Namespace(bpe="subword_nmt", bpe_codes=fifo, bpe_separator="@@")), fifo)}), flush=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_address_space() + 512 * 2 ** 20, hard))
    try:
        read_dictionary(Dictionary(), zero_link)
        outcome = "returned"
    except MemoryError:
        outcome = "MemoryError"
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    print(json.dumps({"control": "dictionary-dev-zero", "outcome": outcome}), flush=True)


def main(user_dir, *args):
    import ea_fairseq  # noqa: F401  (the plugin first, as the README says)

    cases = args[:args.index("--controls")] if "--controls" in args else args
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_address_space() + 2 * 2 ** 30, hard))  # a /dev/zero read ends
    for case in cases:
        load(user_dir, json.loads(case))
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"maxrss": peak}), flush=True)
    if "--controls" in args:
        controls(*args[args.index("--controls") + 1:])


if __name__ == "__main__":
    main(*sys.argv[1:])
