"""Free vs stored numbers of BD-LoRA adapters on full-size family configs (meta device, no weights, offline).

Densely stored block-diagonal factors (segment-aware fused layers, every factor of an adapter with experts) keep
their off-block zeros in the file so that stock PEFT loads them exactly; this prints what that costs.

    python scripts/family_storage.py          # markdown table (docs/families.md, "What the dense storage costs")
"""

from transformers import AutoConfig

from bdlora_train import BlockDiagLoraConfig
from bdlora_train.budget import adapter_layout, count_adapter_params, lora_baseline
from bdlora_train.core.heads import default_nblocks
from bdlora_train.models import meta_model

# transformers' default config of each family is a released checkpoint's shape (Phi3Config() = Phi-3-mini-4k, ...).
FAMILIES = [
    ("phi3", "Phi3Config() (Phi-3-mini)"),
    ("glm4", "Glm4Config() (GLM-4-9B)"),
    ("mixtral", "MixtralConfig() (Mixtral-8x7B)"),
    ("qwen3_moe", "Qwen3MoeConfig()"),
    ("llama", "LlamaConfig() (Llama-2-7B shape, for reference)"),
]
R = 32


def main():
    print(f"| config | nblocks | r | free params | stored numbers | explicit zeros | stored / free | LoRA r={R // 2} |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for family, label in FAMILIES:
        config = AutoConfig.for_model(family)
        model = meta_model(config)
        nblocks = default_nblocks(config)
        layout = adapter_layout(model, BlockDiagLoraConfig(r=R, nblocks=nblocks))
        free = sum(e["params"] for e in layout.values())
        stored = sum(e["stored"] for e in layout.values())
        lora = count_adapter_params(model, lora_baseline(model, R // 2, nblocks))
        print(
            f"| {label} | {nblocks} | {R} | {free:,} | {stored:,} | {stored - free:,} | {stored / free:.2f}x "
            f"| {lora:,} |"
        )


if __name__ == "__main__":
    main()
