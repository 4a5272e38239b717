"""Mean negative log-likelihood of a text under a model, loaded the way the engine loads it
(optionally split over rpc servers). Tensor parallel changes numerics slightly, so splits
are judged by this figure rather than by string equality.

    python -m workers.engine.nll --model F --text-file T [--rpc host:port ...]
        [--n-gpu-layers N] [--split-mode 1|3] [--tensor-split a b ...]

Prints {"tokens": n, "mean_nll": x} as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def mean_nll(engine, text: str) -> tuple[int, float]:
    """Decode the text once with logits at every position; average -log p(next token)."""
    import llama_cpp as L

    tokens = engine.tokenize(text, add_bos=True, special=False)
    tokens = tokens[: min(len(tokens), engine.context_length, 512)]
    b = engine.batch
    for pos, token in enumerate(tokens):
        b.token[pos], b.pos[pos], b.n_seq_id[pos] = token, pos, 1
        b.seq_id[pos][0], b.logits[pos] = 0, True
    b.n_tokens = len(tokens)
    if L.llama_decode(engine.ctx, b) != 0:
        raise RuntimeError("llama_decode failed")
    total = 0.0
    for pos in range(len(tokens) - 1):
        row = L.llama_get_logits_ith(engine.ctx, pos)
        logits = [row[i] for i in range(engine.n_vocab)]
        top = max(logits)
        log_z = top + math.log(sum(math.exp(x - top) for x in logits))
        total += log_z - logits[tokens[pos + 1]]
    return len(tokens), total / (len(tokens) - 1)


def main(argv: list[str]) -> dict:
    from workers.engine.core import BatchEngine

    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--text-file", required=True)
    p.add_argument("--rpc", nargs="*", default=[])
    p.add_argument("--n-gpu-layers", type=int, default=-1)
    p.add_argument("--split-mode", type=int, default=1)
    p.add_argument("--tensor-split", type=float, nargs="*", default=[])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    engine = BatchEngine(
        args.model,
        512,
        1,
        threads=args.threads,
        rpc_servers=args.rpc,
        n_gpu_layers=args.n_gpu_layers,
        split_mode=args.split_mode,
        tensor_split=args.tensor_split or None,
        # One numeric path (flash attention off) for one node and layer splits alike, so
        # their figures compare; tensor parallel turns it on, as it must.
        batch_invariant=True,
    )
    with open(args.text_file, encoding="utf-8") as f:
        n, nll = mean_nll(engine, f.read())
    return {"tokens": n, "mean_nll": nll}


if __name__ == "__main__":
    json.dump(main(sys.argv[1:]), sys.stdout)
    sys.stdout.write("\n")
