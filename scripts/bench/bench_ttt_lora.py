#!/usr/bin/env python3
"""Host overhead of TTT_MODE=lora's Python chunk loop (issue 20): runs lora_ttt_sums on a random tiny model and a
synthetic BOS-delimited stream, and splits the wall time of the loop into the model forward, backward, AdamW step,
cross-entropy and the rest (window building, gathers, masks, byte counts: host work). One untimed run first (the
first AdamW construction has a one-off import cost).

    python3 scripts/bench/bench_ttt_lora.py [--docs 64] [--threads 1] [--chunk-by-doc-len 256:8,2000:24]
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402

ENV = {"NUM_LAYERS": "4", "MODEL_DIM": "64", "NUM_HEADS": "4", "NUM_KV_HEADS": "2", "VOCAB_SIZE": "1024",
       "VE_LAYERS": "2,3", "XSA_LAST_N": "2", "EVAL_SEQ_LEN": "256", "TTT_MODE": "lora", "TTT_BATCH_SIZE": "16",
       "TTT_LORA_RANK": "16"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunk-by-doc-len", default="", help="TTT_CHUNK_SIZE_BY_DOC_LEN (short docs: shorter chunks)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    h = tg.Hyperparameters({**ENV, "TTT_CHUNK_SIZE_BY_DOC_LEN": args.chunk_by_doc_len})
    model = tg.GPT(h)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(2, h.vocab_size, (int(n),), generator=g, dtype=torch.int32)
            for n in torch.randint(20, 400, (args.docs,), generator=g)]
    for d in docs:
        d[0] = tg.BOS_ID
    tokens = torch.cat(docs)
    boundary = torch.zeros(h.vocab_size, dtype=torch.bool)
    boundary[:2] = True
    luts = tg.ByteLuts(torch.ones(h.vocab_size, dtype=torch.int16), torch.zeros(h.vocab_size, dtype=torch.bool),
                       boundary)
    spent = {"forward": 0.0, "backward": 0.0, "step": 0.0, "ce": 0.0}

    def timed(key, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            spent[key] += time.perf_counter() - t0
            return out
        return wrapper

    model.forward_logits = timed("forward", model.forward_logits)
    torch.Tensor.backward = timed("backward", torch.Tensor.backward)
    torch.optim.AdamW.step = timed("step", torch.optim.AdamW.step)
    tg.F.cross_entropy = timed("ce", tg.F.cross_entropy)
    rt = tg.Runtime(h, torch.device("cpu"), False, True, None)
    tg.lora_ttt_sums(rt, model, tokens, luts)
    spent.update({k: 0.0 for k in spent})
    t0 = time.perf_counter()
    sums = tg.lora_ttt_sums(rt, model, tokens, luts)
    total = time.perf_counter() - t0
    host = total - sum(spent.values())
    print(f"targets:{int(sums[1])} loop:{total:.2f}s " + " ".join(f"{k}:{v:.2f}s" for k, v in spent.items())
          + f" host:{host:.2f}s ({100 * host / total:.1f}% of the loop)")


if __name__ == "__main__":
    main()
