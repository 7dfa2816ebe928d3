"""The MTP head of docs/frontier.md "A piece with weights" (issue 54), the test to copy for a piece that owns weights.

The doc's code blocks are applied to a copy of train_gpt.py (each block's first line says where: after, before or
replacing a line found exactly once); test_the_edits_touch_the_setting_the_piece_and_its_switch_only checks where
they land. The test_patched_* tests run in this process on one copy with the doc's three worked examples applied
(worked_copy: written once for the session, imported once per process as `train_gpt_worked` beside this checkout's
`train_gpt`), the MTP head switched on by its setting and the other two left off: the head beside a second technique.
The fused half of the loss formula runs in a child of the tests' launcher started with TRITON_INTERPRET=1 (the
interpreter must be on before Triton is imported)."""
from __future__ import annotations

import ast
import difflib
import hashlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import launcher
from conftest import REPO, SCRIPT, clean_environ, computed_once, perturbed, shared_folder

DOC = REPO / "docs" / "frontier.md"
WHERE = re.compile(r"# train_gpt\.py \((\w+)\): (after|before|replacing): (.+)")  # (example): how: anchor
EXAMPLES = ("mtp", "deep_sup", "layer_scale", "value_residual", "layer_drop")  # the doc's worked examples
SMALL = {"MODEL_DIM": "32", "NUM_HEADS": "2", "NUM_KV_HEADS": "1", "VOCAB_SIZE": "64", "VE_LAYERS": "1",
         "NUM_LAYERS": "2", "XSA_LAST_N": "1", "TRAIN_SEQ_LEN": "24", "AUTOCAST_DTYPE": "fp32"}
CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: one intra-op thread per module


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


def import_copy(path, name, keep_ops=True):
    """The script copy at `path` imported as module `name`. keep_ops: this process's custom ops (pgolf::*, train_gpt's)
    serve the copy: they are registered first, so the copy's select_fused_kernels finds them and registers none
    (register_fused_ops); registering the copy's would make its kernels and its _FUSED serve every later test of this
    process. The copy's calls to them reach train_gpt's kernels, the same code (no example touches them)."""
    if name in sys.modules:
        return sys.modules[name]
    tg = importlib.import_module("train_gpt")
    if keep_ops:
        tg.register_fused_ops()
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def copy_path(tmp_path_factory, examples=EXAMPLES):
    """train_gpt.py with the doc's blocks of `examples` applied, written once for the session (every xdist worker
    reads the same file); keyed by the script's and the doc's bytes."""
    key = hashlib.sha256(SCRIPT.read_bytes() + DOC.read_bytes() + repr(examples).encode()).hexdigest()[:16]
    name = "train_gpt_" + "_".join(examples)

    def build(folder):
        (folder / f"{name}.py").write_text(patched_source(SCRIPT.read_text(encoding="utf-8"), examples),
                                           encoding="utf-8")
    return computed_once(shared_folder(tmp_path_factory) / f"{name}_{key}", build) / f"{name}.py"


def worked_copy(tmp_path_factory):
    """The copy with the three worked examples applied, imported in this process (once) as `train_gpt_worked`."""
    return import_copy(copy_path(tmp_path_factory), "train_gpt_worked")


@pytest.fixture(scope="module")
def mtp(tmp_path_factory):
    return worked_copy(tmp_path_factory)


def built(tg, weight, **env):
    h = tg.Hyperparameters({**SMALL, "MTP_WEIGHT": str(weight), **env})
    return h, tg.build_model(h)


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


def check_loss_formula(mtp, fused):
    """The Trainer's objective with the head: the loss and every gradient of the formula written out, eagerly or
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


def test_patched_mtp_loss_is_the_formula_eagerly(mtp):
    check_loss_formula(mtp, fused=False)


FUSED_CHECK = """import sys
sys.path[:0] = [sys.argv[2], sys.argv[3]]
import test_mtp
test_mtp.check_loss_formula(test_mtp.import_copy(sys.argv[1], "train_gpt_worked", keep_ops=False), fused=True)
print("fused formula: ok")
"""


def test_patched_mtp_loss_is_the_formula_through_the_fused_kernels(tmp_path_factory, tmp_path):
    """check_loss_formula with FUSED_CE=1 FUSED_MLP=1 on the same copy, in a child of the launcher's zygote for
    TRITON_INTERPRET=1 (the kernel runs' own: conftest.run_training's environment); there the copy registers its
    ops (the child is its own process)."""
    env = {**clean_environ(), "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = launcher.run(["-c", FUSED_CHECK, str(copy_path(tmp_path_factory)), str(REPO / "tests"), str(REPO)], env,
                        tmp_path, timeout=300)
    assert proc.returncode == 0 and "fused formula: ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
