"""What explains a GRPO run going right or wrong, measured at every logged step, and the warning a run prints while
it is not learning (docs/rl.md, "Why a run learns or collapses").

TRL's GRPOTrainer already logs the mean reward and its spread (`reward`, `reward_std`), the fraction of prompt groups
whose completions all scored the same (`frac_reward_zero_std`: no advantage, so no gradient from that group), the
policy's entropy and the completion lengths. `GrpoDiagnostics` (a mixin over TRL's trainer) adds what TRL leaves out
with `beta: 0` (its default) and what is specific to an adapter:

- `kl_to_base`: the exact per-token KL(policy || base model) over the sampled completions, from the full next-token
  distributions at the sampling temperature (the base is the same PEFT model with the adapter disabled), averaged
  over completion tokens. TRL logs a KL only against a reference model and only when `beta` > 0;
- `update_norm/<factor>`: the norm of the optimizer step of each kind of factor, `lora_A` and `lora_B`, dense and
  block-diagonal (`_bd`), summed over layers (the square root of the sum of squares), averaged over the steps since
  the last log. Adam moves every weight by about the learning rate, so these show how far each factor kind moves.

`LearningGuard` reads each logged step and says, once per kind, when a run is not learning: most groups without any
advantage over several steps (the reward does not tell completions apart), the policy far from the base
with its reward fallen from where it started (a collapse), or the policy far from the base for several steps
whatever its reward (a drift). The bounds and why are beside them.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import torch

from bdlora_train.core.boundary import own_line

# No signal: on average at least NO_SIGNAL_FRACTION of the prompt groups scored all their completions alike over the
# last NO_SIGNAL_STEPS steps. Runs that learned on the embedded model (docs/rl.md) stayed at or below 0.78 over any 10
# steps, their first steps included, where a sparse reward leaves most groups without advantage (analogies: the base
# model samples about 3 % right answers at temperature 1); a reward that is always 0 gives 1.
NO_SIGNAL_FRACTION = 0.9
NO_SIGNAL_STEPS = 10
# A collapse: the mean reward over the last COLLAPSE_WINDOW steps below COLLAPSE_REWARD_SHARE of the first
# COLLAPSE_WINDOW steps' while the policy is more than COLLAPSE_KL nats per token from the base.
COLLAPSE_WINDOW = 5
COLLAPSE_REWARD_SHARE = 0.5
COLLAPSE_KL = 1.0
# A drift: the policy on average more than DRIFT_KL nats per token from the base over the last COLLAPSE_WINDOW steps.
# Measured on the embedded model (docs/rl.md): the 24 runs of the sweeps at lr 2.5e-4 to 1e-3 that raised held-out
# accuracy (analogies and continents) peaked at 2.4 nats per token on one step and never averaged above 3 over 5
# steps; every run at lr 2e-3 (held out: 45-51 % where 1e-3 gave 60-67 %) and BD-LoRA r=24 at the earlier settings
# (alpha = 2r, lr 2e-3: 0.64 after its first step, 5 to 9 from its ninth; 28.6 % held out) passed it.
DRIFT_KL = 3.0

STEP_KEYS = {  # metrics.json's per-step record: its key -> the logged key it comes from
    "reward": "reward",
    "reward_std": "reward_std",
    "frac_reward_zero_std": "frac_reward_zero_std",
    "kl_to_base": "kl_to_base",
    "entropy": "entropy",
    "completion_length": "completions/mean_length",
    "learning_rate": "learning_rate",
}
UPDATE_PREFIX = "update_norm/"


def factor_groups(model) -> dict[str, list]:
    """The trainable adapter weights by factor kind: `lora_A`, `lora_B`, and the block-diagonal ones as
    `lora_A_bd` / `lora_B_bd` (peft_integration.layers.block_diagonal_factors); any other trainable weight (a
    `modules_to_save` copy, a bias) as `other`."""
    from bdlora_train.peft_integration.layers import block_diagonal_factors

    bd = {id(p) for p in block_diagonal_factors(model)}
    groups: dict[str, list] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        kind = "lora_A" if ".lora_A." in name else "lora_B" if ".lora_B." in name else "other"
        groups.setdefault(kind + ("_bd" if id(param) in bd and kind != "other" else ""), []).append(param)
    return groups


class UpdateNorms:
    """Each optimizer step's norm per factor kind: `before()` keeps a copy of the weights, `after()` adds the norm of
    the change; `pop()` returns the means since the last pop ({} when no step was taken)."""

    def __init__(self, groups: dict[str, list]):
        self.groups = groups
        self.kept: dict[str, list] = {}
        self.sums: dict[str, float] = {}
        self.steps = 0

    def before(self) -> None:
        self.kept = {kind: [p.detach().clone() for p in params] for kind, params in self.groups.items()}

    def after(self) -> None:
        if not self.kept:
            return
        for kind, params in self.groups.items():
            squares = sum(_squares(p.detach() - old) for p, old in zip(params, self.kept[kind]))
            self.sums[kind] = self.sums.get(kind, 0.0) + math.sqrt(squares)
        self.kept, self.steps = {}, self.steps + 1

    def pop(self) -> dict[str, float]:
        out = {f"{UPDATE_PREFIX}{kind}": total / self.steps for kind, total in self.sums.items()} if self.steps else {}
        self.sums, self.steps = {}, 0
        return out


def _squares(change: torch.Tensor) -> float:
    """The sum of squares of a weight's change, whole: a TP run's DTensor sums over its mesh (the parts of a sharded
    factor added, a replicated one counted once; a collective every rank of the mesh reaches, as every rank steps)."""
    from torch.distributed.tensor import DTensor

    total = change.double().pow(2).sum()
    return float(total.full_tensor() if isinstance(total, DTensor) else total)


def kl_to_base(model, peft_model, inputs: dict, temperature: float, chunk: int = 8) -> float:
    """The mean over completion tokens of KL(policy || base) at each token's position, exact over the vocabulary:
    sum_v p(v) (log p(v) - log q(v)) with p the policy's and q the base model's next-token distribution at
    `temperature`. `model` runs the forwards (the trainer's, possibly wrapped), `peft_model` disables the adapter.
    Computed `chunk` sequences at a time, so the two (chunk x completion x vocabulary) tensors bound the memory."""
    prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    keep = completion_ids.size(1)
    completion_mask = inputs["completion_mask"].float()
    was_training, total = model.training, 0.0
    model.eval()  # no dropout: the policy as it samples
    try:
        with torch.no_grad():
            for start in range(0, ids.size(0), chunk):
                rows = slice(start, start + chunk)

                def log_probs(rows=rows):
                    logits = model(input_ids=ids[rows], attention_mask=mask[rows], logits_to_keep=keep + 1).logits
                    wide = torch.promote_types(logits.dtype, torch.float32)  # fp32 at least (bf16 logits widened)
                    return torch.log_softmax(logits[:, :-1].to(wide) / temperature, dim=-1)

                logp = log_probs()
                with peft_model.disable_adapter():
                    logq = log_probs()
                per_token = (logp.exp() * (logp - logq)).sum(-1)
                total += float((per_token * completion_mask[rows]).sum())
    finally:
        model.train(was_training)
    return total / max(float(completion_mask.sum()), 1.0)


def step_record(entry: dict) -> dict:
    """metrics.json's record of one logged step (absent values left out)."""
    out = {"step": entry.get("step")}
    for key, logged in STEP_KEYS.items():
        if entry.get(logged) is not None:
            out[key] = round(float(entry[logged]), 6)
    norms = {k.removeprefix(UPDATE_PREFIX): round(float(v), 8) for k, v in entry.items() if k.startswith(UPDATE_PREFIX)}
    if norms:
        out["update_norm"] = norms
    return out


@dataclass
class LearningGuard:
    """Reads each logged step's record; `check` returns the warnings (one per kind per run) that step raises."""

    records: list[dict] = field(default_factory=list)
    said: set = field(default_factory=set)

    def check(self, record: dict) -> list[str]:
        self.records.append(record)
        out = []
        if "no_signal" not in self.said and self._no_signal():
            self.said.add("no_signal")
            rewards = {r.get("reward") for r in self.records if r["step"] > record["step"] - NO_SIGNAL_STEPS}
            same = f" (every completion scored {rewards.pop():g})" if len(rewards) == 1 else ""
            out.append(
                f"step {record['step']}: no learning signal: over the last {NO_SIGNAL_STEPS} steps at least "
                f"{NO_SIGNAL_FRACTION:.0%} of the prompt groups scored all their completions alike{same}, so their "
                "advantages are 0; check the reward on a few completions, raise temperature or num_generations, or "
                "use prompts the model sometimes gets right"
            )
        collapse = self._collapse()
        if "collapse" not in self.said and collapse is not None:
            self.said.add("collapse")
            first, last, kl = collapse
            out.append(
                f"step {record['step']}: collapsing: the mean reward fell from {first:.3f} to {last:.3f} while the "
                f"policy moved {kl:.2f} nats per token from the base model; {LOWER_STEP}"
            )
        drift = self._drift()
        if "drift" not in self.said and "collapse" not in self.said and drift is not None:
            self.said.add("drift")
            out.append(
                f"step {record['step']}: drifting: over the last {COLLAPSE_WINDOW} steps the policy was {drift:.2f} "
                f"nats per token from the base model on average (runs that learned here stayed below 3); {LOWER_STEP}"
            )
        return out

    def _no_signal(self) -> bool:
        step = self.records[-1]["step"]
        if step < NO_SIGNAL_STEPS:
            return False
        share = self._mean("frac_reward_zero_std", step - NO_SIGNAL_STEPS + 1, step)
        return share is not None and share >= NO_SIGNAL_FRACTION

    def _collapse(self) -> tuple[float, float, float] | None:
        """(first window's mean reward, last window's, KL) when the run collapses: windows of COLLAPSE_WINDOW steps
        at the start and at the end, apart."""
        step = self.records[-1]["step"]
        if step < 2 * COLLAPSE_WINDOW:
            return None
        first = self._mean("reward", 1, COLLAPSE_WINDOW)
        last = self._mean("reward", step - COLLAPSE_WINDOW + 1, step)
        kl = self.records[-1].get("kl_to_base")
        if first is None or last is None or kl is None:
            return None
        if first > 0 and last < COLLAPSE_REWARD_SHARE * first and kl > COLLAPSE_KL:
            return first, last, kl
        return None

    def _drift(self) -> float | None:
        """The mean KL to the base over the last COLLAPSE_WINDOW steps when it is above DRIFT_KL."""
        step = self.records[-1]["step"]
        mean = self._mean("kl_to_base", step - COLLAPSE_WINDOW + 1, step) if step >= COLLAPSE_WINDOW else None
        return mean if mean is not None and mean > DRIFT_KL else None

    def _mean(self, key: str, first_step: int, last_step: int) -> float | None:
        """The mean of `key` over the records of steps first_step..last_step (None where none has it)."""
        values = [r[key] for r in self.records if first_step <= r["step"] <= last_step and r.get(key) is not None]
        return sum(values) / len(values) if values else None


LOWER_STEP = ("lower learning_rate (a fixed lora_alpha keeps the step from growing with r), or set beta > 0 to hold "
              "the policy near the base")


class GrpoDiagnostics:
    """A mixin over TRL's GRPOTrainer: `kl_to_base` measured on the batch of every step that will be logged, the
    update norms of every step, both added to the step's log (so trainer_state.json's log history, which a resumed
    run keeps, holds them), and each logged step checked by `LearningGuard`, whose warnings go to stderr on a line of
    their own (after any progress bar) and into metrics.json (`grpo_warnings`)."""

    def __init__(self, *args, **kwargs):
        from transformers import TrainerCallback

        super().__init__(*args, **kwargs)
        self.grpo_warnings: list[dict] = []
        self._bdlora_guard = LearningGuard()
        self._bdlora_kl: list[float] = []
        norms = self._bdlora_norms = UpdateNorms(factor_groups(self.accelerator.unwrap_model(self.model)))

        class Steps(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                norms.before()

            def on_optimizer_step(self, args, state, control, **kwargs):
                norms.after()

        self.add_callback(Steps())

    def _bdlora_logs_after_this_step(self) -> bool:
        steps = self.args.logging_steps
        return steps <= 1 or (self.state.global_step + 1) % int(steps) == 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.model.training and self._bdlora_logs_after_this_step():
            peft_model = self.accelerator.unwrap_model(model)
            self._bdlora_kl.append(kl_to_base(model, peft_model, inputs, self.args.temperature))
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def log(self, logs: dict, start_time: float | None = None) -> None:
        if self.model.training:  # TRL's own test for a training log (an evaluation's keys start with eval_)
            logs.update(self._bdlora_norms.pop())
            if self._bdlora_kl:
                logs["kl_to_base"] = sum(self._bdlora_kl) / len(self._bdlora_kl)
                self._bdlora_kl = []
        super().log(logs, start_time)
        entry = self.state.log_history[-1] if self.state.log_history else {}
        if not self.model.training or "reward" not in entry:
            return
        record = step_record(entry)
        for line in self._bdlora_guard.check(record):
            self.warn(record["step"], line)

    def warn(self, step: int, line: str) -> None:
        """`line` on stderr (the main process's) and in metrics.json's `grpo_warnings`, for `step`."""
        self.grpo_warnings.append({"step": step, "warning": line})
        if self.args.process_index == 0:
            print(own_line(f"bdlora train: warning: {line}"), file=sys.stderr, flush=True)
