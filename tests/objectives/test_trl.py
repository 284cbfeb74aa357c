"""BD-LoRA through TRL (docs/training.md, "With TRL"): SFTTrainer and DPOTrainer on the tiny Llama, with the optimizer
of `bdlora_train.bdlora_optimizer`, then the saved adapter read back by stock PEFT; which trainers add the `ref`
adapter the page names. (tests/test_docs_trl.py runs the page's own blocks.)

The expected learning rates are written out by hand (nblocks 2, so 2 x the base rate on the block-diagonal factor of
every layer), not derived from optim.py's rule: a helper that lost the multiplier, or put it on the wrong factor, fails.
"""

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from bdlora_train import (
    BlockDiagLoraConfig,
    BlockDiagLoraError,
    bdlora_optimizer,
    bdlora_param_groups,
    build_tiny_model,
    get_peft_model,
    load_adapter,
)
from bdlora_train.models import tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

LR, NBLOCKS = 1e-3, 2
# The tiny Llama's block-diagonal factors: lora_B of the column-parallel projections (BD-B), lora_A of the
# row-parallel ones (BD-A).
BD_B, BD_A = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("o_proj", "down_proj")
SUMS = [(a, b) for a in range(4) for b in range(4)]
IDS = torch.randint(4, 100, (2, 12), generator=torch.Generator().manual_seed(0))


def _is_block_diagonal(name: str) -> bool:
    module = name.split(".lora_")[0].rsplit(".", 1)[-1]
    return (module in BD_B and ".lora_B." in name) or (module in BD_A and ".lora_A." in name)


def _config(kind: str, out, **extra):
    common = dict(
        output_dir=str(out / "run"),
        max_steps=3,
        per_device_train_batch_size=8,
        learning_rate=LR,
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        # the same checkpointing TRL turns on by default, under transformers 5.24's name
        activation_checkpointing=True,
    )
    common.update(extra)
    return SFTConfig(**common) if kind == "sft" else DPOConfig(**common)


def _dataset(kind: str) -> Dataset:
    prompts = [f"{a}+{b}=" for a, b in SUMS]
    if kind == "sft":
        return Dataset.from_dict({"prompt": prompts, "completion": [str(a + b) for a, b in SUMS]})
    return Dataset.from_dict(
        {"prompt": prompts, "chosen": [str(a + b) for a, b in SUMS], "rejected": [str(a + b + 1) for a, b in SUMS]}
    )


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_trl_trainer_keeps_the_block_diagonal_rate_and_saves_a_stock_peft_adapter(kind, tmp_path):
    # the lines of docs/training.md "With TRL"
    base, tokenizer = build_tiny_model("llama", seed=0), tiny_tokenizer()
    model = get_peft_model(base, BlockDiagLoraConfig(r=4, nblocks=NBLOCKS, lora_alpha=8))
    args = _config(kind, tmp_path)
    trainer_cls = SFTTrainer if kind == "sft" else DPOTrainer
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=_dataset(kind),
        processing_class=tokenizer,
        optimizers=(bdlora_optimizer(model, args), None),
    )

    # every trainable factor in exactly one group: the block-diagonal ones at 2 x 1e-3, the others at 1e-3
    lr_of = {id(p): g["lr"] for g in trainer.optimizer.param_groups for p in g["params"]}
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad and ".default." in n}
    assert len(trainable) == 28 and sum(len(g["params"]) for g in trainer.optimizer.param_groups) == 28
    for name, p in trainable.items():
        assert lr_of[id(p)] == (2 * 1e-3 if _is_block_diagonal(name) else 1e-3), name
    assert sum(_is_block_diagonal(n) for n in trainable) == 14

    before = {n: p.detach().clone() for n, p in trainable.items() if _is_block_diagonal(n)}
    trainer.train()
    for name, start in before.items():
        assert not torch.equal(trainable[name].detach(), start), f"{name} did not move"

    out = tmp_path / "adapter"
    if kind == "sft":
        trainer.save_model(out)
    else:  # not TRL's frozen `ref` copy of the adapter (DPO's reference), which trainer.save_model adds as ref/
        model.save_pretrained(out, selected_adapters=["default"])
        tokenizer.save_pretrained(out)
    assert (out / "adapter_config.json").is_file() and not (out / "ref").exists()
    trained = _logits(model)

    stock = PeftModel.from_pretrained(build_tiny_model("llama", seed=0), out)
    toolkit = load_adapter(build_tiny_model("llama", seed=0), out)
    torch.testing.assert_close(_logits(stock), _logits(toolkit))
    torch.testing.assert_close(_logits(stock), trained)
    assert not torch.allclose(_logits(stock), _logits(build_tiny_model("llama", seed=0)))


def test_param_groups_follow_the_trainer_weight_decay_rule_and_refuse_a_model_without_bdlora():
    model = get_peft_model(
        build_tiny_model("llama", seed=0), BlockDiagLoraConfig(r=4, nblocks=NBLOCKS, modules_to_save=["norm"])
    )
    groups = bdlora_param_groups(model, 1e-3, weight_decay=0.1)
    name_of = {id(p): n for n, p in model.named_parameters()}
    for group in groups:
        for p in group["params"]:
            name = name_of[id(p)]
            assert group["lr"] == (2e-3 if _is_block_diagonal(name) else 1e-3), name
            assert group["weight_decay"] == (0.0 if "norm" in name else 0.1), name
    assert bdlora_param_groups(model, 1e-3, bd_lr_ratio=3)[-1]["lr"] == pytest.approx(3e-3)

    lora = get_peft_model(build_tiny_model("llama", seed=0), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(BlockDiagLoraError, match="plain LoRA"):
        bdlora_param_groups(lora, 1e-3)
    with pytest.raises(BlockDiagLoraError, match="not a PEFT model"):
        bdlora_param_groups(build_tiny_model("llama", seed=0), 1e-3)
    with pytest.raises(BlockDiagLoraError, match="> 0"):
        bdlora_param_groups(model, 1e-3, bd_lr_ratio=0)


# trainer -> whether it adds `ref` to a PEFT model (docs/training.md, "The `ref` adapter"), each built on the tiny
# Llama with the config keys and the rows its data needs. In a process of its own: TRL's GRPO and RLOO modules ask
# whether vLLM is installed and take this tests/ folder's `vllm/` for an installation without a version.
REF_ADAPTER = """
import json
from datasets import Dataset
from trl import (DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, KTOConfig, KTOTrainer, RLOOConfig, RLOOTrainer,
                 SFTConfig, SFTTrainer)
from bdlora_train import BlockDiagLoraConfig, build_tiny_model, get_peft_model
from bdlora_train.models import tiny_tokenizer

def reward(completions, **kwargs):
    return [0.0] * len(completions)

prompts = {"prompt": ["1+1=", "2+2="]}
cases = {
    "DPOTrainer": (DPOTrainer, DPOConfig, {}, {**prompts, "chosen": ["2", "4"], "rejected": ["3", "5"]}),
    "KTOTrainer": (KTOTrainer, KTOConfig, {}, {**prompts, "completion": ["2", "5"], "label": [True, False]}),
    "RLOOTrainer beta=0": (RLOOTrainer, RLOOConfig, {"beta": 0.0, "num_generations": 2}, prompts),
    "GRPOTrainer beta=0.04": (GRPOTrainer, GRPOConfig, {"beta": 0.04, "num_generations": 2}, prompts),
    "GRPOTrainer default beta": (GRPOTrainer, GRPOConfig, {"num_generations": 2}, prompts),
    "SFTTrainer": (SFTTrainer, SFTConfig, {}, {**prompts, "completion": ["2", "4"]}),
}
adapters = {}
for name, (trainer, config, extra, rows) in cases.items():
    model = get_peft_model(build_tiny_model("llama"), BlockDiagLoraConfig(r=4, nblocks=2))
    args = config(output_dir="run", use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=2, **extra)
    funcs = {"reward_funcs": reward} if trainer in (GRPOTrainer, RLOOTrainer) else {}
    trainer(model=model, args=args, train_dataset=Dataset.from_dict(rows), processing_class=tiny_tokenizer(), **funcs)
    adapters[name] = sorted(model.peft_config)
print(json.dumps(adapters))
"""


def test_the_trainers_the_docs_name_add_a_ref_adapter_and_the_others_none(tmp_path):
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", REF_ADAPTER], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ref, alone = ["default", "ref"], ["default"]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "DPOTrainer": ref,
        "KTOTrainer": ref,
        "RLOOTrainer beta=0": ref,  # RLOO adds it whatever its beta
        "GRPOTrainer beta=0.04": ref,
        "GRPOTrainer default beta": alone,  # TRL's default beta is 0.0
        "SFTTrainer": alone,
    }


def test_a_trl_trainer_from_make_trainer_class_writes_its_checkpoints_whole_or_not_at_all(tmp_path):
    """The toolkit's Trainer additions apply to TRL's trainers (make_trainer_class(base=SFTTrainer)): a checkpoint is
    written under a staging name and renamed when complete, and a save that fails on the way (here: a full disk while
    the checkpoint's extras are written) leaves no checkpoint-<step>/ that a resume would pick, and says so in one
    line. Stock SFTTrainer writes checkpoint-2/ in place and would leave the half-written one."""
    from bdlora_train.core.errors import RecipeError
    from bdlora_train.trainer.mixins import STAGING_PREFIX, AtomicCheckpoints, make_trainer_class

    cls = make_trainer_class(base=SFTTrainer)
    assert issubclass(cls, SFTTrainer) and issubclass(cls, AtomicCheckpoints)

    class FullDisk(cls):
        def save_checkpoint_extras(self, checkpoint_dir: str) -> None:
            raise OSError(28, "No space left on device")

    runs = {}
    for label, trainer_cls in (("ok", cls), ("full", FullDisk)):
        model = get_peft_model(build_tiny_model("llama", seed=0), BlockDiagLoraConfig(r=4, nblocks=NBLOCKS))
        args = _config("sft", tmp_path / label, save_strategy="steps", save_steps=2)
        trainer = trainer_cls(model=model, args=args, train_dataset=_dataset("sft"), processing_class=tiny_tokenizer())
        runs[label] = (trainer, tmp_path / label / "run")
    trainer, run = runs["ok"]
    trainer.train()
    assert (run / "checkpoint-2" / "adapter_model.safetensors").is_file()
    assert not list(run.glob(f"{STAGING_PREFIX}*"))
    trainer, run = runs["full"]
    with pytest.raises(RecipeError, match=r"checkpoint-2: writing to .* failed \(.*No space left on device"):
        trainer.train()
    assert not (run / "checkpoint-2").exists() and not list(run.glob(f"{STAGING_PREFIX}*"))
