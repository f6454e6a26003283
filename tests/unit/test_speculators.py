"""speculators-format exports load in speculators itself (vllm-project/speculators, the library drafter
users load, fine-tune and convert with), not only in vLLM.

For EAGLE-3 and DFlash: a layertap drafter (weights moved off their initial values, so a weight left at
speculators' own init cannot pass) is exported in the ``speculators`` format; speculators' config class
must validate config.json and read back what layertap wrote; ``SpeculatorModel.from_pretrained`` must
build the drafter with every parameter equal to layertap's (the verifier-owned ones it rebuilds from the
target equal the target's); and the loaded drafter run by speculators' own code must give layertap's
logits (EAGLE-3: three TTT steps; DFlash: anchored blocks).

speculators is part of the set-up (scripts/setup.sh installs it with ``--no-deps``: its own requirements
would replace torch with a CUDA build). Missing, these tests fail; they do not skip. No hub access: the
verifier is a local tiny target and the hub is switched to offline mode.
"""

from __future__ import annotations

import json
import os
from importlib.metadata import version

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # effective when this module is the first to import the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from layertap.drafters.export import export  # noqa: E402
from layertap.models.head import load_tensors  # noqa: E402
from layertap.models.tiny import tiny_model  # noqa: E402
from layertap.train.config import DFlashConfig, Eagle3Config, TrainConfig  # noqa: E402
from layertap.train.fixtures import shape, tiny_target  # noqa: E402
from layertap.train.trainer import Trainer  # noqa: E402

torch.set_num_threads(1)

SPECULATORS_VERSION = "0.9.0"  # the version scripts/setup.sh installs; change both together
NUM_SPEC = 4  # EAGLE-3 speculative tokens written to the export (not speculators' default)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """Any hub request raises instead of reaching out (the hub reads its offline flag at import time,
    so the module constant is set too, for runs where another module imported the hub first)."""
    import huggingface_hub.constants as hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def spec():
    try:
        import speculators
    except ImportError as e:
        pytest.fail(f"speculators is not importable ({e!r}). It is part of the set-up: run `bash scripts/setup.sh` "
                    f"(it installs speculators=={SPECULATORS_VERSION} with --no-deps plus the packages it "
                    "imports).", pytrace=False)
    got = version("speculators")
    if got != SPECULATORS_VERSION:
        pytest.fail(f"speculators {got} is installed; these tests check {SPECULATORS_VERSION}, the version "
                    "scripts/setup.sh installs: run it, or move the pin there and here together.", pytrace=False)
    return speculators


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Move every trainable weight off its initial value (norm gains off 1, projections off their random
    init), as training does: a loader that leaves a weight at its own init is then caught."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _exported(kind: str, tmp, dtype: torch.dtype = torch.float32):
    """(layertap drafter, its speculators-format export dir, target dir). EAGLE-3 over the tiny Llama (so
    the verifier's architecture is not the Qwen3 default), DFlash over the tiny Qwen3."""
    tcfg = TrainConfig(out_dir=str(tmp / "run"), max_steps=1, batch_size=2, tensorboard=False, max_len=96)
    if kind == "eagle3":
        target = tiny_model("llama")
        cfg = Eagle3Config(shape=shape(), aux_layer_ids=[1, 2, 3], last_layer_id=4, draft_vocab_size=512)
        draft_ids = torch.randperm(2048, generator=torch.Generator().manual_seed(0))[:512]
        tr = Trainer("eagle3", cfg, tcfg, target, draft_ids)
    else:
        target = tiny_target()
        cfg = DFlashConfig(shape=shape(), target_layer_ids=[0, 1, 2], block_size=4, mask_token_id=4,
                           num_layers=2)
        tr = Trainer("dflash", cfg, tcfg, target)
    _perturb(tr.model, 1)
    out = export(tr.save(), tmp / f"{kind}-speculators", "speculators", num_spec=NUM_SPEC, dtype=dtype)
    return tr.model.eval(), out, target


def _load(spec, out):
    model = spec.SpeculatorModel.from_pretrained(str(out), local_files_only=True)
    return model.eval()


def _same(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """Equal at the export dtype (float tensors), exactly (int/bool tensors)."""
    if a.is_floating_point():
        return a.shape == b.shape and torch.equal(a.to(dtype), b.to(dtype))
    return a.dtype == b.dtype and torch.equal(a, b)


def _check_params(loaded: torch.nn.Module, expected: dict[str, torch.Tensor], out, dtype: torch.dtype) -> None:
    """Every tensor speculators' drafter holds equals ``expected`` (layertap's drafter and the target), no
    tensor is unaccounted for, and every tensor in the exported file is loaded under its own name."""
    sd = loaded.state_dict()
    assert set(sd) == set(expected), (f"speculators holds {sorted(set(sd) - set(expected))} that layertap "
                                      f"does not; layertap has {sorted(set(expected) - set(sd))} it lacks")
    wrong = [n for n in sd if not _same(sd[n], expected[n], dtype)]
    assert not wrong, f"speculators loaded different values for {wrong}"
    file = load_file(str(out / "model.safetensors"))
    assert set(file) <= set(sd), f"exported tensors speculators does not load: {sorted(set(file) - set(sd))}"
    assert all(_same(sd[n], file[n], dtype) for n in file)


# -- EAGLE-3 ----------------------------------------------------------------------------------------------


def _eagle3_expected(ours, target) -> dict[str, torch.Tensor]:
    """speculators' Eagle3DraftModel names for layertap's tensors, plus what it rebuilds from the verifier
    (its copy of the target's final norm and of the target's lm_head rows of the draft vocabulary)."""
    names = {"embed": "embed_tokens.weight"}
    exp = {names.get(k, k.replace("midlayer.", "layers.0.", 1)): v for k, v in ours.state_dict().items()
           if k != "draft_ids"}
    t = load_tensors(target, ["model.norm.weight", "lm_head.weight"])
    exp["verifier_norm.weight"] = t["model.norm.weight"]
    exp["verifier_lm_head.weight"] = t["lm_head.weight"][ours.draft_ids]
    return exp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_eagle3_export_loads_in_speculators(spec, tmp_path, dtype):
    from speculators import Eagle3SpeculatorConfig, SpeculatorModelConfig, VerifierConfig

    ours, out, target = _exported("eagle3", tmp_path, dtype)
    raw = json.loads((out / "config.json").read_text())
    conf = SpeculatorModelConfig.from_pretrained(str(out), local_files_only=True)  # pydantic validation
    assert type(conf) is Eagle3SpeculatorConfig
    tl, s = conf.transformer_layer_config, ours.cfg.shape
    assert tl.model_type == "llama" and tl.num_hidden_layers == 1
    assert (tl.hidden_size, tl.intermediate_size, tl.num_attention_heads, tl.num_key_value_heads, tl.head_dim,
            tl.vocab_size) == (s.hidden_size, s.intermediate_size, s.num_heads, s.num_kv_heads, s.head_dim,
                               s.vocab_size)
    assert tl.rms_norm_eps == s.rms_norm_eps and tl.rope_parameters["rope_theta"] == s.rope_theta
    assert conf.draft_vocab_size == 512 and conf.target_vocab_size == s.vocab_size
    assert conf.target_hidden_size == s.hidden_size
    assert conf.eagle_aux_hidden_state_layer_ids == [1, 2, 3] == raw["eagle_aux_hidden_state_layer_ids"]
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert getattr(conf, flag) is raw[flag] is False, flag  # our layer is the SafeAILab layout
    sc = conf.speculators_config
    assert sc.algorithm == "eagle3" and sc.default_proposal_method == "greedy"
    assert [(p.proposal_type, p.speculative_tokens) for p in sc.proposal_methods] == [("greedy", NUM_SPEC)]
    # the verifier as speculators itself records it from the target's config.json
    assert sc.verifier == VerifierConfig.from_pretrained(str(target))
    assert sc.verifier.architectures == ["LlamaForCausalLM"]

    model = _load(spec, out)
    assert type(model).__name__ == "Eagle3DraftModel"
    assert model.config.eagle_aux_hidden_state_layer_ids == [1, 2, 3]  # after its check against the verifier
    assert model.use_draft_vocab and model.input_norm is None and model.fc_norm is None
    _check_params(model, _eagle3_expected(ours, target), out, dtype)
    assert torch.equal(torch.arange(512) + model.d2t, ours.draft_ids)  # d2t: offsets, as vLLM reads them


def test_eagle3_speculators_forward_matches_layertap(spec, tmp_path):
    """speculators' TTT unroll of the loaded drafter gives layertap's logits at every step and position:
    the layout (residual, norms, 2H-wide attention input, RoPE, step masks, fed-back state) is one."""
    ours, out, _ = _exported("eagle3", tmp_path)
    model = _load(spec, out)
    t, steps = 128, 3  # speculators' flex-attention block masks need a multiple of 128 positions
    g = torch.Generator().manual_seed(2)
    aux, ids = torch.randn(1, t, 3 * 128, generator=g), torch.randint(0, 2048, (1, t), generator=g)
    got: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, o: got.append(o))
    try:
        with torch.no_grad():
            model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros(1, t, dtype=torch.long),
                  ttt_steps=steps)
    finally:
        hook.remove()
    assert len(got) == steps
    with torch.no_grad():
        feat, cache = ours.fc(aux), []
        for j in range(steps):
            # step j: tokens shifted j more places (teacher-forced, 0 past the end) as speculators feeds them
            tok = torch.cat([ids[:, j:], ids.new_zeros(1, j)], dim=1)
            feat = ours.step(tok, feat, torch.arange(t).view(1, t) + j, cache)
            torch.testing.assert_close(got[j], ours.logits(feat), atol=2e-5, rtol=1e-4, msg=f"TTT step {j}")


# -- DFlash -----------------------------------------------------------------------------------------------


def _dflash_expected(ours, target) -> dict[str, torch.Tensor]:
    """speculators' DFlashDraftModel names for layertap's tensors (the full-vocabulary lm_head is the
    target's), plus its copies of the target's final norm and lm_head."""
    names = {"embed": "embed_tokens.weight", "target_lm_head": "lm_head.weight"}
    exp = {names.get(k, k): v for k, v in ours.state_dict().items()}
    t = load_tensors(target, ["model.norm.weight", "lm_head.weight"])
    exp["verifier_norm.weight"] = t["model.norm.weight"]
    exp["verifier_lm_head.weight"] = t["lm_head.weight"]
    return exp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dflash_export_loads_in_speculators(spec, tmp_path, dtype):
    from speculators import DFlashSpeculatorConfig, SpeculatorModelConfig, VerifierConfig

    ours, out, target = _exported("dflash", tmp_path, dtype)
    conf = SpeculatorModelConfig.from_pretrained(str(out), local_files_only=True)
    assert type(conf) is DFlashSpeculatorConfig
    tl, s = conf.transformer_layer_config, ours.cfg.shape
    assert tl.model_type == "qwen3" and tl.num_hidden_layers == ours.cfg.num_layers == 2
    assert (tl.hidden_size, tl.intermediate_size, tl.num_attention_heads, tl.num_key_value_heads, tl.head_dim,
            tl.vocab_size) == (s.hidden_size, s.intermediate_size, s.num_heads, s.num_kv_heads, s.head_dim,
                               s.vocab_size)
    assert tl.rope_parameters["rope_theta"] == s.rope_theta
    assert conf.draft_vocab_size == s.vocab_size and conf.target_hidden_size == s.hidden_size
    assert conf.aux_hidden_state_layer_ids == [1, 2, 3]  # aux ids (target_layer_ids [0, 1, 2] + 1)
    assert conf.mask_token_id == 4 and conf.block_size == 4 and conf.sample_from_anchor is False
    sc = conf.speculators_config
    assert sc.algorithm == "dflash"
    assert [(p.proposal_type, p.speculative_tokens) for p in sc.proposal_methods] == [("greedy", 3)]  # B - 1
    assert sc.verifier == VerifierConfig.from_pretrained(str(target))

    model = _load(spec, out)
    assert type(model).__name__ == "DFlashDraftModel"
    # no sliding-window layers: speculators runs every block bidirectionally, as layertap trains them
    assert not model.uses_sliding_window_attn and model.block_size == 4
    assert not model.use_draft_vocab and model.t2d is None and model.d2t is None
    _check_params(model, _dflash_expected(ours, target), out, dtype)


def test_dflash_speculators_blocks_match_layertap(spec, tmp_path):
    """speculators' anchored-block pass of the loaded drafter gives layertap's block logits (context before
    the anchor, bidirectional block, positions, q/k norms and KV injection are one)."""
    from torch.nn.attention.flex_attention import create_block_mask

    ours, out, _ = _exported("dflash", tmp_path)
    model = _load(spec, out)
    # speculators builds DFlash masks with a torch.compile'd create_block_mask (~20 s of CPU compile here);
    # the same function uncompiled gives the same mask.
    model._create_mask_fn = create_block_mask
    t, n_anchor, b = 128, 8, ours.cfg.block_size
    g = torch.Generator().manual_seed(3)
    aux, ids = torch.randn(1, t, 3 * 128, generator=g), torch.randint(0, 2048, (1, t), generator=g)
    loss_mask = torch.ones(1, t, dtype=torch.long)
    loss_mask[0, 0] = 0  # anchors >= 1: a block needs context before its anchor (layertap's rule)
    torch.manual_seed(3)  # speculators draws the anchors with torch's global generator
    with torch.no_grad():
        # speculators 0.9.0's forward returns only loss and metrics; this is the pass it runs first
        _, logits, _, _, block_idx = model._backbone_forward(
            aux, ids, loss_mask, torch.zeros(1, t, 128), torch.zeros(1, t, dtype=torch.long),
            max_anchors=n_anchor)
        anchors = block_idx[::b].view(1, n_anchor)
        assert len(set(anchors.tolist()[0])) == n_anchor
        want = ours.block_logits(aux, ids, anchors)  # [1, A, B, V]
    torch.testing.assert_close(logits.view(1, n_anchor, b, -1), want, atol=2e-5, rtol=1e-4)
