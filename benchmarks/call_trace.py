#!/usr/bin/env python3
"""How far a reader follows one attention call through the code: the Python functions of
fairseq and of this repository that one call runs, traced with ``sys.setprofile``.

    .venv/bin/python benchmarks/call_trace.py [--arch ea_transformer_lite] [--show] [MODEL OPTIONS]

For each of an encoder self-attention (the first layer's, a full pass) and a decoder
self-attention's decoding step (the first layer's, at the third target position of a greedy
decode, its cache filled by the steps before): the distinct functions called, the files they
are in, the switches (consecutive calls in different files) and the branches of those
functions (:func:`branches`, counted with ``ast``); ``--show`` lists the calls.
The model is the arch at its defaults (or with the options given); torch's and Python's own
functions are not counted, fairseq's and the repository's are. The first call of each kind
warms caches (dispatch tables, masks) and is not counted: the numbers are those of every
later call.
"""
import argparse
import ast
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)


def _fairseq_root() -> str:
    import fairseq

    return os.path.dirname(os.path.abspath(fairseq.__file__)) + os.sep


def traced_call(module, run, which: int):
    """The (file, first line, name) of every Python call of fairseq's or the repository's code
    (not of the packages installed beside fairseq), in order, made by the ``which``-th call of
    ``module`` while ``run()`` runs (traced with ``sys.setprofile`` from its forward pre-hook
    to its forward hook)."""
    fairseq_root, repo = _fairseq_root(), REPO + os.sep
    calls, seen = [], [0]

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if event == "call" and (path.startswith(fairseq_root) or path.startswith(repo) and "site-packages" not in path):
            calls.append((path, frame.f_code.co_firstlineno, frame.f_code.co_qualname))

    def start(*_):
        seen[0] += 1
        if seen[0] == which:
            sys.setprofile(profile)

    def stop(*_):
        sys.setprofile(None)

    handles = [module.register_forward_pre_hook(start), module.register_forward_hook(stop)]
    try:
        run()
    finally:
        sys.setprofile(None)
        for handle in handles:
            handle.remove()
    return calls


def branches(path: str, line: int) -> int:
    """The branches of the function defined at ``line`` of ``path`` (``if``, conditional
    expressions, loops, ``and``/``or`` operands after the first, ``except`` clauses,
    comprehension conditions; nested functions' too); 0 for a lambda or a comprehension, which
    belong to the function around them."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                min([node.lineno] + [d.lineno for d in node.decorator_list]) == line:
            return sum(len(n.values) - 1 if isinstance(n, ast.BoolOp) else len(n.ifs)
                       if isinstance(n, ast.comprehension) else 1
                       for n in ast.walk(node) if isinstance(n, (ast.If, ast.IfExp, ast.For, ast.While, ast.BoolOp,
                                                                ast.ExceptHandler, ast.comprehension)))
    return 0


def summary(calls):
    files = [c[0] for c in calls]
    switches = sum(a != b for a, b in zip(files, files[1:]))
    return {"calls": len(calls), "functions": len(set(calls)), "files": len(set(files)), "switches": switches,
            "branches": sum(branches(path, line) for path, line, _ in set(calls))}


def _short(path: str) -> str:
    return "fairseq/" + path[len(_fairseq_root()):] if path.startswith(_fairseq_root()) else os.path.relpath(path, REPO)


def measure(arch: str, *options: str):
    """``{"encoder self-attention": calls, "decoding step": calls}`` of ``arch`` built with
    fairseq's ``options`` (:func:`traced_call`)."""
    import torch

    from ea_fairseq.models import building

    model, _ = building.build_model(arch, *options, seed=1, dictionary=building.placeholder_dictionary(44))
    model.eval()
    src, lengths = torch.randint(4, 44, (2, 7), generator=torch.Generator().manual_seed(1)), torch.tensor([7, 7])

    def encode():
        return model.encoder(src, lengths)

    def decode():  # greedy, three steps
        state, tokens, encoder_out = {}, torch.full((2, 1), 2, dtype=torch.long), encode()
        for _ in range(3):
            logits, _ = model.decoder(tokens, encoder_out=encoder_out, incremental_state=state)
            tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)

    with torch.no_grad():  # the second run of each is traced: the first warms what is cached
        return {"encoder self-attention": traced_call(model.encoder.layers[0].self_attn,
                                                      lambda: (encode(), encode()), 2),
                "decoding step": traced_call(model.decoder.layers[0].self_attn, lambda: (decode(), decode()), 6)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="ea_transformer_lite")
    p.add_argument("--show", action="store_true", help="list every call")
    args, options = p.parse_known_args(argv)  # the rest: the model's options, e.g. --ea-alpha 0.5
    for name, calls in measure(args.arch, *options).items():
        s = summary(calls)
        print(f"{args.arch} {name}: {s['functions']} functions in {s['files']} files, {s['switches']} switches "
              f"({s['calls']} calls), {s['branches']} branches in those functions")
        if args.show:
            for path, line, qualname in calls:
                print(f"    {_short(path)}:{line} {qualname}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
