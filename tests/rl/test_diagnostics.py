"""GRPO's per-step diagnostics (rl/diagnostics.py): the KL to the base model against torch's own categorical KL of two
separate models in float64, the update norms against a change made by hand, the factor kinds on a real BD-LoRA
model, the learning guard's two warnings, and a tiny run whose reward is always 0 printing the no-signal warning on
a line of its own and recording it in metrics.json."""

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from bdlora_train.cli import main
from bdlora_train.rl.diagnostics import (
    COLLAPSE_KL,
    DRIFT_KL,
    NO_SIGNAL_STEPS,
    LearningGuard,
    UpdateNorms,
    factor_groups,
    kl_to_base,
)

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "grpo.yaml")


def _bd_model(dtype=torch.float32):
    from bdlora_train import BlockDiagLoraConfig, get_peft_model
    from bdlora_train.models import build_tiny_model

    base = build_tiny_model("llama", seed=0).to(dtype)
    frozen = copy.deepcopy(base)
    model = get_peft_model(base, BlockDiagLoraConfig(r=4, nblocks=2, lora_alpha=8))
    return model, frozen


def test_kl_to_base_is_the_categorical_kl_of_the_policy_and_a_separate_copy_of_the_base():
    model, frozen = _bd_model(torch.float64)
    torch.manual_seed(1)
    with torch.no_grad():  # move the adapter away from its zero start so the two policies differ
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.2 * torch.randn_like(p))
    prompt = torch.randint(3, 100, (3, 5))
    completion = torch.randint(3, 100, (3, 4))
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    inputs = {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion,
              "completion_mask": completion_mask}
    temperature = 0.7
    got = kl_to_base(model, model, inputs, temperature, chunk=2)  # chunks of 2 rows: the last chunk is partial

    ids = torch.cat([prompt, completion], dim=1)
    with torch.no_grad():
        p_logits = model(input_ids=ids).logits[:, 4:-1] / temperature  # positions predicting the completion
        q_logits = frozen(input_ids=ids).logits[:, 4:-1] / temperature
    kl = torch.distributions.kl_divergence(
        torch.distributions.Categorical(logits=p_logits), torch.distributions.Categorical(logits=q_logits)
    )
    want = float((kl * completion_mask).sum() / completion_mask.sum())
    assert want > 1e-3  # the adapter moved the policy: a KL of 0 would pass anything
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert model.training  # left as it was found


def test_factor_kinds_on_a_bd_lora_model_and_the_update_norm_of_a_known_step():
    model, _ = _bd_model()
    groups = factor_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    kinds = {kind: {names[id(p)] for p in params} for kind, params in groups.items()}
    assert set(kinds) == {"lora_A", "lora_A_bd", "lora_B", "lora_B_bd"}
    # BD-B on column-parallel layers (q/k/v/gate/up), BD-A on row-parallel ones (o/down)
    assert all(("o_proj" in n or "down_proj" in n) for n in kinds["lora_A_bd"])
    assert all(("o_proj" in n or "down_proj" in n) for n in kinds["lora_B"])
    assert any("q_proj" in n for n in kinds["lora_B_bd"]) and any("up_proj" in n for n in kinds["lora_A"])
    norms = UpdateNorms(groups)
    assert norms.pop() == {}  # no step taken: nothing to report
    for step in (0.1, 0.3):  # two steps: every BD-B weight moves by `step`, nothing else moves
        norms.before()
        with torch.no_grad():
            for p in groups["lora_B_bd"]:
                p.add_(step)
        norms.after()
    count = sum(p.numel() for p in groups["lora_B_bd"])
    got = norms.pop()
    assert got["update_norm/lora_B_bd"] == pytest.approx((0.1 + 0.3) / 2 * math.sqrt(count), rel=1e-6)
    assert got["update_norm/lora_A"] == 0.0 and got["update_norm/lora_A_bd"] == 0.0
    assert norms.pop() == {}  # popped: the next log starts afresh


def _record(step, reward, zero_std=0.0, kl=0.0):
    return {"step": step, "reward": reward, "frac_reward_zero_std": zero_std, "kl_to_base": kl}


def test_no_signal_warns_once_over_the_steps_it_covers_and_not_on_a_sparse_start():
    guard = LearningGuard()
    for step in range(1, NO_SIGNAL_STEPS):
        assert guard.check(_record(step, 0.0, zero_std=1.0)) == []
    lines = guard.check(_record(NO_SIGNAL_STEPS, 0.0, zero_std=1.0))
    assert len(lines) == 1 and "no learning signal" in lines[0] and "every completion scored 0" in lines[0]
    assert guard.check(_record(NO_SIGNAL_STEPS + 1, 0.0, zero_std=1.0)) == []  # said once
    # the first 10 steps of the shipped analogies recipe (a sparse reward: 3 of 4 groups often without advantage,
    # some steps all 4; mean 0.775, the most any run that learned showed) is not warned
    start = [0.75, 1.0, 0.75, 0.5, 0.5, 0.25, 0.75, 0.75, 0.5, 0.75, 1.0, 1.0, 0.75, 0.75]
    sparse = LearningGuard()
    assert all(sparse.check(_record(step, 0.03, zero_std=z)) == [] for step, z in enumerate(start, 1))
    # logged every 2 steps: each record stands for its steps; 5 records of all-alike groups cover 10 steps
    logged = LearningGuard()
    assert [logged.check(_record(step, 0.0, zero_std=1.0)) != [] for step in (2, 4, 6, 8, 10)] == [False] * 4 + [True]


def test_collapse_warns_when_the_reward_falls_far_from_the_base_and_not_when_it_rises():
    rising, falling = LearningGuard(), LearningGuard()
    for step in range(1, 11):
        assert rising.check(_record(step, 0.1 * step, kl=2 * COLLAPSE_KL)) == []  # far from the base but learning
        lines = falling.check(_record(step, 0.3 if step <= 5 else 0.0, kl=COLLAPSE_KL + step))
    assert len(lines) == 1 and "collapsing: the mean reward fell from 0.300 to 0.000" in lines[0]
    near = LearningGuard()  # the same fall close to the base: a noisy run, not a collapse
    assert all(near.check(_record(s, 0.3 if s <= 5 else 0.0, kl=COLLAPSE_KL / 2)) == [] for s in range(1, 11))


def test_drift_warns_once_when_the_policy_stays_far_from_the_base_whatever_its_reward():
    # the KL of BD-LoRA r=24 at the earlier settings (docs/rl.md), reward flat: warned when the mean of the last 5
    # steps passes DRIFT_KL (steps 4-8: 2.0, 2.84, 2.18, 2.74, 2.86 -> 2.52; steps 5-9: 2.84 ... 4.99 -> 3.12)
    kls = [0.0, 0.64, 0.73, 2.0, 2.84, 2.18, 2.74, 2.86, 4.99, 4.65, 4.46, 3.09]
    drifting, said = LearningGuard(), []
    for step, kl in enumerate(kls, 1):
        said += [(step, line) for line in drifting.check(_record(step, 0.1, kl=kl))]
    assert [s for s, _ in said] == [9] and "drifting: over the last 5 steps the policy was 3.12 nats" in said[0][1]
    # a run that learns is never warned: LoRA r=8 at lr 5e-4, seed 2 (held out 57.1 %), its KL rising to 1 over 20
    # steps, then its last 10 steps as measured, with the largest single step of any learning run (2.43)
    kls = [0.05 * s for s in range(1, 21)] + [1.26, 1.4, 0.95, 1.25, 1.47, 1.7, 1.85, 1.64, 2.43, 2.09]
    healthy = LearningGuard()
    assert all(healthy.check(_record(s, 0.02 * s, kl=kl)) == [] for s, kl in enumerate(kls, 1))
    assert DRIFT_KL > 2.43


def test_a_run_whose_reward_is_always_zero_warns_on_its_own_line_and_records_every_step(tmp_path, monkeypatch,
                                                                                       capsys):
    (tmp_path / "flat.py").write_text("def zero(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    assert main(["train", TINY, f"output_dir={out}", "rewards=[flat.py:zero]", "max_steps=11", "logging_steps=1"]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("bdlora train: warning: ")]
    assert len(lines) == 1 and lines[0].startswith("bdlora train: warning: step 10: no learning signal"), err[-2000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert [w["step"] for w in metrics["grpo_warnings"]] == [10]
    steps = metrics["per_step"]
    assert [s["step"] for s in steps] == list(range(1, 12))
    for s in steps:
        assert s["reward"] == 0.0 and s["frac_reward_zero_std"] == 1.0 and s["entropy"] > 0
        assert s["kl_to_base"] == 0.0  # no advantage, no gradient, no step: the policy is the base
        assert set(s["update_norm"]) == {"lora_A", "lora_A_bd", "lora_B", "lora_B_bd"}
        assert all(v == 0.0 for v in s["update_norm"].values())
