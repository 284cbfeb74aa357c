"""Every decoder family either trains BD-LoRA correctly under its TP layout or is refused in one line.

For each family of `models.TINY_FAMILIES` (a tiny random model of the real architecture): the default targets
resolve to every TP-sharded projection of the decoder (expected kinds written out below from transformers'
modeling code) or fail in one line; the adapter loads in stock PEFT with identical logits; densely stored
block-diagonal factors keep their zeros through training; expert factors match a dense reference forward and
backward; and one 2-rank spawn shows every resolvable family exact under TP with BD-LoRA collectives = base,
which also regenerates the coverage table that docs/families.md must match.
"""

import copy
import json

import pytest
import torch
from peft import BdLoraConfig, LoraConfig, PeftModel
from peft import get_peft_model as stock_get_peft_model

from bdlora_train import BlockDiagLoraConfig, BlockDiagLoraConfigError, get_peft_model
from bdlora_train.arch.fused import candidate_segments, probe_layout
from bdlora_train.budget import adapter_layout, count_adapter_params
from bdlora_train.core.blocks import shard_rows
from bdlora_train.models import TINY_FAMILIES, build_tiny_model, meta_model, tiny_config
from bdlora_train.peft_integration.storage import LAYOUT_NAME
from tools.families_table import _kind, coverage_rows, doc_table, markdown, run_tp

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:Could not find a config file"),  # base_model_name_or_path "tiny:..."
]

LLAMA_LIKE = {"bd_b": {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}, "bd_a": {"o_proj", "down_proj"}}
ATTN = {"bd_b": {"q_proj", "k_proj", "v_proj"}, "bd_a": {"o_proj"}}
# Role of every kind of decoder projection, from each family's transformers modeling file; str: the refusal.
EXPECTED = {
    **dict.fromkeys(
        ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "cohere", "granite", "smollm3"],
        LLAMA_LIKE,
    ),
    "olmo2": LLAMA_LIKE,
    "gemma3": LLAMA_LIKE,  # the language model only: the SigLIP tower's q/k/v/out_proj are not default targets
    "starcoder2": {"bd_b": {"q_proj", "k_proj", "v_proj", "c_fc"}, "bd_a": {"o_proj", "c_proj"}},
    "phi3": {"bd_b": {"qkv_proj", "gate_up_proj"}, "bd_a": {"o_proj", "down_proj"}},
    "glm4": {"bd_b": {"q_proj", "k_proj", "v_proj", "gate_up_proj"}, "bd_a": {"o_proj", "down_proj"}},
    "phi": {"bd_b": {"q_proj", "k_proj", "v_proj", "fc1"}, "bd_a": {"dense", "fc2"}},
    "gptj": {"bd_b": {"q_proj", "k_proj", "v_proj", "fc_in"}, "bd_a": {"out_proj", "fc_out"}},
    "gpt_neox": {"bd_b": {"query_key_value", "dense_h_to_4h"}, "bd_a": {"dense", "dense_4h_to_h"}},
    "bloom": {"bd_b": {"query_key_value", "dense_h_to_4h"}, "bd_a": {"dense", "dense_4h_to_h"}},
    "falcon": {"bd_b": {"query_key_value", "dense_h_to_4h"}, "bd_a": {"dense", "dense_4h_to_h"}},
    "mpt": {"bd_b": {"Wqkv", "up_proj"}, "bd_a": {"out_proj", "down_proj"}},
    "opt": {"bd_b": {"q_proj", "k_proj", "v_proj", "fc1"}, "bd_a": {"out_proj", "fc2"}},
    "mixtral": {"bd_b": ATTN["bd_b"] | {"experts.gate_up_proj"}, "bd_a": {"o_proj", "experts.down_proj"}},
    "qwen3_moe": {"bd_b": ATTN["bd_b"] | {"experts.gate_up_proj"}, "bd_a": {"o_proj", "experts.down_proj"}},
    "qwen2_moe": {
        "bd_b": ATTN["bd_b"] | {"experts.gate_up_proj", "shared_expert.gate_proj", "shared_expert.up_proj"},
        "bd_a": {"o_proj", "experts.down_proj", "shared_expert.down_proj"},
    },
    # Llama-4 stores experts transposed (E, in, out): gate_up's A spans the TP-split 2I, down's B spans I.
    "llama4": {
        "bd_b": ATTN["bd_b"] | {"experts.down_proj", "shared_expert.gate_proj", "shared_expert.up_proj"},
        "bd_a": {"o_proj", "experts.gate_up_proj", "shared_expert.down_proj"},
    },
    "gpt2": "GPT-2 style Conv1D layer",
    "deepseek_v3": "no tensor-parallel role ['self_attn.kv_a_proj_with_mqa', 'self_attn.q_a_proj']",
}
FUSED = {  # segment-contiguous layers: rank i's block is the i-th 1/N of every segment
    "phi3": {"qkv_proj": (64, 32, 32), "gate_up_proj": (128, 128)},
    "glm4": {"gate_up_proj": (128, 128)},
    "mpt": {"Wqkv": (64, 64, 64)},
}
RESOLVABLE = [f for f in TINY_FAMILIES if not isinstance(EXPECTED[f], str)]


def _config(**kwargs):
    return BlockDiagLoraConfig(**{"r": 4, "nblocks": 2, "lora_alpha": 8, **kwargs})


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def _randomize_(peft_model, seed=0):
    """Random A and B (PEFT starts B at 0), keeping the zeros of densely stored blocks as training does."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        for module in peft_model.modules():
            for buffer_name, mask in module.named_buffers(recurse=False):
                if buffer_name.startswith("bdmask_"):
                    factor, adapter = buffer_name.split("_", 2)[1:]
                    getattr(module, f"lora_{factor}")[adapter].weight.mul_(mask)


def _ids(n=2, length=8, seed=1):
    return torch.randint(3, 200, (n, length), generator=torch.Generator().manual_seed(seed))


def test_every_family_has_an_expectation():
    assert set(EXPECTED) == set(TINY_FAMILIES) and len(TINY_FAMILIES) == 28


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_spec_builds_a_tiny_model(family):
    model = build_tiny_model(family)
    text = model.config.get_text_config()
    assert (text.hidden_size, text.num_hidden_layers, text.vocab_size) == (64, 2, 256)
    assert sum(p.numel() for p in model.parameters()) < 200_000
    assert model(input_ids=_ids(), use_cache=False).logits.shape == (2, 8, 256)
    assert tiny_config(family).get_text_config().hidden_size == 64  # what `bdlora budget --model tiny:...` reads


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_default_targets_cover_every_decoder_projection_or_refuse(family):
    model = build_tiny_model(family)
    config = _config()
    expected = EXPECTED[family]
    if isinstance(expected, str):
        with pytest.raises(BlockDiagLoraConfigError) as err:
            get_peft_model(model, config)
        assert expected in _one_line(err)
        return
    get_peft_model(model, config)
    got: dict[str, set] = {}
    for name, target in config.resolved.items():
        got.setdefault(target.role, set()).add(_kind(name))
    assert got == expected
    layers = model.config.get_text_config().num_hidden_layers
    assert len(config.resolved) == layers * sum(len(v) for v in expected.values())  # every layer, not some
    for name, segments in FUSED.get(family, {}).items():
        fused = [t for n, t in config.resolved.items() if n.endswith("." + name)]
        assert fused and all(t.layout.segments == segments and t.storage == "dense" for t in fused)


@pytest.mark.parametrize("family", RESOLVABLE)
def test_adapter_loads_in_stock_peft_with_identical_logits(family, tmp_path):
    """Saved, then loaded by stock PEFT without the toolkit's config or layers: the same function."""
    from bdlora_train.adapters.load import load_adapter

    base = build_tiny_model(family)
    config = _config()
    peft_model = get_peft_model(copy.deepcopy(base), config)
    _randomize_(peft_model)
    ids = _ids()
    with torch.no_grad():
        ours = peft_model(input_ids=ids, use_cache=False).logits
        plain = base(input_ids=ids, use_cache=False).logits
    assert (ours - plain).abs().max() > 1e-2  # the adapter does something
    peft_model.save_pretrained(str(tmp_path))
    dense = any(t.storage == "dense" for t in config.resolved.values())
    assert (tmp_path / LAYOUT_NAME).is_file() == dense
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    has_experts = any(t.kind == "expert" for t in config.resolved.values())
    assert (saved["use_bdlora"] is None) == has_experts  # PEFT builds no expert factor under use_bdlora
    stock = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path)).eval()
    reloaded = load_adapter(copy.deepcopy(base), str(tmp_path)).eval()
    with torch.no_grad():
        for other in (stock, reloaded):
            logits = other(input_ids=ids, use_cache=False).logits
            assert (logits - ours).abs().max() / ours.abs().max() < 1e-5
    if family == "gemma3":  # stock PEFT adapted the language model only, as resolved
        wrapped = [n for n, m in stock.named_modules() if hasattr(m, "lora_A") and "vision" in n]
        assert wrapped == []


@pytest.mark.parametrize("family", ["phi3", "mixtral", "llama4"])
def test_count_is_trainable_minus_explicit_zeros_and_zeros_survive_training(family):
    model = build_tiny_model(family)
    config = _config()
    counted = count_adapter_params(meta_model(model.config), _config())
    peft_model = get_peft_model(model, config)
    _randomize_(peft_model)
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    zeros = sum(int((p == 0).sum()) for p in trainable)
    assert zeros > 0 and counted == sum(p.numel() for p in trainable) - zeros
    layout = adapter_layout(meta_model(model.config), _config())
    assert sum(e["stored"] for e in layout.values()) == sum(p.numel() for p in trainable)
    optim = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1)
    peft_model.train()
    for _ in range(2):
        peft_model(input_ids=_ids(), labels=_ids(), use_cache=False).loss.backward()
        optim.step()
        optim.zero_grad()
    assert sum(int((p == 0).sum()) for p in trainable) == zeros  # off-block entries never move


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe", "llama4"])
def test_experts_match_a_dense_reference_forward_and_backward(family):
    """Logits and factor gradients of the PEFT model equal a dense reference: the base model run with
    W_e + scaling * B_e A_e written into every expert (torch.func.functional_call), from the same masked factors."""
    from torch.func import functional_call

    base = build_tiny_model(family)
    config = _config()
    peft_model = get_peft_model(copy.deepcopy(base), config)
    _randomize_(peft_model)
    ids = _ids()
    loss = peft_model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()

    factors, params = {}, dict(base.named_parameters())
    for name, target in config.resolved.items():
        owner, _, pname = name.rpartition(".")
        wrapper = (
            next(
                m
                for n, m in peft_model.base_model.model.named_modules()
                if getattr(m, "parameter_name", None) == pname and n.replace(".base_layer", "") == owner
            )
            if target.kind == "expert"
            else peft_model.base_model.model.get_submodule(name)
        )
        a = wrapper.lora_A["default"].weight.detach().clone().requires_grad_(True)
        b = wrapper.lora_B["default"].weight.detach().clone().requires_grad_(True)
        factors[name] = (wrapper, a, b)
        s = wrapper.scaling["default"]
        if target.kind == "expert":
            e = target.layout.experts
            a_e = a.reshape(e, -1, a.shape[-1])  # (E, r, in)
            b_e = b.reshape(b.shape[0], -1, e).permute(2, 0, 1)  # (E, out, r)
            delta = s * torch.bmm(b_e, a_e)
            transposed = getattr(wrapper.get_base_layer(), "is_transposed", False)
            params[name] = params[name] + (delta.transpose(1, 2) if transposed else delta)
        else:
            params[f"{name}.weight"] = params[f"{name}.weight"] + s * b @ a
    ref_loss = functional_call(base, params, args=(), kwargs=dict(input_ids=ids, labels=ids, use_cache=False)).loss
    assert abs(ref_loss.item() - loss.item()) < 1e-5
    ref_loss.backward()
    for name, (wrapper, a, b) in factors.items():
        for factor, ref in (("A", a), ("B", b)):
            got = getattr(wrapper, f"lora_{factor}")["default"].weight.grad
            mask = getattr(wrapper, f"bdmask_{factor}_default", None)
            want = ref.grad * mask if mask is not None else ref.grad
            assert torch.allclose(got, want, atol=1e-6, rtol=1e-4), (name, factor)


def _tp_local_delta_error(weight_a, weight_b, segments, nblocks) -> float:
    """Simulated column-parallel TP: rank i holds the i-th 1/N of every segment of the output and the i-th rank
    block; its output slice is B[rows_i, k_i] A[k_i, :]. Relative error of the assembled slices vs B A."""
    weight_a, weight_b = weight_a.detach(), weight_b.detach()
    full = weight_b @ weight_a
    sim = torch.zeros_like(full)
    k = weight_a.shape[0] // nblocks
    for rank in range(nblocks):
        rows = shard_rows(segments, nblocks, rank)
        sim[rows] = weight_b[rows, rank * k : (rank + 1) * k] @ weight_a[rank * k : (rank + 1) * k]
    return float((sim - full).abs().max() / full.abs().max())


def test_stock_contiguous_blocks_on_phi3_qkv_are_wrong_under_tp_and_ours_are_exact():
    """The thing we beat: stock PEFT's use_bdlora on Phi-3's fused [q|k|v] makes contiguous blocks, which do not
    follow the segment-aware TP shards (relative error ~1); the toolkit's segment-aware blocks are exact."""
    from peft.tuners.lora.variants import BlockDiagonalLinear

    segments = (64, 32, 32)
    stock = stock_get_peft_model(
        build_tiny_model("phi3"),
        LoraConfig(
            r=4, target_modules=["qkv_proj"], use_bdlora=BdLoraConfig(target_modules_bd_b=["qkv_proj"], nblocks=2)
        ),
    )
    _randomize_(stock)
    qkv = stock.base_model.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.lora_B["default"], BlockDiagonalLinear)
    dense_b = qkv.lora_B["default"].weight_as_blockdiagonal_matrix()
    assert _tp_local_delta_error(qkv.lora_A["default"].weight, dense_b, segments, 2) > 0.5

    ours = get_peft_model(build_tiny_model("phi3"), _config(target_modules=["qkv_proj"]))
    _randomize_(ours)
    qkv = ours.base_model.model.model.layers[0].self_attn.qkv_proj
    assert _tp_local_delta_error(qkv.lora_A["default"].weight, qkv.lora_B["default"].weight, segments, 2) < 1e-6


@pytest.mark.parametrize(
    "family, layer, consumer, expected",
    [
        ("phi3", "self_attn.qkv_proj", "self_attn.o_proj", "q|k|v"),
        ("phi3", "mlp.gate_up_proj", "mlp.down_proj", "gate|up"),
        ("glm4", "mlp.gate_up_proj", "mlp.down_proj", "gate|up"),
        ("mpt", "attn.Wqkv", "attn.out_proj", "q|k|v"),
        ("gpt_neox", "attention.query_key_value", "attention.dense", "contiguous"),  # head-interleaved
        ("bloom", "self_attention.query_key_value", "self_attention.dense", "contiguous"),  # head-interleaved
        ("falcon", "self_attention.query_key_value", "self_attention.dense", "contiguous"),  # grouped per KV head
    ],
)
def test_fused_layouts_are_decided_by_layout(family, layer, consumer, expected):
    """Perturbing what a candidate layout gives rank i moves only rank i's shard of the consumer's input for the
    right layout, and moves other shards for the wrong ones (decided on the model's own code, not its names)."""
    model = build_tiny_model(family)
    prefix = {
        "gpt_neox": "gpt_neox.layers",
        "bloom": "transformer.h",
        "falcon": "transformer.h",
        "mpt": "transformer.blocks",
    }
    root = prefix.get(family, "model.layers")
    name, sink = f"{root}.0.{layer}", f"{root}.0.{consumer}"
    width = model.get_submodule(name).out_features
    candidates = candidate_segments(model.config, width, model.get_submodule(sink).in_features)
    assert len(candidates) > 1  # the width alone does not say which
    assert probe_layout(model, name, candidates, sink) == expected
    for label, segments in candidates.items():
        if label != expected:
            assert probe_layout(model, name, {label: segments}, sink) is None


@pytest.mark.parametrize(
    "family, overrides, kwargs, message",
    [
        (
            "phi3",
            {},
            dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
            "would not adapt ['k_proj', 'q_proj', 'v_proj']",
        ),
        ("mixtral", {}, dict(target_modules=["q_proj", "gate_proj"]), "'gate_proj' is fused with ['up_proj']"),
        ("mixtral", {}, dict(target_modules=["experts.gate_up_proj"], experts=False), "but experts=False"),
        ("qwen3_moe", dict(mlp_only_layers=[0]), {}, "PEFT's transformers-v5 conversion for qwen3_moe"),
        ("llama", {}, dict(target_modules=["q_proj", "lm_head"]), "pass roles={'lm_head': 'bd_b'} for a column"),
        ("llama", {}, dict(target_modules=["query", "value"]), "match no module of llama"),
        ("llama", dict(num_key_value_heads=1), dict(target_modules=["q_proj", "k_proj"]), "num_key_value_heads=1"),
        ("gemma3", {}, dict(target_modules=["vision_tower.encoder.layers.0.self_attn.q_proj"]), "outside the language"),
    ],
)
def test_partial_or_impossible_requests_fail_in_one_line(family, overrides, kwargs, message):
    with pytest.raises(BlockDiagLoraConfigError) as err:
        get_peft_model(build_tiny_model(family, **overrides), _config(**kwargs))
    assert message in _one_line(err)


def test_explicit_opt_outs_and_what_they_adapt():
    def kinds(family, overrides=None, **kwargs):
        config = _config(**kwargs)
        get_peft_model(build_tiny_model(family, **(overrides or {})), config)
        return {_kind(n): t for n, t in config.resolved.items()}

    assert set(kinds("mixtral", experts=False)) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    ep = kinds("mixtral", experts="ep")
    assert ep["experts.gate_up_proj"].nblocks == 1 and ep["q_proj"].nblocks == 2
    assert set(kinds("mixtral", target_modules=["q_proj", "w1", "w3", "w2"])) == {
        "q_proj",
        "experts.gate_up_proj",
        "experts.down_proj",
    }
    assert set(kinds("qwen3_moe", target_modules="all-linear")) == set(kinds("qwen3_moe"))
    assert set(kinds("llama", dict(num_key_value_heads=1), target_modules=["q_proj", "o_proj"])) == {"q_proj", "o_proj"}
    tower = "vision_tower.encoder.layers.0.self_attn.q_proj"
    assert set(kinds("gemma3", target_modules=[tower], roles={tower: "bd_b"})) == {"q_proj"}


def test_budget_counts_experts_on_both_sides(capsys):
    """The LoRA side adapts the same expert parameters (PEFT's own count of a real LoRA model), BD-LoRA counts
    its per-expert blocks, and the CLI says how experts are adapted."""
    from bdlora_train.budget import lora_baseline
    from bdlora_train.commands.budget import main as budget_main

    model = build_tiny_model("mixtral")
    lora = lora_baseline(model, 8, 2)
    assert (
        sorted(lora.target_parameters)
        and count_adapter_params(model, lora)
        == (stock_get_peft_model(copy.deepcopy(model), lora).get_nb_trainable_parameters()[0])
    )
    assert budget_main(["--model", "tiny:mixtral", "--lora-rank", "8", "--nblocks", "2", "--experts", "ep"]) == 0
    assert "experts take nblocks 1" in capsys.readouterr().out


def test_tp_check_refuses_stock_contiguous_blocks_on_a_fused_layer(tmp_path):
    from bdlora_train.tp_diagnostics import TPError, tp_check

    stock = stock_get_peft_model(
        build_tiny_model("phi3"),
        LoraConfig(
            r=4, target_modules=["qkv_proj"], use_bdlora=BdLoraConfig(target_modules_bd_b=["qkv_proj"], nblocks=2)
        ),
    )
    stock.peft_config["default"].base_model_name_or_path = "tiny:phi3"
    stock.save_pretrained(str(tmp_path))
    with pytest.raises(TPError) as err:
        tp_check(tmp_path, tp=2)
    assert "contiguous blocks on a fused layer straddle the TP shards" in _one_line(err)


@pytest.fixture(scope="module")
def tp_results():
    """One 2-rank spawn: a random default-target adapter on every resolvable family plus the explicit adapters."""
    return run_tp(RESOLVABLE)


def test_every_resolvable_family_is_exact_under_tp_with_zero_extra_collectives(tp_results):
    assert set(RESOLVABLE) <= set(tp_results)
    for label, result in tp_results.items():
        assert result["ok"], (label, result)
        assert result["bdlora_collectives"] == result["base_collectives"], label
        assert result["bdlora_bytes"] == result["base_bytes"], label
        assert max(result["max_rel_err"], result["base_rel_err"], result["slora_rel_err"]) < 1e-4, label
        assert result["adapter_effect"] > 1e-2, label
    # the experts run whole in the forward check (their TP sharding is the runtime's, checked by tp-check --train)
    assert tp_results["mixtral"]["experts"].startswith("4 expert parameters adapted: the experts run whole")
    assert tp_results["mixtral (experts='ep')"]["experts"].startswith("4 expert parameters adapted")
    assert tp_results["llama"]["experts"] is None


def test_coverage_table_in_the_docs_matches_the_code(tp_results):
    table = markdown(coverage_rows(tp_results))
    assert doc_table() == table, "docs/families.md is stale: regenerate it with `python -m tools.families_table`"


def test_exports_of_dense_stored_adapters(tmp_path):
    """Merged export adds every expert's delta into its 3-D parameter (exact); a re-blocked copy carries a stale
    bdlora_layout.json, which the toolkit then ignores (its dense factors read as plain LoRA, as stock PEFT does)."""
    from bdlora_train.adapters.load import load_adapter
    from bdlora_train.adapters.reader import read_adapter
    from bdlora_train.export import export

    for family in ("mixtral", "phi3"):
        base = build_tiny_model(family)
        peft_model = get_peft_model(copy.deepcopy(base), _config())
        _randomize_(peft_model)
        peft_model.peft_config["default"].base_model_name_or_path = f"tiny:{family}"
        peft_model.save_pretrained(str(tmp_path / family))
        merged = export(tmp_path / family, tmp_path / f"{family}-merged", to="merged", base=copy.deepcopy(base))
        from transformers import AutoModelForCausalLM

        ids = _ids()
        with torch.no_grad():
            want = load_adapter(copy.deepcopy(base), str(tmp_path / family))(input_ids=ids, use_cache=False).logits
            got = AutoModelForCausalLM.from_pretrained(str(merged))(input_ids=ids, use_cache=False).logits
        assert (got - want).abs().max() / want.abs().max() < 1e-5
    export(tmp_path / "phi3", tmp_path / "phi3-nb1", reblock_to=1)
    with pytest.warns(UserWarning, match="belongs to another adapter_config.json"):
        reblocked = read_adapter(tmp_path / "phi3-nb1")
    assert reblocked.layout is None and reblocked.modules["model.layers.0.self_attn.qkv_proj"].role is None


def test_an_experts_false_adapter_reloads_without_its_experts(tmp_path):
    """Qwen2-MoE with experts=False adapts the shared expert's gate/up/down_proj; reloading must not read those
    names as the experts' transformers-4 names and add expert factors the file does not have."""
    from bdlora_train.adapters.load import load_adapter

    base = build_tiny_model("qwen2_moe")
    peft_model = get_peft_model(copy.deepcopy(base), _config(experts=False))
    _randomize_(peft_model)
    peft_model.save_pretrained(str(tmp_path))
    reloaded = load_adapter(copy.deepcopy(base), str(tmp_path))
    config = reloaded.peft_config["default"]
    assert isinstance(config, BlockDiagLoraConfig) and not any(t.kind == "expert" for t in config.resolved.values())
    with torch.no_grad():
        want = peft_model(input_ids=_ids(), use_cache=False).logits
        got = reloaded(input_ids=_ids(), use_cache=False).logits
    assert (got - want).abs().max() / want.abs().max() < 1e-6
