"""flash_attn_interface for the records' own train_gpt.py (issue 41): put this folder first on sys.path (PYTHONPATH)
and the records' `flash_attn_func(q, k, v, causal=True)` and `flash_attn_varlen_func(q, k, v, cu_seqlens_q=...,
cu_seqlens_k=..., max_seqlen_q=..., max_seqlen_k=..., causal=True, window_size=(-1, -1))` run the kernels our
train_gpt.py runs without FlashAttention installed, so the two scripts race on the same attention kernel:

- flash_attn_func: PyTorch SDPA on (B, T, H, D), causal, GQA by enable_gqa, the call of our causal_attention (on CUDA
  the records' main() leaves SDPA only its flash backend; ours gets it first by PyTorch's priority order);
- flash_attn_varlen_func on (tokens, H, D): on CUDA PyTorch's varlen_attn through our torch_varlen (causal window,
  KV heads as varlen_gqa_mode says), after our flash_inputs (one dtype, autocast's); where varlen_attn or CUDA is
  missing, our exact PyTorch path: one causal SDPA call per document in eager mode (per_document_attention), the
  masked blocks (doc_block_attention) inside a compiled graph.

Both return the output tensor alone, as the records' FlashAttention 3 build did (they use it as `y`).
"""
import importlib.util
import inspect
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

_OURS = Path(__file__).resolve().parents[3] / "train_gpt.py"


def _ours():
    """Our train_gpt.py as a module, loaded by its path (a record's folder on sys.path has its own train_gpt.py)."""
    for mod in list(sys.modules.values()):
        if getattr(mod, "__file__", None) and Path(mod.__file__).resolve() == _OURS:
            return mod
    spec = importlib.util.spec_from_file_location("parameter_golf_train_gpt", _OURS)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


tg = _ours()
_fn = tg.import_torch_varlen()  # at import: a compiled graph (fullgraph=True) cannot trace the import
GQA = None if _fn is None else tg.varlen_gqa_mode(inspect.signature(_fn))  # as our select_attention_backend
VARLEN = None if _fn is None else tg.torch_varlen(_fn, GQA)


def flash_attn_func(q, k, v, causal=True):
    assert causal, "record shim: causal attention only (the records call it with causal=True)"
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       enable_gqa=k.size(2) != q.size(2))
    return y.transpose(1, 2)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True,
                           window_size=(-1, -1)):
    assert causal and tuple(window_size) == (-1, -1), "record shim: causal, no sliding window (as the records call it)"
    # self-attention: the records pass one cu_seqlens tensor and one max_seqlen for queries and keys
    assert max_seqlen_k == max_seqlen_q, "record shim: self-attention only"
    flash = None if VARLEN is None else tg.flash_inputs(q, k, v)
    if flash is not None:
        return VARLEN(*flash, cu_seqlens_q, max_seqlen_q)
    q4, k4, v4 = q[None], k[None], v[None]
    if q.device.type == "cpu" and not torch.compiler.is_compiling():
        return tg.per_document_attention(q4, k4, v4, cu_seqlens_q)[0]
    return tg.doc_block_attention(q4, k4, v4, tg.DocBounds(cu_seqlens_q, int(max_seqlen_q)))[0]
