"""ATTENTION_BACKEND=torch_varlen (issues 31, 41): packed rows through PyTorch's own varlen FlashAttention,
torch.nn.attention.varlen.varlen_attn. Its kernel runs only on CUDA, so on CPU our call goes to stand-ins with
varlen_attn's exact signatures (2.13's, the same as 2.12's; 2.11's, without enable_gqa) that check the argument
contract strictly and attend per segment exactly; and for torch.compile, to the real varlen_attn whose custom op gets
the stand-in as its CPU kernel."""
from __future__ import annotations

import concurrent.futures
import functools
import inspect
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train_gpt as tg
from conftest import REPO, TINY_ENV, config_error

varlen = pytest.importorskip("torch.nn.attention.varlen", reason="this PyTorch has no torch.nn.attention.varlen")
HALF = (torch.bfloat16, torch.float16)
KERNEL_DTYPES = HALF  # what the stand-ins take: the flash kernels' dtypes (fp32 too where a test says so)


def attend_per_segment(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size, gqa):
    """varlen_attn's contract asserted (the kernel's dtypes, (tokens, heads, dim) shapes, int32 cu_seqlens on q's
    device from 0 to the token count, never decreasing, max lengths bounding every segment, fewer KV heads than
    query heads only where gqa says the kernel takes them), its causal flag derived as varlen_attn derives it
    (window_size == (-1, 0): a list would not be causal), then SDPA on each segment alone."""
    assert query.dtype in KERNEL_DTYPES, query.dtype
    assert key.dtype == value.dtype == query.dtype, (query.dtype, key.dtype, value.dtype)
    assert query.dim() == key.dim() == value.dim() == 3 and key.shape == value.shape
    assert key.size(0) == query.size(0) and key.size(2) == query.size(2)
    hq, hkv = query.size(1), key.size(1)
    assert hq == hkv or (gqa and hq % hkv == 0), (hq, hkv, gqa)
    for cu in (cu_seq_q, cu_seq_k):
        assert cu.dtype == torch.int32 and cu.device == query.device and cu.dim() == 1, (cu.dtype, cu.device)
    assert torch.equal(cu_seq_q, cu_seq_k)
    lengths = cu_seq_q.diff()
    assert int(cu_seq_q[0]) == 0 and int(cu_seq_q[-1]) == query.size(0) and bool((lengths >= 0).all())
    assert isinstance(max_q, int) and isinstance(max_k, int) and min(max_q, max_k) >= int(lengths.max())
    assert isinstance(window_size, tuple) and window_size in ((-1, -1), (-1, 0)), window_size
    is_causal = window_size == (-1, 0)
    out = torch.zeros_like(query)
    bounds = cu_seq_q.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            q, k, v = (t[a:b].transpose(0, 1) for t in (query, key, value))
            out[a:b] = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=hq != hkv).transpose(0, 1)
    return out


def varlen_attn_stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                         window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """varlen_attn of PyTorch 2.13 (and 2.12: the same parameters) on CPU: its signature, the contract asserted
    (GQA only with enable_gqa), the attention of each segment."""
    assert return_aux is None and scale is None and seqused_k is None and block_table is None and num_splits is None
    return attend_per_segment(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size, enable_gqa)


# varlen_attn's parameters in PyTorch 2.11 (as read from PyTorch's torch/nn/attention/varlen.py and the docs' page of
# that time, neither labelled v2.11.0): 2.13's first ten, names, kinds and defaults, without enable_gqa and the rest.
PARAMETERS_2_11 = ["query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "return_aux", "scale",
                   "window_size"]


def varlen_attn_2_11(native_gqa):
    """varlen_attn of PyTorch 2.11 on CPU: its exact signature (no enable_gqa), the contract asserted, the attention
    of each segment. native_gqa: whether this kernel takes k, v of fewer heads than q (VARLEN_GQA_NATIVE's
    question); without it, k, v must arrive with q's head count (expanded)."""
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1)):
        assert return_aux is None and scale is None
        return attend_per_segment(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size, native_gqa)
    return varlen_attn


def recorded(fn, calls):
    """fn, each call's (H_q, H_kv, keyword arguments) appended to calls; inspect.signature still reads fn's."""
    @functools.wraps(fn)
    def call(query, key, *args, **kwargs):
        calls.append((query.size(1), key.size(1), kwargs))
        return fn(query, key, *args, **kwargs)
    return call


def parameters(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_stand_in_has_varlen_attns_signature():
    assert parameters(varlen_attn_stand_in) == parameters(varlen.varlen_attn)  # names, kinds, defaults
    assert tg.import_torch_varlen() is varlen.varlen_attn  # 2.13 has window_size and enable_gqa
    old = parameters(varlen_attn_2_11(False))  # 2.11's: a prefix of 2.13's
    assert [name for name, _, _ in old] == PARAMETERS_2_11 and old == parameters(varlen.varlen_attn)[:len(old)]


def test_varlen_gqa_mode_reads_the_signature(monkeypatch):
    """enable_gqa where the signature has it (2.12 on, whatever VARLEN_GQA_NATIVE says); for 2.11's, expand until
    a GPU check sets VARLEN_GQA_NATIVE; a wrapper (functools.wraps) is read through to the function it wraps."""
    sig = inspect.signature
    assert tg.VARLEN_GQA_NATIVE is False
    assert tg.varlen_gqa_mode(sig(varlen.varlen_attn)) == "enable_gqa"
    assert tg.varlen_gqa_mode(sig(varlen_attn_2_11(False))) == "expand"
    assert tg.varlen_gqa_mode(sig(recorded(varlen_attn_2_11(False), []))) == "expand"
    monkeypatch.setattr(tg, "VARLEN_GQA_NATIVE", True)
    assert tg.varlen_gqa_mode(sig(varlen_attn_2_11(True))) == "native"
    assert tg.varlen_gqa_mode(sig(varlen_attn_stand_in)) == "enable_gqa"


def segments_and_bounds(layout, S):
    """Token ids of rows packed with documents (BOS = 1 at each document start, none where a row continues a
    document) and the segments every token must attend within, as (start, end) over the flattened rows; a
    document longer than S is cut every S tokens. DocBounds as the loaders make them (padded cu_seqlens)."""
    g = torch.Generator().manual_seed(3)
    T = sum(n for n, _ in layout[0])
    rows, segments = [], []
    for r, docs in enumerate(layout):
        row = []
        for n, starts_with_bos in docs:
            a = r * T + len(row)
            doc = torch.randint(8, 64, (n,), generator=g).tolist()
            if starts_with_bos:
                doc[0] = 1
            row += doc
            segments += [(s, min(s + S, a + n)) for s in range(a, a + n, S)]
        assert len(row) == T
        rows.append(row)
    ids = np.array(rows)
    if len(layout) == 1:  # the packed training loader: one row, cut every S
        cu = tg.packed_cu_seqlens(ids[0], S)
    else:  # BOS-split evaluation rows
        cu = tg.rows_cu_seqlens(ids)
    return segments, tg.DocBounds(torch.from_numpy(cu), S)


# (documents as (length, starts with BOS) per row, S): one row of the training loader with a one-token document
# and one longer than S (cut); rows of BOS-split evaluation where a document fills a whole row and continues
# into the next. Both have padding segments (cu_seqlens padded to a bucket).
LAYOUTS = [([[(1, True), (20, True), (3, True), (16, True)]], 16),
           ([[(1, True), (9, True), (6, True)], [(16, False)], [(5, False), (11, True)]], 16)]


@pytest.fixture
def torch_varlen_on_cpu(monkeypatch):
    """ATTENTION_BACKEND=torch_varlen as on a GPU, with the stand-in for varlen_attn and CPU tensors allowed."""
    monkeypatch.setattr(tg, "import_torch_varlen", lambda: varlen_attn_stand_in)
    monkeypatch.setattr(tg, "flash_device", lambda t: True)
    assert tg.select_attention_backend(torch.device("cuda"), "torch_varlen") == "sdpa"  # dense rows: SDPA
    assert tg.varlen_backend_name() == "torch_varlen gqa:enable_gqa"
    yield
    tg.select_attention_backend(torch.device("cpu"))


@pytest.mark.parametrize("layout,S", LAYOUTS)
def test_packed_rows_through_varlen_attn_attend_per_document(torch_varlen_on_cpu, layout, S):
    segments, docs = segments_and_bounds(layout, S)
    assert docs.cu_seqlens.numel() > len(segments) + 1 and any(b - a == 1 for a, b in segments)  # padding, 1 token
    B, T = len(layout), sum(n for n, _ in layout[0])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, 4, 8, generator=g)
    k, v = torch.randn(B, T, 2, 8, generator=g), torch.randn(B, T, 2, 8, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # q, k fp32 beside a bf16 v, as after rms_norm on CUDA
        got = tg.doc_causal_attention(q, k, v.bfloat16(), docs)
    assert got.dtype == torch.bfloat16 and got.shape == (B, T, 4, 8)
    flat = [t.reshape(B * T, *t.shape[2:]).bfloat16() for t in (q, k, v)]
    want = torch.zeros_like(flat[0])
    for a, b in segments:  # each document (segment) alone, causal, GQA
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in flat)
        want[a:b] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(got.reshape(B * T, 4, 8), want, rtol=0, atol=0)
    # the exact PyTorch path (ATTENTION_BACKEND=sdpa) gives the same attention in fp32 (within bf16 rounding)
    tg.select_attention_backend(torch.device("cpu"), "sdpa")
    masked = tg.doc_causal_attention(q, k, v, docs)
    torch.testing.assert_close(got.float(), masked, rtol=2e-2, atol=2e-2)


# One packed row of 3 documents of different lengths, 24 tokens cut every 16 (the masked path's blocks of 16 queries
# against 32 keys then span two documents), for 4 query heads and 2 KV heads.
GQA_LAYOUT = ([[(11, True), (8, True), (5, True)]], 16)


def attention_and_gradients(attention, docs, B, T):
    """attention(q, k, v, docs) on fixed random fp32 q (4 heads), k, v (2 heads): its output and the gradients of
    q, k, v of a fixed random weighting of it."""
    g = torch.Generator().manual_seed(5)
    qkv = [torch.randn(B, T, h, 8, generator=g, requires_grad=True) for h in (4, 2, 2)]
    w = torch.randn(B, T, 4, 8, generator=g)
    out = attention(*qkv, docs)
    return out.detach(), torch.autograd.grad((out * w).sum(), qkv)


@pytest.mark.parametrize("mode", ["expand", "native", "enable_gqa"])
def test_packed_gqa_through_each_varlen_attn_equals_the_masked_path(monkeypatch, mode):
    """Issue 41: 2.11's varlen_attn (no enable_gqa) gets k, v expanded to the query heads (VARLEN_GQA_NATIVE off, the
    default) or as they are (on); 2.12's and 2.13's get them as they are, with enable_gqa=True. Each stand-in asserts
    it receives what the mode promises, and the call is recorded; output and gradients of q, k, v (through the
    expansion too) are those of the exact masked path (torch_doc_blocks), in fp32. The log line names the mode, and
    the GPU benchmark's note keeps it."""
    import importlib.util

    calls = []
    kernel = varlen_attn_stand_in if mode == "enable_gqa" else varlen_attn_2_11(native_gqa=mode == "native")
    monkeypatch.setattr(sys.modules[__name__], "KERNEL_DTYPES", (torch.float32,))
    monkeypatch.setattr(tg, "VARLEN_GQA_NATIVE", mode == "native")
    monkeypatch.setattr(tg, "import_torch_varlen", lambda: recorded(kernel, calls))
    monkeypatch.setattr(tg, "flash_device", lambda t: True)
    monkeypatch.setattr(tg, "flash_inputs", lambda q, k, v: (q, k, v))  # fp32 into the kernel: a tight comparison
    segments, docs = segments_and_bounds(*GQA_LAYOUT)
    B, T = 1, docs.cu_seqlens[-1].item()
    assert sorted({b - a for a, b in segments}) == [5, 8, 11] and len(segments) == 3
    try:
        assert tg.select_attention_backend(torch.device("cuda"), "torch_varlen") == "sdpa"
        packed = tg.varlen_backend_name()
        got, got_grads = attention_and_gradients(tg.doc_causal_attention, docs, B, T)
    finally:
        tg.select_attention_backend(torch.device("cpu"))
    assert packed == f"torch_varlen gqa:{mode}"
    kwargs = {"window_size": (-1, 0), **({"enable_gqa": True} if mode == "enable_gqa" else {})}
    assert calls == [(4, 4 if mode == "expand" else 2, kwargs)]
    want, want_grads = attention_and_gradients(tg.doc_block_attention, docs, B, T)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "scripts" / "bench" / "bench_gpu.py")
    bench_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_gpu)
    line = f"attention_backend_packed:{packed} (document-packed rows, SPEC-FRONTIER 3)"  # as train_gpt.py logs it
    assert bench_gpu.PACKED_LINE.search(line).group(1) == packed


def test_native_gqa_stand_in_refuses_what_expand_would_not_send():
    """2.11's stand-in without native GQA (what "expand" assumes of the kernel) refuses k, v of fewer heads than q;
    with native GQA it takes them. Either refuses a head count that does not divide q's."""
    q, kv = torch.zeros(6, 4, 8, dtype=torch.bfloat16), torch.zeros(6, 2, 8, dtype=torch.bfloat16)
    cu = torch.tensor([0, 1, 6], dtype=torch.int32)
    args = (cu, cu, 5, 5)
    with pytest.raises(AssertionError):
        varlen_attn_2_11(native_gqa=False)(q, kv, kv, *args, window_size=(-1, 0))
    assert varlen_attn_2_11(native_gqa=True)(q, kv, kv, *args, window_size=(-1, 0)).shape == q.shape
    assert varlen_attn_2_11(native_gqa=False)(q, q, q, *args, window_size=(-1, 0)).shape == q.shape
    with pytest.raises(TypeError):  # 2.11's has no enable_gqa
        varlen_attn_2_11(native_gqa=True)(q, kv, kv, *args, window_size=(-1, 0), enable_gqa=True)
    with pytest.raises(AssertionError):
        varlen_attn_2_11(native_gqa=True)(q, q[:, :3], q[:, :3], *args, window_size=(-1, 0))


def varlen_attn_without_window(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """An older varlen_attn's signature (is_causal, no window_size: the docs' page before 2.11); never called."""
    raise AssertionError("a varlen_attn without window_size was called")


def test_varlen_attn_without_window_size_is_missing(monkeypatch):
    """import_torch_varlen reads the signature of the module's varlen_attn: without window_size it is missing, so
    ATTENTION_BACKEND=torch_varlen stops at start with the one-line error, and auto (no FlashAttention) keeps the
    packed rows on the masked path (the log's attention_backend_packed:torch_doc_blocks)."""
    monkeypatch.setattr(varlen, "varlen_attn", varlen_attn_without_window)
    monkeypatch.setattr(tg, "import_flash_attn", lambda module: None)
    assert tg.import_torch_varlen() is None
    cuda = torch.device("cuda")
    try:
        with pytest.raises(tg.ConfigError) as e:
            tg.select_attention_backend(cuda, "torch_varlen")
        assert str(e.value) == (f"ATTENTION_BACKEND=torch_varlen: this PyTorch {torch.__version__} has no "
                                "torch.nn.attention.varlen.varlen_attn taking window_size (2.11 on) (docs/gpu.md, "
                                "Attention)")
        assert tg.select_attention_backend(cuda) == "sdpa" and tg.varlen_backend_name() == "torch_doc_blocks"
    finally:
        tg.select_attention_backend(torch.device("cpu"))


def bad_calls():
    q, kv, cu = torch.zeros(6, 4, 8, dtype=torch.bfloat16), torch.zeros(6, 2, 8, dtype=torch.bfloat16), [0, 1, 6, 6]
    good = dict(query=q, key=kv, value=kv, cu_seq_q=torch.tensor(cu, dtype=torch.int32),
                cu_seq_k=torch.tensor(cu, dtype=torch.int32), max_q=5, max_k=5, window_size=(-1, 0), enable_gqa=True)
    yield good, None
    yield {**good, "query": q.float()}, "dtype"
    yield {**good, "cu_seq_q": good["cu_seq_q"].long(), "cu_seq_k": good["cu_seq_k"].long()}, "int64 cu_seqlens"
    yield {**good, "cu_seq_q": good["cu_seq_q"].to("meta")}, "cu_seqlens on another device"
    yield {**good, "cu_seq_q": torch.tensor([0, 3, 2, 6], dtype=torch.int32)}, "decreasing cu_seqlens"
    yield {**good, "max_q": 4}, "max_q below a segment"
    yield {**good, "enable_gqa": False}, "GQA without enable_gqa"
    yield {**good, "window_size": [-1, 0]}, "a list window (not causal in varlen_attn)"
    yield {**good, "query": q.reshape(1, 6, 4, 8)}, "(B, T, H, D) layout"


@pytest.mark.parametrize("kwargs,wrong", list(bad_calls()), ids=lambda x: x if isinstance(x, str) else None)
def test_stand_in_refuses_a_wrong_call(kwargs, wrong):
    if wrong is None:
        assert varlen_attn_stand_in(**kwargs).shape == kwargs["query"].shape
    else:
        with pytest.raises((AssertionError, RuntimeError)):
            varlen_attn_stand_in(**kwargs)


def test_torch_varlen_setting(monkeypatch):
    assert "ATTENTION_BACKEND='varlen' must be auto or" in config_error({"ATTENTION_BACKEND": "varlen"})
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with pytest.raises(tg.ConfigError, match="ATTENTION_BACKEND=torch_varlen needs CUDA"):
        tg.select_attention_backend(cpu, "torch_varlen")
    assert tg.select_attention_backend(cpu) == "sdpa" and tg.varlen_backend_name() == "torch_doc_blocks"
    monkeypatch.setattr(tg, "import_flash_attn", lambda module: None)
    assert tg.select_attention_backend(cuda) == "sdpa" and tg.varlen_backend_name() == "torch_varlen gqa:enable_gqa"
    assert tg.select_attention_backend(cuda, "sdpa") == "sdpa" and tg.varlen_backend_name() == "torch_doc_blocks"
    # FlashAttention, when importable, comes first; its varlen function is wrapped, not PyTorch's
    fa = type("FA", (), {"flash_attn_func": staticmethod(lambda *a, **k: None),
                         "flash_attn_varlen_func": staticmethod(lambda *a, **k: None)})
    monkeypatch.setattr(tg, "import_flash_attn", lambda module: fa if module == "flash_attn" else None)
    assert tg.select_attention_backend(cuda) == "flash_attn_2" and tg.varlen_backend_name() == "flash_attn_2_varlen"
    assert tg.select_attention_backend(cuda, "torch_varlen") == "sdpa"
    assert tg.varlen_backend_name() == "torch_varlen gqa:enable_gqa"
    monkeypatch.setattr(tg, "import_torch_varlen", lambda: None)  # a PyTorch whose varlen_attn is older
    with pytest.raises(tg.ConfigError, match=r"ATTENTION_BACKEND=torch_varlen: this PyTorch .* window_size \(2\.11"):
        tg.select_attention_backend(cuda, "torch_varlen")
    monkeypatch.setattr(tg, "import_flash_attn", lambda module: None)
    assert tg.select_attention_backend(cuda) == "sdpa" and tg.varlen_backend_name() == "torch_doc_blocks"
    tg.select_attention_backend(cpu)


_CPU_KERNEL = {"registered": False, "calls": 0, "backward_calls": 0}


def stand_in_as_cpu_kernel():
    """The stand-in as the CPU kernel of varlen_attn's custom op (torch_attn::_varlen_attn, whose own CPU path
    is FlashAttention's and fails without CUDA), so the real varlen_attn runs and compiles on CPU. Registered
    once per process; the op's arguments are varlen_attn's as it passes them (window_size as a list)."""
    if _CPU_KERNEL["registered"]:
        return

    @torch.library.register_kernel("torch_attn::_varlen_attn", "cpu")
    def _(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None, window_size=None,
          enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        _CPU_KERNEL["calls"] += 1
        out = varlen_attn_stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                   window_size=tuple(window_size), enable_gqa=enable_gqa, seqused_k=seqused_k,
                                   block_table=block_table, num_splits=num_splits)
        assert is_causal == (tuple(window_size) == (-1, 0))
        lse = torch.zeros(query.size(1), query.size(0), dtype=torch.float32)
        return out, lse, torch.zeros(2, dtype=torch.uint64)

    @torch.library.register_kernel("torch_attn::_varlen_attn_backward", "cpu")
    def _(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state,
          scale=None, window_size=None):
        def vjp():  # in a fresh thread: autograd is off inside an op's kernel (thread-local dispatch keys)
            q, k, v = (t.detach().requires_grad_() for t in (query, key, value))
            o = varlen_attn_stand_in(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                     window_size=tuple(window_size), enable_gqa=True)
            return torch.autograd.grad(o, (q, k, v), grad_out)

        _CPU_KERNEL["backward_calls"] += 1
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(vjp).result()

    _CPU_KERNEL["registered"] = True


def test_compiled_training_forward_stays_one_graph_with_torch_varlen(monkeypatch):
    """The real varlen_attn under torch.compile(fullgraph=True) (AOTAutograd, which also traces the backward
    through the op's registered autograd formula and fakes): one graph, the op called once per layer, and the
    loss of eager PyTorch's masked path within bf16 rounding."""
    import torch._dynamo.testing

    stand_in_as_cpu_kernel()
    monkeypatch.setattr(tg, "flash_device", lambda t: True)
    env = {**TINY_ENV, "NUM_LAYERS": "2", "VE_LAYERS": "1", "XSA_LAST_N": "1", "BIGRAM_VOCAB_SIZE": "0",
           "SMEAR_GATE": "0", "TRAIN_SEQ_LEN": "16"}
    h = tg.Hyperparameters(env)
    model = tg.build_model(h).train()
    model.set_compute_dtype(None)  # autocast decides, as on CUDA
    layout, S = LAYOUTS[0]
    _, docs = segments_and_bounds(layout, S)
    ids = torch.randint(8, h.vocab_size, (1, docs.cu_seqlens[-1].item() + 1), generator=torch.Generator().manual_seed(2))
    x, y = ids[:, :-1], ids[:, 1:]

    def loss_of(fn):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn(x, y, docs)

    assert tg.select_attention_backend(torch.device("cpu"), "sdpa") == "sdpa"
    masked = loss_of(model)
    monkeypatch.setattr(tg, "import_torch_varlen", lambda: varlen.varlen_attn)
    tg.select_attention_backend(torch.device("cuda"), "torch_varlen")
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    torch._dynamo.reset()
    try:
        before = _CPU_KERNEL["calls"]
        compiled = loss_of(torch.compile(model, fullgraph=True, dynamic=False, backend=counter))
        assert _CPU_KERNEL["calls"] - before == h.num_layers
    finally:
        torch._dynamo.reset()
        tg.select_attention_backend(torch.device("cpu"))
    assert counter.frame_count == 1 and compiled.requires_grad
    torch.testing.assert_close(compiled.float(), masked.float(), rtol=1e-2, atol=1e-2)


def varlen_attn_as_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1)):
    """2.11's signature over the installed varlen_attn and its custom op (2.11's calls an op of the same name)."""
    return varlen.varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux=return_aux, scale=scale,
                              window_size=window_size)


@pytest.mark.parametrize("mode", ["enable_gqa", "expand"])
def test_varlen_attn_compiles_forward_and_backward_in_one_graph(torch_varlen_on_cpu, monkeypatch, mode):
    """AOTAutograd (what inductor runs under) traces the real varlen_attn's forward and, through the op's
    registered autograd formula and fakes, its backward op, in one graph; the gradients of q, k, v (GQA) are
    those of eager PyTorch's masked path within bf16 rounding. expand: through 2.11's signature, the KV heads
    repeated inside the graph."""
    import torch._dynamo.testing

    stand_in_as_cpu_kernel()
    assert parameters(varlen_attn_as_2_11) == parameters(varlen_attn_2_11(False))
    kernel = varlen.varlen_attn if mode == "enable_gqa" else varlen_attn_as_2_11
    monkeypatch.setattr(tg, "import_torch_varlen", lambda: kernel)
    tg.select_attention_backend(torch.device("cuda"), "torch_varlen")
    assert tg.varlen_backend_name() == f"torch_varlen gqa:{mode}"
    _, docs = segments_and_bounds(*LAYOUTS[0])
    g = torch.Generator().manual_seed(0)
    T = docs.cu_seqlens[-1].item()
    qkv = [torch.randn(1, T, h, 8, generator=g, dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2)]
    w = torch.randn(1, T, 4, 8, generator=g)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    try:
        calls = _CPU_KERNEL["calls"], _CPU_KERNEL["backward_calls"]
        out = torch.compile(tg.doc_causal_attention, fullgraph=True, backend=counter)(*qkv, docs)
        got = torch.autograd.grad((out.float() * w).sum(), qkv)
        assert (_CPU_KERNEL["calls"], _CPU_KERNEL["backward_calls"]) == (calls[0] + 1, calls[1] + 1)
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1 and "torch_attn._varlen_attn" in str(counter.graphs[0].graph)
    tg.select_attention_backend(torch.device("cpu"), "sdpa")
    fp32 = [t.detach().float().requires_grad_() for t in qkv]
    want = torch.autograd.grad((tg.doc_causal_attention(*fp32, docs) * w).sum(), fp32)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b, rtol=3e-2, atol=3e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (PyTorch's varlen FlashAttention kernel)")
@pytest.mark.parametrize("native", [False, True], ids=["gqa_default", "gqa_native"])
def test_torch_varlen_on_cuda_equals_the_masked_path(monkeypatch, native):
    """On a GPU, the real kernel, eager and compiled (inductor, fullgraph): output and gradients of q, k, v
    (GQA) those of the exact masked path in fp32, within bf16 rounding, on both layouts. gqa_default: the mode
    varlen_gqa_mode gives (enable_gqa from 2.12, expand on 2.11); gqa_native, on a varlen_attn without enable_gqa
    (2.11): k, v handed over with their own heads, the check that decides VARLEN_GQA_NATIVE (issue 41)."""
    cuda = torch.device("cuda")
    varlen_attn = tg.import_torch_varlen()
    if varlen_attn is None:
        pytest.skip(f"PyTorch {torch.__version__}'s varlen_attn lacks window_size")
    monkeypatch.setattr(tg, "VARLEN_GQA_NATIVE", native)
    mode = tg.varlen_gqa_mode(inspect.signature(varlen_attn))
    if native and mode != "native":
        pytest.skip(f"PyTorch {torch.__version__}'s varlen_attn takes enable_gqa: nothing to decide")
    try:
        for layout, S in LAYOUTS:
            _, docs = segments_and_bounds(layout, S)
            docs = tg.DocBounds(docs.cu_seqlens.to(cuda), docs.max_len)
            B, T = len(layout), sum(n for n, _ in layout[0])
            g = torch.Generator().manual_seed(0)
            qkv = [torch.randn(B, T, h, 64, generator=g).to(cuda, torch.bfloat16).requires_grad_() for h in (8, 4, 4)]
            w = torch.randn(B, T, 8, 64, generator=g).to(cuda)
            tg.select_attention_backend(cuda, "sdpa")
            fp32 = [t.detach().float().requires_grad_() for t in qkv]
            want_out = tg.doc_causal_attention(*fp32, docs)
            want = torch.autograd.grad((want_out * w).sum(), fp32)
            assert tg.select_attention_backend(cuda, "torch_varlen") == "sdpa"
            assert tg.varlen_backend_name() == f"torch_varlen gqa:{mode}"
            for fn in (tg.doc_causal_attention, torch.compile(tg.doc_causal_attention, fullgraph=True)):
                out = fn(*qkv, docs)
                got = torch.autograd.grad((out.float() * w).sum(), qkv)
                assert out.dtype == torch.bfloat16
                torch.testing.assert_close(out.float(), want_out, rtol=2e-2, atol=2e-2)
                for a, b in zip(got, want):
                    torch.testing.assert_close(a.float(), b, rtol=5e-2, atol=5e-2)
    finally:
        tg.select_attention_backend(torch.device("cpu"))
