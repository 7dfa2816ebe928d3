"""The MTP head of docs/frontier.md "A piece with weights" (issue 54), the test to copy for a piece that owns weights.

The doc's code blocks are applied to a copy of train_gpt.py (each block's first line says where: after, before or
replacing a line found exactly once); test_the_edits_touch_the_setting_the_piece_and_the_objective_only checks where
they land, and test_mtp_head_in_a_fresh_process runs the test_patched_* tests on that copy in a process of its own
with TRITON_INTERPRET=1 (a second copy of the script registers the fused kernels' ops again, and the interpreter
must be on before Triton is imported), importing the copy as `train_gpt_mtp` beside this checkout's `train_gpt`."""
from __future__ import annotations

import ast
import difflib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, SCRIPT, clean_environ

DOC = REPO / "docs" / "frontier.md"
WHERE = re.compile(r"# train_gpt\.py \((\w+)\): (after|before|replacing): (.+)")  # (example): how: anchor
PATCHED = os.environ.get("MTP_SCRIPT")  # the patched copy, in the process test_mtp_head_in_a_fresh_process starts
SMALL = {"MODEL_DIM": "32", "NUM_HEADS": "2", "NUM_KV_HEADS": "1", "VOCAB_SIZE": "64", "VE_LAYERS": "1",
         "NUM_LAYERS": "2", "XSA_LAST_N": "1", "TRAIN_SEQ_LEN": "24", "AUTOCAST_DTYPE": "fp32"}
CPU = torch.device("cpu")


def doc_blocks(examples=("mtp",)):
    """The (how, anchor, lines) of each python block of the doc whose first line is `# train_gpt.py (EXAMPLE): HOW:
    ANCHOR`, for the examples named, in the doc's order."""
    text = DOC.read_text(encoding="utf-8")
    blocks = []
    for body in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        lines = body.splitlines()
        where = WHERE.fullmatch(lines[0])
        if where and where[1] in examples:
            blocks.append((where[2], where[3], lines[1:]))
    return blocks


def patched_source(src, examples=("mtp",)):
    """train_gpt.py's text with the doc's blocks of `examples` applied, each re-indented to its anchor line's
    indentation."""
    lines = src.splitlines()
    for how, anchor, block in doc_blocks(examples):
        at = [i for i, line in enumerate(lines) if line.strip() == anchor]
        assert len(at) == 1, f"{anchor!r} is in train_gpt.py {len(at)} times, not once"
        i = at[0]
        indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
        new = [indent + line if line else "" for line in block]
        if how == "before" and not indent:
            new += ["", ""]  # a top-level definition: two blank lines before the next
        lines[i:i + 1] = {"after": [lines[i], *new], "before": [*new, lines[i]], "replacing": new}[how]
    return "\n".join(lines) + "\n"


def enclosing(tree, lineno):
    """The name of the innermost class or function around a line (dotted: Class.method)."""
    names = []

    def visit(node, path):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef)) and child.lineno <= lineno <= child.end_lineno:
                names.append(path + child.name)
                visit(child, path + child.name + ".")
    visit(tree, "")
    return names[-1] if names else None


def touched_by(examples):
    """The classes and functions (dotted) the examples' blocks change in the script (None: top-level lines), and the
    blocks' count; the result parses as Python 3.10."""
    src = SCRIPT.read_text(encoding="utf-8")
    new = patched_source(src, examples)
    tree = ast.parse(new, feature_version=(3, 10))
    touched = set()
    matcher = difflib.SequenceMatcher(a=src.splitlines(), b=new.splitlines(), autojunk=False)
    for op, _, _, j1, j2 in matcher.get_opcodes():
        if op != "equal":
            touched.update(enclosing(tree, line + 1) for line in range(j1, j2))
    return touched, len(doc_blocks(examples))


def test_the_edits_touch_the_setting_the_piece_and_its_switch_only():
    """The doc's 4 blocks: 3 edits inside Hyperparameters (its setting, read and checked) and GPT.__init__ (its
    switch), 1 new class, and nothing else: not training_loss (its term comes by declaration)."""
    touched, blocks = touched_by(("mtp",))
    assert blocks == 4
    assert touched == {"Hyperparameters.__init__", "Hyperparameters._validate", "MultiTokenHead",
                       "MultiTokenHead.__init__", "MultiTokenHead.term", "GPT.__init__", None}
    src = SCRIPT.read_text(encoding="utf-8")
    assert "MTP_WEIGHT" not in src and "MultiTokenHead" not in src  # an example: the script does not ship it


@pytest.mark.parametrize("examples", [("mtp",), ("mtp", "deep_sup", "layer_scale")], ids=["alone", "beside_others"])
def test_mtp_head_in_a_fresh_process(tmp_path, examples):
    """The test_patched_* tests below, on the patched copy (the MTP head alone, and beside the doc's other two worked
    examples: a second technique does not break it), in a process started with TRITON_INTERPRET=1."""
    script = tmp_path / "train_gpt_mtp.py"
    script.write_text(patched_source(SCRIPT.read_text(encoding="utf-8"), examples), encoding="utf-8")
    env = {**clean_environ(), "MTP_SCRIPT": str(script), "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_patched",
                           __file__], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    assert "5 passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


# ---- on the patched copy (MTP_SCRIPT set)

@pytest.fixture(scope="module")
def mtp():
    if PATCHED is None:
        pytest.skip("runs in test_mtp_head_in_a_fresh_process (MTP_SCRIPT: the patched copy)")
    spec = importlib.util.spec_from_file_location("train_gpt_mtp", PATCHED)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt_mtp"] = module
    spec.loader.exec_module(module)
    return module


def built(tg, weight, **env):
    h = tg.Hyperparameters({**SMALL, "MTP_WEIGHT": str(weight), **env})
    return h, tg.build_model(h)


def perturbed(model, seed=5):
    """Weights off their initial zeros (the MTP matrix too), so that every one has a gradient."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen).to(p.dtype))
    return model


def batch():
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 64, (2, 24), generator=gen) for _ in range(2)]


def grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return [loss.detach()] + [torch.zeros_like(p) if g is None else g
                              for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True))]


def test_patched_mtp_weight_0_is_the_default_run_bit_for_bit(mtp):
    """MTP_WEIGHT=0: no piece; the same parameters (names, values), optimizer groups and log lines, counts, and the
    training loss with every gradient equal to this checkout's script bit for bit."""
    import train_gpt as tg
    h0, plain = built(tg, 0)
    h1, patched = built(mtp, 0)
    assert patched.mtp is None and h1.mtp_weight == 0.0
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), patched.state_dict().values()))
    assert list(plain.state_dict()) == list(patched.state_dict())
    assert tg.optimizer_lines(h0, plain) == mtp.optimizer_lines(h1, patched)
    assert tg.model_param_counts(h0) == mtp.model_param_counts(h1)
    x, y = batch()
    want = grads(perturbed(plain), tg.training_loss(h0, plain, x, y))
    got = grads(perturbed(patched), mtp.training_loss(h1, patched, x, y))
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_patched_mtp_head_is_not_in_the_artifact(mtp, tmp_path):
    """The artifact of a model with the head is byte for byte that of the same weights without it; loading it keeps
    the head's own values; GPTQ's recorder does not name it; the model's state (what checkpoints save) has it."""
    h0, plain = built(mtp, 0)
    h1, with_head = built(mtp, 0.5)
    assert with_head.mtp is not None and "mtp.weight" in with_head.state_dict()
    assert list(mtp.artifact_state_dict(with_head)) == list(plain.state_dict())
    a, b = str(tmp_path / "plain.ptz"), str(tmp_path / "mtp.ptz")
    mtp.save_artifact(a, plain, False, h0, log=lambda line: None)
    mtp.save_artifact(b, with_head, False, h1, log=lambda line: None)
    assert Path(a).read_bytes() == Path(b).read_bytes()
    head = torch.full_like(with_head.mtp.weight, 0.25)
    with torch.no_grad():
        with_head.mtp.weight.copy_(head)
    loaded = mtp.load_artifact(b, h1, with_head)
    assert torch.equal(loaded.mtp.weight, head)
    assert with_head.mtp.weight.data_ptr() not in mtp.HessianRecorder(with_head).names


def test_patched_mtp_head_is_trained_by_the_group_the_table_gives_and_counted_apart(mtp):
    """Its piece declares "matrix": Muon trains it (the log's matrix line names it), and without the declaration the
    d x d matrix would be refused rather than land among the scalars; counted apart from the model's parameters, in
    the memory bound and in the checkpoint size (fp32 weight and EMA, bf16 Muon momentum)."""
    h0, plain = built(mtp, 0)
    h1, with_head = built(mtp, 0.5)
    d = h1.model_dim
    assert mtp.param_groups(with_head)["mtp.weight"] == "matrix"
    muon, adams = mtp.build_optimizers(h1, with_head)
    assert any(p is with_head.mtp.weight for p in muon.param_groups[0]["params"])
    assert not any(p is with_head.mtp.weight for opt in adams for g in opt.param_groups for p in g["params"])
    assert mtp.optimizer_lines(h1, with_head)[0].endswith("names:qo_bank,kv_bank,mlp_up_bank,mlp_down_bank,mtp.weight")
    c0, c1 = mtp.model_param_counts(h0), mtp.model_param_counts(h1)
    assert c1 == {**c0, "training_only": d * d}
    assert mtp.model_memory_bytes(h1) - mtp.model_memory_bytes(h0) == d * d * (4 + 4 + 2 + 4)  # + grad, momentum, EMA
    (s0, m0), (s1, m1) = mtp.checkpoint_payload_bytes(h0), mtp.checkpoint_payload_bytes(h1)
    assert (s1 - s0, m1 - m0) == (d * d * (4 + 4), d * d * 2)
    mtp.MultiTokenHead.optimizer_group = None  # a piece without its declaration: refused in one line
    try:
        with pytest.raises(mtp.ConfigError, match=r"^mtp\.weight \(32, 32\): a matrix that neither"):
            mtp.param_groups(with_head)
    finally:
        mtp.MultiTokenHead.optimizer_group = "matrix"


def mtp_formula(model, x, y, weight):
    """The objective written out: mean CE of the softcapped logits, plus weight x the mean CE of head(W x_t) against
    token t+2 over positions 0..T-2."""
    hidden = model.hidden(x)
    logits = 30.0 * torch.tanh(model.head(hidden) / 30.0)
    ahead = 30.0 * torch.tanh(model.head(hidden[:, :-1] @ model.mtp.weight.T) / 30.0)
    return (F.cross_entropy(logits.reshape(-1, 64), y.reshape(-1))
            + weight * F.cross_entropy(ahead.reshape(-1, 64), y[:, 1:].reshape(-1)))


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_patched_mtp_loss_is_the_formula_eager_and_fused(mtp, fused):
    """The Trainer's objective with the head: the loss and every gradient of the formula written out, eagerly and
    through the fused CE and MLP kernels (Triton's interpreter), and the head's term is weight x its own CE."""
    h, model = built(mtp, 0.5, FUSED_CE=str(int(fused)), FUSED_MLP=str(int(fused)))
    rt = mtp.Runtime(h, CPU, False, True, None)
    model = perturbed(rt.prepare_model(model))
    lines = mtp.select_fused_kernels(h, CPU, torch.float32)
    assert not fused or all("triton kernel (Triton interpreter on CPU" in line for line in lines), lines
    trainer = mtp.Trainer(rt, model)
    assert model.training and mtp._FUSED["ce"] == fused and mtp._FUSED["mlp"] == fused
    x, y = batch()
    got = grads(model, trainer.forward(x, y))
    mtp._FUSED.update(ce=False, mlp=False)
    want = grads(model, mtp_formula(model, x, y, 0.5))
    plain = grads(model, mtp_formula(model, x, y, 0.0))
    assert float(want[0] - plain[0]) > 0.1 * float(plain[0])  # the term: a tenth of the loss or more here
    assert float(got[0] - want[0]) == pytest.approx(0.0, abs=1e-6 * float(want[0]))
    for g, w in zip(got[1:], want[1:]):  # to fp32 reassociation; the bf16 embedding's gradient to its rounding
        tol = 1e-5 if w.dtype == torch.float32 else 2 ** -8
        assert float((g - w).abs().max()) <= tol * float(w.abs().max()), (w.shape, w.dtype)
