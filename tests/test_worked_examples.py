"""Issue 61: one block path, named taps, objective terms that add up, shipped tensors declared; issue 71: layer states
by name (LayerStates), the run context (CONTEXT) set by the loop, and docs/frontier.md's worked examples "Deep
supervision from a named tap", "A per-layer scale that ships", "State across layers: the value residual" and "State
across steps: layer drop", applied to a copy of train_gpt.py as tests/test_mtp.py applies the MTP head. The
test_patched_* tests run in this process on one copy with the five examples applied (tests/test_mtp.py's worked_copy,
shared with its MTP tests), each example switched on by its own setting beside the other four (issue 61 item 3: a
worked example's test survives a second technique applied beside it); the five switched on together, each example
applied alone, and the five off (the default's specialised file) are checked on the same terms."""
from __future__ import annotations

import json

import pytest
import torch

import train_gpt as tg
from conftest import perturbed
from test_mtp import EXAMPLES, batch, copy_path, grads, import_copy, touched_by, worked_copy

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: one intra-op thread per module

# Each preset at a small size; every layer kind among them: sequential (all), GPT-J parallel (record_0409, from
# layer 3), two lanes (record_0427 on, from layer 3); the layer loop over layers 1-2.
SIZES = {"NUM_LAYERS": "5", "MODEL_DIM": "32", "NUM_HEADS": "2", "NUM_KV_HEADS": "1", "VOCAB_SIZE": "64",
         "XSA_LAST_N": "5", "VE_LAYERS": "3,4", "LOOP_START": "1", "LOOP_END": "2", "PARALLEL_RESIDUAL_START": "3",
         "TRAIN_SEQ_LEN": "24", "AUTOCAST_DTYPE": "fp32"}


def preset_model(tg_module, preset, **env):
    h = tg_module.Hyperparameters({**SIZES, "PRESET": preset, **env})
    return h, perturbed(tg_module.build_model(h))


def layer_kinds(model):
    """{physical layer: its kind} in the looped order (every layer runs in it)."""
    kinds = {}
    start = model.lane_start if model.lanes is not None else None
    lanes = False
    encoder, decoder = model.orders[True]
    for k, i in enumerate(encoder + decoder):
        lanes = lanes or (start is not None and k >= len(encoder) and i >= start)
        kinds[i] = "lanes" if lanes else "parallel" if model.blocks[i].parallel else "sequential"
    return kinds


def bank_grads_by_layer(model, x, y):
    """{physical layer: whether any of its six bank slices has a nonzero gradient} of the training loss, looped."""
    model.looping = True
    model.zero_grad()
    tg.training_loss(None, model, x, y).backward()
    return {i: any(bool(g.grad is not None and g.grad[j].abs().sum() > 0) for g, j in
                   ((model.qo_bank, i), (model.qo_bank, model.num_layers + i), (model.kv_bank, i),
                    (model.kv_bank, model.num_layers + i), (model.mlp_up_bank, i), (model.mlp_down_bank, i)))
            for i in range(model.num_layers)}


def test_a_change_in_block_branch_reaches_every_layer_of_every_preset(monkeypatch):
    """Block.branch is the one place a per-block change goes: zeroing both branches there, once, leaves no bank slice
    of any layer a gradient in any preset (a layer kind that bypassed it would keep its gradients), where without the
    change every layer has them; the presets cover the three layer kinds."""
    x, y = batch()
    seen = set()
    for preset in tg.PRESETS:
        _, model = preset_model(tg, preset)
        kinds = layer_kinds(model)
        seen.update(kinds.values())
        assert all(bank_grads_by_layer(model, x, y).values()), preset
        with monkeypatch.context() as m:
            m.setattr(tg.Block, "branch", lambda self, name, out, states=None: out * 0)
            assert not any(bank_grads_by_layer(model, x, y).values()), (preset, kinds)
    assert seen == {"sequential", "parallel", "lanes"}


def traced_states(model, x):
    """The residual after each layer run (the lanes' mean with two lanes), in order, and the run's physical layers."""
    states, block = [], model._block

    def traced(i, *args):
        out = block(i, *args)
        states.append((i, 0.5 * (out[0] + out[1]) if isinstance(out, tuple) else out))
        return out
    model._block = traced
    try:
        final = model.hidden(x)
    finally:
        del model._block
    return final, states


@pytest.mark.parametrize("preset", ["record_0323", "record_0409", "record_0427"])
def test_taps_name_each_run_and_each_layers_last_run(preset):
    """runs.J is the J-th run's state, blocks.I physical layer I's last run's (looped: layer 1 and 2 run twice), the
    lanes' mean with two lanes; asking for taps changes nothing else, asking for none returns no dict; an unknown name
    is refused in one line."""
    _, model = preset_model(tg, preset, NUM_LOOPS="1")
    model.looping = True
    x, _ = batch()
    with torch.no_grad():
        final, states = traced_states(model, x)
        names = [f"runs.{j}" for j in range(len(states))] + [f"blocks.{i}" for i in range(model.num_layers)]
        hidden, taps = model.hidden(x, taps=tuple(names))
        out = model.outputs(x)
    assert [i for i, _ in states].count(1) == 2
    assert torch.equal(hidden, final) and torch.equal(out.hidden, final) and out.taps == {}
    for j, (i, state) in enumerate(states):
        assert torch.equal(taps[f"runs.{j}"], state)
    for i in range(model.num_layers):
        assert torch.equal(taps[f"blocks.{i}"], [s for k, s in states if k == i][-1])
    with pytest.raises(tg.ConfigError, match=r"^no layer state \['blocks\.9'\]"):
        model.hidden(x, taps=("blocks.9",))


def test_terms_add_up_without_editing_training_loss():
    """Two pieces declaring terms, each asking for a tap, on one model: training's loss is the CE plus each weight
    times its term, the taps they asked for handed to them."""
    h, model = preset_model(tg, "record_0427")
    x, y = batch()
    seen = []

    class Term(torch.nn.Module):
        def __init__(self, weight, tap):
            super().__init__()
            self.term_weight, self.taps = weight, (tap,)

        def term(self, model, out, targets):
            seen.append(sorted(out.taps))
            return out.taps[self.taps[0]].square().mean()
    model.t1, model.t2 = Term(0.5, "blocks.1"), Term(0.25, "runs.2")
    with torch.no_grad():
        got = tg.training_loss(h, model, x, y)
        _, taps = model.hidden(x, taps=("blocks.1", "runs.2"))
        ce = model.cross_entropy(model.outputs(x).logits, y)
    assert seen == [["blocks.1", "runs.2"]] * 2
    assert torch.equal(got, ce + 0.5 * taps["blocks.1"].square().mean() + 0.25 * taps["runs.2"].square().mean())


def test_a_piece_declares_how_its_tensors_ship_and_a_differing_artifact_is_named(tmp_path):
    """artifact_storage overrides the rule (fp32 kept, int8 of a small matrix); the size line names each piece; an
    artifact of other settings is refused in one line naming the piece and its setting."""
    h, model = preset_model(tg, "record_0427")
    flat = tg.unbank_state_dict(tg.artifact_state_dict(model), model.num_layers)
    w, meta = tg.quantize_state_dict(flat, h, storage={"lanes.post": "fp32", "blocks.0.attn.c_q.weight": "int8"})
    assert w["lanes.post"].dtype == torch.float32 and meta["blocks.0.attn.c_q.weight"]["type"] == "int8"
    assert w["lanes.resid"].dtype == torch.float16 and meta["blocks.1.attn.c_q.weight"] == "passthrough"  # the rule: small
    lines = []
    path = str(tmp_path / "a.ptz")
    tg.save_artifact(path, model, False, h, log=lines.append)
    pieces = [line for line in lines if line.startswith("artifact_pieces: ")]
    assert len(pieces) == 1 and " lanes:" in pieces[0] and " blocks.*.attn:" in pieces[0]
    _, other = preset_model(tg, "record_0427", PARALLEL_MODE="gptj")
    with pytest.raises(tg.ConfigError, match=r"a\.ptz: the artifact's tensors are not this model's: lanes not in this "
                                             r"model \(a setting this run leaves off\)$"):
        tg.load_artifact(path, h, other)
    tg.save_artifact(path, other, False, h, log=lines.append)
    with pytest.raises(tg.ConfigError, match=r"lanes not in the artifact \(PARALLEL_MODE\)$"):
        tg.load_artifact(path, h, model)


# ---- the worked examples on copies of the script

SWITCH = {"deep_sup": "GPT.__init__", "layer_scale": "Block.__init__", "value_residual": "Block.__init__",
          "layer_drop": "Block.__init__"}


@pytest.mark.parametrize("example, piece, validated", [
    ("deep_sup", "DeepSupervision", True), ("layer_scale", "LayerScale", False),
    ("value_residual", "ValueResidual", False), ("layer_drop", "LayerDrop", True),
])
def test_each_example_touches_its_setting_its_piece_and_one_switch(example, piece, validated):
    """At most four places: its setting (read, and checked where it can be wrong), its piece (a new class), one
    switch-on line, and its test; no signature, Block.forward, the attention or the training loop."""
    touched, _ = touched_by((example,))
    methods = {"deep_sup": ("__init__", "term")}.get(example, ("__init__", "forward"))
    setting = {"Hyperparameters.__init__"} | ({"Hyperparameters._validate"} if validated else set())
    assert touched == {piece, *(f"{piece}.{m}" for m in methods)} | setting | {SWITCH[example], None}


@pytest.fixture(scope="module")
def worked(tmp_path_factory):
    return worked_copy(tmp_path_factory)


def same_model_and_loss(plain, h0, patched, h1, x, y, tg_module):
    assert list(plain.state_dict()) == list(patched.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), patched.state_dict().values()))
    want = grads(plain, tg.training_loss(h0, plain, x, y))
    got = grads(patched, tg_module.training_loss(h1, patched, x, y))
    assert all(torch.equal(a, b) for a, b in zip(want, got))


@pytest.mark.parametrize("preset", ["record_0323", "record_0427"])
def test_patched_deep_sup_off_is_the_default_and_on_adds_its_formula(worked, preset):
    """DEEP_SUP_WEIGHT=0: the unpatched model and loss bit for bit. > 0: the loss is the CE plus weight x the CE of
    head(W RMS(state after layer 2's last run)), W the identity at first; not in the artifact."""
    x, y = batch()
    h0, plain = preset_model(tg, preset)
    h1, off = preset_model(worked, preset)
    assert off.deep_sup is None
    same_model_and_loss(plain, h0, off, h1, x, y, worked)
    h2, on = preset_model(worked, preset, DEEP_SUP_WEIGHT="0.5", DEEP_SUP_LAYER="2")
    assert "deep_sup.weight" not in worked.artifact_state_dict(on)
    on.looping = True
    with torch.no_grad():
        on.deep_sup.weight.copy_(torch.eye(32) + 0.01)
        _, states = traced_states(on, x)
        state = [s for i, s in states if i == 2][-1]
        xn = worked.rms_norm(state)
        ahead = on.head(torch.nn.functional.linear(xn, on.deep_sup.weight.to(xn.dtype)))
        want = on.cross_entropy(on.outputs(x).logits, y) + 0.5 * on.cross_entropy(ahead, y)
        assert torch.allclose(worked.training_loss(h2, on, x, y), want, rtol=1e-5)


@pytest.mark.parametrize("preset", list(tg.PRESETS))
def test_patched_layer_scale_reaches_every_layer_and_ships(worked, preset, tmp_path):
    """LAYER_SCALE=0: the unpatched model and loss bit for bit. 1: ones change nothing; zeros leave no layer's banks
    a gradient (every layer kind); the scales ship as fp32 and load back exactly; an artifact without them is refused
    naming the piece and LAYER_SCALE."""
    x, y = batch()
    h0, plain = preset_model(tg, preset)
    h1, off = preset_model(worked, preset, COMPRESSOR="lzma")  # the fastest compressor: the artifacts are tiny
    same_model_and_loss(plain, h0, off, h1, x, y, worked)
    h2, on = preset_model(worked, preset, LAYER_SCALE="1", COMPRESSOR="lzma")
    assert on.load_state_dict(off.state_dict(), strict=False).missing_keys == [
        f"blocks.{i}.branch_scale.scale" for i in range(5)]  # off's weights (perturbed drew the scales too)
    with torch.no_grad():
        for b in on.blocks:
            b.branch_scale.scale.fill_(1.0)
        assert torch.equal(on.forward_logits(x), off.forward_logits(x))
        for b in on.blocks:
            b.branch_scale.scale.zero_()
    assert not any(bank_grads_by_layer(on, x, y).values())
    with torch.no_grad():
        for i, b in enumerate(on.blocks):
            b.branch_scale.scale.copy_(torch.linspace(0.5, 1.5, 32) + i / 3)
    path = str(tmp_path / "scaled.ptz")
    worked.save_artifact(path, on, False, h2, log=lambda line: None)
    _, again = preset_model(worked, preset, LAYER_SCALE="1", COMPRESSOR="lzma")
    again = worked.load_artifact(path, h2, again)
    assert all(torch.equal(a.branch_scale.scale, b.branch_scale.scale) for a, b in zip(on.blocks, again.blocks))
    worked.save_artifact(path, off, False, h1, log=lambda line: None)
    with pytest.raises(worked.ConfigError, match=r"blocks\.\*\.branch_scale not in the artifact \(LAYER_SCALE\)"):
        worked.load_artifact(path, h2, again)


ALL_ON = {"MTP_WEIGHT": "0.5", "DEEP_SUP_WEIGHT": "0.25", "DEEP_SUP_LAYER": "2", "LAYER_SCALE": "1",
          "VALUE_RESIDUAL": "1", "LAYER_DROP": "0.5"}
PIECES = {"mtp": ("mtp.weight",), "deep_sup": ("deep_sup.weight",),
          "layer_scale": tuple(f"blocks.{i}.branch_scale.scale" for i in range(5)),
          "value_residual": tuple(f"blocks.{i}.value_mix.mix" for i in range(1, 5)), "layer_drop": ()}
SHIPPED = ("branch_scale", "value_mix")  # the pieces in the artifact; the others are training-only or hold nothing


def check_on(tg_module, preset, settings, pieces):
    """A model with `settings` on: training's loss is the CE plus each term piece's weight x its term; one step of
    the optimizers the groups give changes every parameter of `pieces` (each is trained); the artifact holds the
    shipped pieces' tensors alone, and they load back exactly."""
    h, model = preset_model(tg_module, preset, COMPRESSOR="lzma", **settings)
    model.looping = True
    x, y = batch()
    terms = model.terms()
    with torch.no_grad():
        out = model.outputs(x, taps=tuple(t for piece in terms for t in piece.taps))
        want = model.cross_entropy(out.logits, y) + sum(p.term_weight * p.term(model, out, y) for p in terms)
    loss = tg_module.training_loss(h, model, x, y)
    assert torch.allclose(loss, want, rtol=1e-6), (float(loss), float(want))
    params = dict(model.named_parameters())
    before = {name: params[name].detach().clone() for name in pieces}
    muon, adams = tg_module.build_optimizers(h, model)
    loss.backward()
    for opt in (muon, *adams):
        opt.step()
    assert [name for name in pieces if torch.equal(params[name], before[name])] == []
    shipped = [name for name in pieces if any(part in name for part in SHIPPED)]
    assert sorted(set(pieces) & set(model.state_dict())) == sorted(pieces)
    assert [name for name in pieces if name in tg_module.artifact_state_dict(model)] == shipped
    return h, model


def test_the_five_switched_on_together_each_term_adds_trains_and_ships_as_declared(worked, tmp_path):
    """The five examples on at once, with two lanes and the layer loop (record_0427): the loss adds both terms, every
    piece trains, the scales ship (fp32, loaded back exactly) and the value mixes (fp16), and the training-only
    matrices stay out of the artifact, loading leaving them as the model has them."""
    h, model = check_on(worked, "record_0427", ALL_ON, [n for example in EXAMPLES for n in PIECES[example]])
    path = str(tmp_path / "all.ptz")
    worked.save_artifact(path, model, False, h, log=lambda line: None)
    _, again = preset_model(worked, "record_0427", COMPRESSOR="lzma", **ALL_ON)
    heads = {n: t.detach().clone() for n, t in again.state_dict().items() if n.startswith(("mtp.", "deep_sup."))}
    again = worked.load_artifact(path, h, again)
    for name, t in again.state_dict().items():
        if "branch_scale" in name:
            assert t.dtype == torch.float32 and torch.equal(t, model.state_dict()[name]), name
        if "value_mix" in name:
            assert torch.equal(t, model.state_dict()[name].half().float()), name
    assert all(torch.equal(again.state_dict()[n], t) for n, t in heads.items()) and len(heads) == 2


@pytest.mark.parametrize("example", EXAMPLES)
def test_each_example_applied_alone_works(example, tmp_path_factory):
    """Each example applied alone to a copy of the script (its blocks only): off, the unpatched model; on, its term
    adds to the loss, its piece trains and ships as declared (as beside the others, above)."""
    alone = import_copy(copy_path(tmp_path_factory, (example,)), f"train_gpt_{example}")
    h0, plain = preset_model(tg, "record_0323")
    h1, off = preset_model(alone, "record_0323")
    assert list(plain.state_dict()) == list(off.state_dict())
    settings = {k: v for k, v in ALL_ON.items() if k.startswith(example.upper())}
    check_on(alone, "record_0323", settings, PIECES[example])


# ---- state across layers (LayerStates) and across steps (the run context), and the two examples that use them

@pytest.fixture
def context():
    """enter(module, stage, step): the module's CONTEXT set as the training loop sets it; every module's context
    back at the evaluation stage, step 0, afterwards."""
    touched = []

    def enter(module, stage, step=None, progress=None):
        touched.append(module)
        module.CONTEXT.enter(stage, step, progress)
    yield enter
    for module in touched:
        module.CONTEXT.enter("evaluation", 0, 0.0)


STATE_NAMES = ("input", "q", "k", "v", "attn", "mlp")


class Spy(torch.nn.Module):
    """A block_branch piece for every hook name that changes nothing and records what it saw."""
    block_branch = ("q", "k", "v", "attn", "mlp")

    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def forward(self, name, out, states):
        self.seen.append((name, out))
        return out


@pytest.mark.parametrize("preset", ["record_0323", "record_0409", "record_0427"])
def test_layer_states_name_what_each_run_made_and_nothing_unasked_is_kept(preset, monkeypatch):
    """Looped, each run's states asked for as taps: q, k, v, attn and mlp are what the hooks returned in that run,
    input is the residual the run read (the previous run's in the encoder, where no skip joins), with
    resid_mix = (1, 0) a sequential or parallel run's residual after is input + attn + mlp, and blocks.I.NAME is layer
    I's last run's; without taps or reads nothing is kept; a read of a state not made yet is refused in one line."""
    _, model = preset_model(tg, preset, NUM_LOOPS="1")
    model.looping = True
    seen = []
    for b in model.blocks:
        b.spy = Spy(seen)
        b.resid_mix.data.copy_(torch.tensor([[1.0], [0.0]]).expand_as(b.resid_mix))
    encoder, decoder = model.orders[True]
    order = encoder + decoder
    names = tuple(f"runs.{j}.{n}" for j in range(len(order)) for n in STATE_NAMES) + tuple(
        f"blocks.{i}.{n}" for i in range(model.num_layers) for n in STATE_NAMES) + tuple(
        f"runs.{j}" for j in range(len(order)))
    x, _ = batch()
    with torch.no_grad():
        _, states = model.hidden(x, taps=names)
    assert len(seen) == 5 * len(order)
    for j, i in enumerate(order):
        for k, name in enumerate(("q", "k", "v", "attn", "mlp")):
            assert seen[5 * j + k][0] == name and torch.equal(seen[5 * j + k][1], states[f"runs.{j}.{name}"])
        if 0 < j < len(encoder):
            assert torch.equal(states[f"runs.{j}.input"], states[f"runs.{j - 1}"])
        if model.lanes is None or j < len(encoder) or i < model.lane_start:
            s = f"runs.{j}."
            assert torch.allclose(states[f"runs.{j}"], states[s + "input"] + states[s + "attn"] + states[s + "mlp"],
                                  rtol=0, atol=1e-5), (preset, j)
        if j == max(r for r, layer in enumerate(order) if layer == i):
            assert all(torch.equal(states[f"blocks.{i}.{n}"], states[f"runs.{j}.{n}"]) for n in STATE_NAMES)
    made, base = [], tg.LayerStates
    monkeypatch.setattr(tg, "LayerStates", type("Counted", (base,), {
        "__init__": lambda self, names: (made.append(self), base.__init__(self, names))[1]}))
    with torch.no_grad():
        model.hidden(x)
    assert made == []  # none asked: no LayerStates at all, so nothing kept (and none in a specialised file)

    class Early(torch.nn.Module):
        block_branch, reads = ("v",), ("blocks.4.v",)

        def forward(self, name, out, states):
            return out + states["blocks.4.v"]
    model.blocks[1].early = Early()
    with pytest.raises(tg.ConfigError, match=r"^layer state 'blocks\.4\.v' is read before it is made"):
        model.hidden(x)


def attention_and_mlp_grads(model, x, y):
    """{physical layer: (any attention bank slice has a gradient, any MLP bank slice has one)}, looped."""
    model.looping = True
    model.zero_grad()
    tg.training_loss(None, model, x, y).backward()
    n = model.num_layers

    def nonzero(bank, j):
        return bool(bank.grad is not None and bank.grad[j].abs().sum() > 0)
    return {i: (any(nonzero(b, j) for b, j in ((model.qo_bank, i), (model.qo_bank, n + i), (model.kv_bank, i),
                                                (model.kv_bank, n + i))),
                any(nonzero(b, i) for b in (model.mlp_up_bank, model.mlp_down_bank))) for i in range(n)}


def test_a_change_to_the_values_through_block_branch_reaches_every_attention_of_every_preset(monkeypatch):
    """The "v" hook reaches every layer's attention in every layer kind: zeroing the values there leaves no
    attention bank slice a gradient while every MLP keeps its own."""
    x, y = batch()
    branch = tg.Block.branch
    monkeypatch.setattr(tg.Block, "branch", lambda self, name, out, states=None:
                        out * 0 if name == "v" else branch(self, name, out, states))
    for preset in tg.PRESETS:
        _, model = preset_model(tg, preset)
        assert set(attention_and_mlp_grads(model, x, y).values()) == {(False, True)}, preset


@pytest.mark.parametrize("preset", ["record_0323", "record_0427"])
def test_patched_value_residual_mixes_the_first_layers_values_and_ships(worked, preset, tmp_path):
    """VALUE_RESIDUAL=0: the unpatched model and loss bit for bit. 1: no piece in layer 0, one in each later layer;
    mixes (1, 0) give the plain model; a mix (a, b) in layer 2 alone makes its first run's values a * v + b * v_0 (v
    and v_0 those of the plain model there), seen at initialisation (perturbed); the mixes ship (fp16) and load back;
    an artifact without them is refused naming VALUE_RESIDUAL."""
    x, y = batch()
    h0, plain = preset_model(tg, preset)
    h1, off = preset_model(worked, preset, COMPRESSOR="lzma")
    same_model_and_loss(plain, h0, off, h1, x, y, worked)
    h2, on = preset_model(worked, preset, VALUE_RESIDUAL="1", COMPRESSOR="lzma")
    assert on.blocks[0].value_mix is None and all(b.value_mix is not None for b in on.blocks[1:])
    assert on.load_state_dict(off.state_dict(), strict=False).missing_keys == list(PIECES["value_residual"])
    on.looping = off.looping = True
    order = sum(on.orders[True], [])
    first = order.index(2)
    names = ("blocks.0.v", f"runs.{first}.v")
    with torch.no_grad():
        for b in on.blocks[1:]:
            b.value_mix.mix.copy_(torch.tensor([1.0, 0.0]))
        assert torch.equal(on.forward_logits(x), off.forward_logits(x))
        mix = torch.tensor([0.7, -0.4])
        on.blocks[2].value_mix.mix.copy_(mix)
        _, got = on.hidden(x, taps=names)
        _, want = off.hidden(x, taps=names)
        assert torch.equal(got[names[1]], mix[0] * want[names[1]] + mix[1] * want[names[0]])
        assert not torch.equal(on.forward_logits(x), off.forward_logits(x))
        for b in on.blocks[1:]:
            b.value_mix.mix.copy_(torch.randn(2))
    path = str(tmp_path / "vr.ptz")
    worked.save_artifact(path, on, False, h2, log=lambda line: None)
    _, again = preset_model(worked, preset, VALUE_RESIDUAL="1", COMPRESSOR="lzma")
    again = worked.load_artifact(path, h2, again)
    assert all(torch.equal(a.value_mix.mix, b.value_mix.mix.half().float()) for a, b in zip(again.blocks[1:],
                                                                                           on.blocks[1:]))
    worked.save_artifact(path, off, False, h1, log=lambda line: None)
    with pytest.raises(worked.ConfigError, match=r"blocks\.\*\.value_mix not in the artifact \(VALUE_RESIDUAL\)"):
        worked.load_artifact(path, h2, again)


def layer_factors(model, factors):
    """The model's forward with each layer's attention and MLP outputs times factors[layer] (through Block.branch)."""
    for b in model.blocks:
        b.factor = Factor(factors[b.index])
    return model


class Factor(torch.nn.Module):
    block_branch = True

    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, name, out, states):
        return out * self.f


def test_patched_layer_drop_drops_the_same_layers_on_every_rank_in_training_steps_only(worked, context):
    """LAYER_DROP=0: the unpatched model and loss bit for bit. 0.5: in a training step the layers with
    CONTEXT.uniform(SEED, layer) < 0.5 lose every bank gradient (two lanes and the layer loop: record_0427), the same
    layers in a model of other weights and the same SEED (another rank), others for another step; the loss is the
    plain model's with each layer's outputs times 0 or 1 / (1 - p); in validation, calibration, TTT and evaluation
    the loss is the plain model's."""
    x, y = batch()
    h0, plain = preset_model(tg, "record_0427")
    h1, off = preset_model(worked, "record_0427")
    same_model_and_loss(plain, h0, off, h1, x, y, worked)
    h2, on = preset_model(worked, "record_0427", LAYER_DROP="0.5")
    on.load_state_dict(off.state_dict())
    _, rank1 = preset_model(worked, "record_0427", LAYER_DROP="0.5")
    perturbed(rank1, seed=9)
    for stage in ("validation", "calibration", "ttt", "evaluation"):
        context(worked, stage, 3)
        assert torch.equal(worked.training_loss(h2, on, x, y), worked.training_loss(h1, off, x, y)), stage
    patterns = set()
    for step in range(6):
        context(worked, "training", step, step / 6)
        want = {i for i in range(5) if float(worked.CONTEXT.uniform(h2.seed, i)) < 0.5}
        for model in (on, rank1):
            grads = bank_grads_by_layer(model, x, y)
            assert {i for i, g in grads.items() if not g} == want, step
        patterns.add(frozenset(want))
        if 0 < len(want) < 5:
            with torch.no_grad():
                on.looping = off.looping = True
                scaled = layer_factors(off, {i: 0.0 if i in want else 2.0 for i in range(5)})
                assert torch.allclose(worked.training_loss(h2, on, x, y), worked.training_loss(h1, scaled, x, y),
                                      rtol=1e-6)
                for b in off.blocks:
                    del b.factor
    assert len(patterns) > 1  # the draw follows the step


def test_patched_layer_drop_compiled_reads_the_step_without_recompiling(worked, context):
    """COMPILE=1 (aot_eager, as tests/test_compile.py's in-process checks): the Trainer's compiled train_forward over
    10 training steps, the context set before each as _train_loop sets it: one graph for all of them (no
    recompilation after the first step), and at each step the eager loss of that step (the graph reads the step)."""
    h = worked.Hyperparameters({**SIZES, "NUM_LAYERS": "2", "XSA_LAST_N": "1", "VE_LAYERS": "1", "PARALLEL_RESIDUAL_START": "-1",
                                "LOOP_END": "1", "PRESET": "record_0323", "LAYER_DROP": "0.5", "COMPILE": "1",
                                "COMPILE_BACKEND": "aot_eager"})
    rt = worked.Runtime(h, torch.device("cpu"), False, True, None)
    model = perturbed(rt.prepare_model(worked.build_model(h)))
    trainer = worked.Trainer(rt, model)
    x, y = batch()
    losses = []
    for step in range(10):
        context(worked, "training", step, step / 10)
        got = trainer.forward(x, y)
        with torch.no_grad():
            assert torch.allclose(got, worked.training_loss(h, model, x, y), rtol=1e-6), step
        losses.append(float(got.detach()))
    assert trainer.forward.graphs == 1 and trainer.forward.eager_calls == 0
    assert len(set(losses)) > 1


def test_the_five_off_leave_the_default_submission_as_it_was(tmp_path_factory, sample_data):
    """The five applied and off: the default run's specialised file is the unpatched one's line for line but its
    SPECIALISED record, which adds exactly the five settings at their off values (float weights and probabilities
    at 0 fold like a bool), and it refuses another value of each in one line."""
    from test_specialise_tools import preset_files, sp, specialised_module

    patched = sp.specialise(copy_path(tmp_path_factory).read_text(encoding="utf-8"), {"PRESET": "record_0323"})
    plain = (preset_files(tmp_path_factory) / "record_0323.py").read_text(encoding="utf-8")
    a, b = plain.splitlines(), patched.text.splitlines()
    assert [line for line in a if not line.startswith("SPECIALISED = ")] == \
        [line for line in b if not line.startswith("SPECIALISED = ")]
    values = {text: sp.recorded(text)["values"] for text in (plain, patched.text)}
    assert {k: v for k, v in values[patched.text].items() if k not in values[plain]} == {
        "MTP_WEIGHT": 0.0, "DEEP_SUP_WEIGHT": 0.0, "LAYER_SCALE": False, "VALUE_RESIDUAL": False, "LAYER_DROP": 0.0}
    path = tmp_path_factory.mktemp("five_off") / "train_gpt.py"
    path.write_text(patched.text, encoding="utf-8")
    module = specialised_module(path)
    base = {"PRESET": "record_0323", "DATA_PATH": sample_data["DATA_PATH"]}
    module.Hyperparameters({**base, "LAYER_DROP": "0"})
    with pytest.raises(module.ConfigError, match=r"^LAYER_DROP=0\.5: this file is specialised to LAYER_DROP=0 "):
        module.Hyperparameters({**base, "LAYER_DROP": "0.5"})


def test_the_training_loop_and_calibration_set_the_stage_step_and_progress(monkeypatch):
    """_train_loop sets the context before each step (training, the steps done, training_fraction) and before each
    validation (validation: never a training step's stage left over), and collect_hessians sets calibration; the
    model's work is replaced by recorders (what each saw), so nothing trains."""
    h = tg.Hyperparameters({**SIZES, "ITERATIONS": "4", "VAL_LOSS_EVERY": "2", "TRAIN_LOG_EVERY": "0",
                            "WARMDOWN_ITERS": "0", "MAX_WALLCLOCK_SECONDS": "0", "GPTQ_CALIBRATION_BATCHES": "1"})
    rt = tg.Runtime(h, torch.device("cpu"), False, True, None)
    model = tg.build_model(h)
    seen = []

    def note(what):
        c = tg.CONTEXT
        seen.append((what, c.stage, c.step, c.progress, int(c.step_t), float(c.progress_t)))

    monkeypatch.setattr(tg.Trainer, "step", lambda self, *a, **k: (note("step"), torch.tensor(1.0))[1])
    monkeypatch.setattr(tg, "eval_val", lambda *a, **k: (note("val"), (1.0, 1.0))[1])
    logits = tg.GPT.forward_logits
    monkeypatch.setattr(tg.GPT, "forward_logits", lambda self, x, *a: (note("calibration"), logits(self, x, *a))[1])
    try:
        tg._train_loop(rt, tg.Trainer(rt, model), None, None, None)
        tg.collect_hessians(rt, model, type("Loader", (), {"next_batch": lambda self: batch()})())
    finally:
        tg.CONTEXT.enter("evaluation", 0, 0.0)
    assert [s[:4] for s in seen] == [
        ("val", "validation", 0, 0.0), ("step", "training", 0, 0.0), ("step", "training", 1, 0.25),
        ("val", "validation", 2, 0.25), ("step", "training", 2, 0.5), ("step", "training", 3, 0.75),
        ("val", "validation", 4, 0.75), ("calibration", "calibration", 4, 0.75)]
    assert all(s[4] == s[2] and s[5] == s[3] for s in seen)  # the tensors hold the same


# Every forward of the model (GPT.hidden: training, validation, calibration, the scored evaluations and TTT all go
# through it) records the context's stage, and each evaluation's start its label: written to stages.json at exit.
STAGE_RUN = """
import atexit, json, sys
sys.path.insert(0, {repo!r})
import train_gpt as tg
seen = []
hidden, stage = tg.GPT.hidden, tg.stage
def recording(self, *a, **k):
    if not seen or seen[-1] != ["forward", tg.CONTEXT.stage]:
        seen.append(["forward", tg.CONTEXT.stage])
    return hidden(self, *a, **k)
def noting(text):
    seen.append(["stage", text])
    return stage(text)
tg.GPT.hidden, tg.stage = recording, noting
atexit.register(lambda: open("stages.json", "w").write(json.dumps(seen)))
sys.argv[1:] = []
tg.leave = lambda code: sys.exit(code)
tg.main()
"""


def test_a_runs_evaluations_set_their_stage(tmp_path, sample_data):
    """A tiny run with GPTQ calibration, validation, the scored evaluations and legal TTT: each forward reads the
    stage its part of the run set (RunContext.enter), never the one before it: validation inside training, calibration,
    evaluation for the roundtrip and sliding-window scores, ttt for legal TTT's scoring and adapting."""
    from conftest import REPO, run_training, short_val_data
    from test_tracker import TINY_RUN

    script = tmp_path / "stage_run.py"
    script.write_text(STAGE_RUN.format(repo=str(REPO)), encoding="utf-8")
    (tmp_path / "val").mkdir()
    env = {**TINY_RUN, **short_val_data(sample_data, tmp_path / "val", 1025), "RUN_ID": "stages", "ITERATIONS": "2",
           "VAL_LOSS_EVERY": "2", "QUANT": "gptq", "GPTQ_CALIBRATION_BATCHES": "1", "DIAGNOSTIC_POST_EMA": "1"}
    proc = run_training(env, tmp_path, script=script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads((tmp_path / "stages.json").read_text())
    forwards, part = [], None
    for kind, what in seen:
        if kind == "stage":
            part = what
        else:
            forwards.append((part, what))
    assert forwards == [("warmup (every training graph)", "training"), ("training", "validation"),
                        ("training", "training"), ("training", "validation"), ("collecting GPTQ Hessians", "calibration"),
                        ("evaluating the final weights", "evaluation"), ("evaluation (final_int6_roundtrip)", "evaluation"),
                        ("evaluation (final_int6_sliding_window)", "evaluation"), ("evaluation (legal_ttt)", "ttt")]
