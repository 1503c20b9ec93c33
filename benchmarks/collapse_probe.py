"""Does a checkpoint still tell its tokens apart? A probe of representation collapse.

For one training batch of a binarized translation data directory, it prints, per layer of
the encoder and the decoder of a checkpoint (any transformer of this plugin or fairseq's):

* the norm of the self-attention's input (the residual stream entering the layer; with
  ``--*-normalize-before``, its layer norm) and of each sublayer's output
  (self-attention, encoder-decoder attention, FFN), mean over real tokens;
* their mean pairwise cosine over every real token of every sentence of the batch
  (1.00: the same vector for every token -- the layer no longer tells tokens apart);

then the decoder's NLL with the batch's own sources and with the sources shuffled across
its sentences (equal: the decoder does not use the source). With post-LN residual blocks
(fairseq's default), a sublayer whose output is the same for every token and larger than
the residual washes the tokens out of the stream; this is how ``ran_all_lite`` sits at the
unigram loss on the demo's budget (``benchmarks/README.md``).

    .venv/bin/python benchmarks/collapse_probe.py CHECKPOINT DATA_BIN [--batch N]
"""
import argparse
import sys


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint of a translation model")
    parser.add_argument("data", help="its binarized data directory (dict.*.txt, train.*)")
    parser.add_argument("--batch", type=int, default=20, metavar="N",
                        help="probe the N-th batch of 2048 tokens, unshuffled (default 20)")
    return parser.parse_args(argv)


def mean_pairwise_cosine(vectors):
    import torch.nn.functional as F
    unit = F.normalize(vectors.float(), dim=-1)
    return (unit @ unit.t()).mean().item()


def record(modules):
    """Forward hooks keeping each module's first input and output, by name."""
    seen = {}

    def hook(name):
        def keep(module, args, kwargs, output):
            inp = args[0] if args else kwargs["query"]
            seen[name] = (inp.detach(), (output[0] if isinstance(output, tuple) else output).detach())
        return keep
    for name, module in modules:
        module.register_forward_hook(hook(name), with_kwargs=True)
    return seen


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from fairseq import checkpoint_utils, utils

    import ea_fairseq  # noqa: F401  (its models, and its checked checkpoint loading)

    if args.batch < 0:
        sys.exit(f"collapse_probe: --batch must be 0 or more, got {args.batch}")
    try:
        models, _, task = checkpoint_utils.load_model_ensemble_and_task(
            [args.checkpoint], arg_overrides={"data": args.data})
        task.load_dataset("train")
    except (OSError, ValueError, RuntimeError) as err:
        sys.exit(f"collapse_probe: cannot load {args.checkpoint} with data {args.data}: {err}")
    if not hasattr(models[0], "encoder") or not hasattr(models[0].decoder, "layers"):
        sys.exit(f"collapse_probe: {args.checkpoint} is not an encoder-decoder transformer")
    model = models[0].eval()
    batches = task.get_batch_iterator(task.dataset("train"), max_tokens=2048, seed=1)
    batch = None
    for index, batch in enumerate(batches.next_epoch_itr(shuffle=False)):
        if index == args.batch:
            break
    else:
        sys.exit(f"collapse_probe: the training data has fewer than {args.batch + 1} batches of "
                 "2048 tokens; pass a smaller --batch")
    net_input, pad = batch["net_input"], task.target_dictionary.pad()
    hooks = []
    for i, layer in enumerate(model.encoder.layers):
        hooks += [(f"enc{i}.self", layer.self_attn), (f"enc{i}.ffn", layer.fc2)]
    for i, layer in enumerate(model.decoder.layers):
        hooks += [(f"dec{i}.self", layer.self_attn), (f"dec{i}.cross", layer.encoder_attn),
                  (f"dec{i}.ffn", layer.fc2)]
    seen = record(hooks)
    with torch.no_grad():
        encoder_out = model.encoder(net_input["src_tokens"], net_input["src_lengths"])
        logits = model.decoder(net_input["prev_output_tokens"], encoder_out=encoder_out)[0]
    real = {"enc": net_input["src_tokens"].ne(pad).t(), "dec": net_input["prev_output_tokens"].ne(pad).t()}

    def cell(side, tensor):  # (T, B, C) -> "norm cos" over real tokens
        vectors = tensor.reshape(real[side].shape + (-1,))[real[side]]
        return f"{vectors.norm(dim=-1).mean().item():6.2f} {mean_pairwise_cosine(vectors):5.3f}"

    print(f"batch {args.batch}: {tuple(net_input['src_tokens'].shape)} source tokens; "
          "cells: mean norm, mean pairwise cosine over all real tokens")
    for side, stack, parts in (("enc", model.encoder, ("self", "ffn")),
                               ("dec", model.decoder, ("self", "cross", "ffn"))):
        print(f"{side} layer | layer input   | " + " | ".join(f"{p:<12}" for p in parts))
        for i in range(len(stack.layers)):
            stream = seen[f"{side}{i}.self"][0]
            outs = [cell(side, seen[f"{side}{i}.{p}"][1]) for p in parts]
            print(f"{i:9d} | {cell(side, stream)} | " + " | ".join(outs))

    def nll(decoder_logits):
        logp = utils.log_softmax(decoder_logits, dim=-1)
        target = batch["target"]
        return -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)[target.ne(pad)].mean().item()

    order = torch.roll(torch.arange(net_input["src_tokens"].size(0)), 1)
    with torch.no_grad():
        shuffled = model.encoder(net_input["src_tokens"][order], net_input["src_lengths"][order])
        other = model.decoder(net_input["prev_output_tokens"], encoder_out=shuffled)[0]
    print(f"decoder NLL (nats/token): own sources {nll(logits):.3f}, "
          f"sources of other sentences {nll(other):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
