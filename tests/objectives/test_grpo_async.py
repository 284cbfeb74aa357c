"""Asynchronous GRPO and importance sampling with a rollout server (rl/rollouts.py, rl/lookahead.py,
objectives/grpo.py `ServerSampled`), against the stand-in for `vllm serve` (tests/rl/fake_vllm.py) scoring with the
tiny Llama itself: each request's log-probs are the adapter version it names, loaded on the tiny model by stock PEFT
and scored by a plain forward written here (not the toolkit's). The real server is tests/vllm/test_rl_rollouts.py's.
"""

from __future__ import annotations

import copy
import json
import math
import threading
import time
from pathlib import Path

import pytest
import torch

from bdlora_train.cli import main
from bdlora_train.core.errors import RecipeError
from bdlora_train.recipe.load import load_recipe
from tests.rl.fake_vllm import FakeVllm

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "tiny" / "grpo.yaml")
PARITY = f"{Path(__file__).with_name('first_token_parity.py')}:first_token_parity"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny Llama as a model directory (the rollout route refuses `tiny:` specs, which vLLM cannot load)."""
    from bdlora_train.models import build_tiny_model, tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-model")
    build_tiny_model("llama", seed=0).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


class Scorer:
    """The stand-in server's log-probs: the base, or the adapter at the path a request names loaded on it by stock
    PEFT, each completion scored alone (no batch, no padding) in `dtype`; `shift(token)` added to each (a behaviour
    policy other than the trainer's)."""

    def __init__(self, base_dir: Path, dtype=torch.float32, shift=None):
        from transformers import AutoModelForCausalLM

        self.base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).eval()
        self.dtype, self.shift, self.loaded, self.lock = dtype, shift, {}, threading.Lock()

    def model(self, path: str | None):
        from peft import PeftModel

        if path is None:
            return self.base
        if path not in self.loaded:
            self.loaded[path] = PeftModel.from_pretrained(copy.deepcopy(self.base), path).eval()
        return self.loaded[path]

    def __call__(self, path: str | None, prompt: list[int], completion: list[int]) -> list[float]:
        with self.lock, torch.no_grad():
            logits = self.model(path)(torch.tensor([prompt + completion])).logits[0].to(torch.float64)
        logp = torch.log_softmax(logits, dim=-1)
        out = [logp[len(prompt) - 1 + k, token].item() for k, token in enumerate(completion)]
        return [x + self.shift(t) for x, t in zip(out, completion)] if self.shift else out


def _train(out: Path, url: str, model: Path, *overrides: str) -> int:
    return main(["train", RECIPE, f"output_dir={out}", f"model={model}", f"rollout_server={url}", "save_steps=100",
                 "method=lora", "logging_steps=1", f"rewards=[{PARITY}]", *overrides])


@pytest.mark.parametrize("staleness, temperature", [(0, 1.0), (1, 1.0), (0, 0.7)])
def test_rollouts_k_versions_old_are_checked_under_the_version_that_sampled_them(tmp_path, tiny_dir, staleness,
                                                                                 temperature):
    """max_staleness 1: step k trains on completions sampled under version k-1 (lag 1 from the second step), the
    server never holds more than 2 versions, and every step's gap is measured under the version that sampled: it is
    float32 rounding (the default bound, 1e-3 on every token, holds), where the trainer's own version would be a
    learning step away. max_staleness 0 samples every step under its own version. With importance sampling on (TRL's
    default) the ratios at lag 0 are 1 to float32 rounding: the behaviour log-probs and TRL's recomputed ones are two
    float32 forwards of the same weights (a few 1e-7 relative per logit, summed over a sequence's 6 tokens: far
    below 1e-4), at temperature 0.7 too, where the server returns log-probs at temperature 1 (the stand-in, like
    vLLM's raw mode) and the trainer's are at 0.7: taken as they come, the ratio would be exp of a sequence's
    difference between the two, far from 1."""
    fake = FakeVllm(base=str(tiny_dir), scorer=Scorer(tiny_dir))
    out = tmp_path / "run"
    with fake as url:
        assert _train(out, url, tiny_dir, "max_steps=4", f"max_staleness={staleness}",
                      f"temperature={temperature}") == 0
    rollout = json.loads((out / "metrics.json").read_text())["rollout"]
    steps = rollout["steps"]
    lags = [0, 1, 1, 1] if staleness else [0, 0, 0, 0]
    assert [s["lag"] for s in steps] == lags and [s["version"] for s in steps] == [k - lag for k, lag in
                                                                                   enumerate(lags)]
    assert rollout["max_version_lag"] == max(lags) and rollout["max_staleness"] == staleness
    assert rollout["max_abs_logprob_diff"] <= 1e-3, steps
    assert rollout["gap_rule"] == {"statistic": "max", "bound": 1e-3}
    assert fake.peak_adapters <= 2 and fake.adapters == {}
    # each step's completions were sampled under the version the record names, with the seed block of its step
    sampled = [a["model"] for a in fake.answers if a["model"] != str(tiny_dir)]
    assert [int(m.rsplit("-v", 1)[1]) for m in sampled[::2]] == [s["version"] for s in steps]  # two prompts a step
    for step in steps:
        ratios = step["importance_sampling"]
        assert ratios["mode"] == "sequence_mask"
        if step["lag"] == 0:
            assert all(abs(ratios[k] - 1) < 1e-4 for k in ("mean", "min", "max")), step
            assert ratios["outside_fraction"] == 0.0
    if staleness:  # a learning step between the sampler and the trainer: the ratios are no longer 1
        assert any(abs(s["importance_sampling"]["max"] - 1) > 1e-4 for s in steps if s["lag"]), steps


def _delta(token: int) -> float:
    """The behaviour policy's deliberate offset from the trainer's, per token: -0.06 to +0.06 nats."""
    return 0.03 * ((token % 5) - 2)


@pytest.mark.parametrize("mode, low, high", [("token_truncate", 0.97, 1.02), ("sequence_mask", 0.97, 1.03)])
def test_the_loss_weighs_each_token_by_the_truncated_or_masked_ratio_to_the_server_policy(tmp_path, tiny_dir, mode,
                                                                                           low, high):
    """A behaviour policy deliberately off the trainer's (the server's log-probs shifted by `_delta` per token):
    the first step's loss, in float64, is the importance-weighted GRPO loss written out here. At the first step the
    adapter is its initialisation (LoRA's B = 0), so the trainer's policy is the base model and each ratio is
    exp(-delta) exactly; TRL's dapo loss is -sum(A_i * w_it) / tokens, with the group's advantages
    (r - mean) / (std + 1e-4). Without the correction, or with the log-probs one token off, it differs: every
    completion has 6 tokens and the advantages of a group sum to 0, so an unweighted loss is 0."""
    fake = FakeVllm(base=str(tiny_dir), scorer=Scorer(tiny_dir, torch.float64, shift=_delta))
    out = tmp_path / "run"
    with fake as url:
        assert _train(out, url, tiny_dir, "max_steps=1", "torch_dtype=float64", "rollout_max_logprob_diff=1e6",
                      f"vllm_importance_sampling_mode={mode}", f"vllm_importance_sampling_clip_min={low}",
                      f"vllm_importance_sampling_clip_max={high}") == 0
    state = json.loads((out / "checkpoint-1" / "trainer_state.json").read_text()) if (
        out / "checkpoint-1").exists() else json.loads((out / "trainer_state.json").read_text())
    loss = next(e["loss"] for e in state["log_history"] if "loss" in e)

    choices = [c for a in fake.answers if a["model"] != str(tiny_dir) for c in a["choices"]]
    assert len(choices) == 8  # 2 prompts x 4
    # TRL holds the server's log-probs in float32 (torch's default dtype) whatever the model's: each is off by up to
    # 2^-24 of its size, and so is each token's ratio (a sequence's: the sum over its tokens); `bound` sums what that
    # moves the loss by, |A| w x that error per token, over the batch
    total, bound, tokens, outside, ratios = 0.0, 0.0, 0, 0, 0
    for group in (choices[:4], choices[4:]):
        rewards = [float(c["token_ids"][0] % 2) for c in group]
        mean = sum(rewards) / 4
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 3)  # torch's unbiased std
        for choice, r in zip(group, rewards):
            ids, rounding = choice["token_ids"], [2**-24 * abs(x) for x in choice["logprobs"]["token_logprobs"]]
            advantage = (r - mean) / (std + 1e-4)
            if mode == "token_truncate":
                raw = [math.exp(-_delta(t)) for t in ids]
                weights = [min(max(w, low), high) for w in raw]
                errors = [w * e for w, e in zip(weights, rounding)]
                outside += sum(not low <= w <= high for w in raw)
                ratios += len(raw)
            else:
                raw = math.exp(-sum(_delta(t) for t in ids))
                weights = [raw if low <= raw <= high else 0.0] * len(ids)
                errors = [w * sum(rounding) for w in weights]
                outside += not low <= raw <= high
                ratios += 1
            total += -advantage * sum(weights)
            bound += abs(advantage) * sum(errors)
            tokens += len(ids)
    assert abs(total) > 1e-3  # the weighting matters: the unweighted loss is 0
    assert abs(loss - total / tokens) <= bound / tokens, (loss, total / tokens, bound / tokens)
    step = json.loads((out / "metrics.json").read_text())["rollout"]["steps"][0]
    assert step["importance_sampling"]["outside_fraction"] == pytest.approx(outside / ratios)
    assert 0 < outside < ratios  # the bounds cut some ratios and keep others


def test_a_server_failing_mid_run_keeps_the_last_step_and_the_same_command_resumes_synchronously_first(
    tmp_path, tiny_dir
):
    """max_staleness 1: the engine dies while requests are in flight; the run stops in one line with a checkpoint of
    its last completed step, and the same command resumes: its first step samples under its own version (nothing in
    flight survives a restart), the next ones one version behind again, and no version is loaded twice."""
    fake = FakeVllm(base=str(tiny_dir), scorer=Scorer(tiny_dir))
    out = tmp_path / "fault"
    args = ("max_steps=5", "max_staleness=1")
    with fake as url:
        def kill_at_v2():
            deadline = time.time() + 300
            while not any(n.endswith("-v2") for n in fake.adapters) and time.time() < deadline:
                time.sleep(0.01)
            fake.engine_dead = True

        watcher = threading.Thread(target=kill_at_v2, daemon=True)
        watcher.start()
        assert _train(out, url, tiny_dir, *args) == 1
        watcher.join()
        # the step that reads the first failed answer: 2, or 3 when step 2's (sent at step 1) was already in
        kept = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
        assert len(kept) == 1 and kept[0] in (2, 3), kept
        fake.engine_dead = False
        assert _train(out, url, tiny_dir, *args) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    steps = metrics["rollout"]["steps"]
    assert metrics["resumed_from"].endswith(f"checkpoint-{kept[0]}")
    assert [(s["step"], s["lag"]) for s in steps] == [(kept[0], 0)] + [(k, 1) for k in range(kept[0] + 1, 5)]
    assert metrics["rollout"]["max_abs_logprob_diff"] <= 1e-3 and fake.adapters == {}


@pytest.mark.parametrize("overrides, message", [
    (["max_staleness=1"], "max_staleness=1 needs rollout_server"),
    (["vllm_importance_sampling_mode=token_mask"], "vllm_importance_sampling_mode corrects for the rollout server's "
                                                   "sampling policy, and there is no rollout_server"),
    (["rollout_server=http://127.0.0.1:1", "max_staleness=1", "num_iterations=2"], "max_staleness=1 counts adapter "
                                                                                  "versions per generation"),
    (["rollout_server=http://127.0.0.1:1", "vllm_importance_sampling_cap=2"], "vllm_importance_sampling_cap is set "
                                                                              "by bdlora-train"),
])
def test_asynchronous_and_importance_sampling_recipes_refused_in_one_line(overrides, message):
    with pytest.raises(RecipeError, match=message) as err:
        load_recipe(RECIPE, overrides)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("how", ["ddp", "tp2"])
def test_two_processes_sample_ahead_together(tmp_path, tiny_dir, how):
    """max_staleness 1 under 2 DDP ranks (each samples its own prompts ahead) and TP 2 (the group's first rank asks,
    its peer receives; the check's forward copies the earlier version into both ranks' shards): every step after the
    first trains one version behind, each rank's gap is float32 rounding under the recorded version, and the server
    holds at most 2 versions."""
    from tests.objectives.test_grpo_parallel import _launch

    fake = FakeVllm(base=str(tiny_dir), scorer=Scorer(tiny_dir))
    out = tmp_path / how
    with fake as url:
        proc = _launch(out, url, tiny_dir, "max_staleness=1", "method=lora", f"rewards=[{PARITY}]", how=how, steps=4)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rollout = json.loads((out / "metrics.json").read_text())["rollout"]
    assert [(s["step"], s["lag"]) for s in rollout["steps"]] == [(0, 0), (1, 1), (2, 1), (3, 1)]
    assert rollout["max_abs_logprob_diff"] <= 1e-3 and fake.peak_adapters <= 2 and fake.adapters == {}
    samplers = 1 if how == "tp2" else 2
    sampled = [a for a in fake.answers if a["model"] != str(tiny_dir)]
    assert len(sampled) == 2 * samplers * 4  # two prompts per sampling rank and step, no request wasted


@pytest.mark.parametrize("order, warned_at", [("reversed", 1), ("unknown", 0)])
def test_a_data_order_the_stream_cannot_repeat_is_one_warning_and_the_run_samples_synchronously(
        tmp_path, tiny_dir, monkeypatch, capsys, order, warned_at):
    """A trainer whose second dataloader does not repeat its first's order (a user's unseeded sampler, standing in:
    TRL's get_train_dataloader wrapped to reverse the batches, or to hand prompts that are not in the data) trains
    every step synchronously (lag 0), and the run says so once, on stderr and in metrics.json: a reversed order
    sends a request for step 1 that is not step 1's (the miss), prompts found nowhere stop the predictions at step
    0. Without the warning the run would only show lag 0 where max_staleness 1 was asked for."""
    from trl import GRPOTrainer

    own, calls = GRPOTrainer.get_train_dataloader, []

    def another_order_after_the_first(self):
        loader = own(self)
        calls.append(loader)
        if len(calls) == 1:  # the trainer's own
            return loader
        batches = [list(batch) for batch in loader]
        if order == "reversed":
            return batches[::-1]
        return [[{**row, "prompt": row["prompt"] + " (unseen)"} for row in batch] for batch in batches]

    monkeypatch.setattr(GRPOTrainer, "get_train_dataloader", another_order_after_the_first)
    fake = FakeVllm(base=str(tiny_dir), scorer=Scorer(tiny_dir))
    out = tmp_path / "run"
    with fake as url:
        assert _train(out, url, tiny_dir, "max_steps=4", "max_staleness=1") == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert [s["lag"] for s in metrics["rollout"]["steps"]] == [0, 0, 0, 0]
    warnings = [w for w in metrics["grpo_warnings"] if "max_staleness 1" in w["warning"]]
    assert [w["step"] for w in warnings] == [warned_at], metrics["grpo_warnings"]
    assert capsys.readouterr().err.count("bdlora train: warning: max_staleness 1:") == 1
    assert fake.adapters == {}


def test_the_printed_server_command_holds_every_version_in_flight(tmp_path, tiny_dir, capsys):
    """max_staleness 2: up to 3 versions are loaded at once, so the command the run prints when no server answers
    starts one with --max-loras 3 (2 for a synchronous run: the new version loads before the old one unloads)."""
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for staleness, slots in ((2, 3), (0, 2)):
        assert _train(tmp_path / f"k{staleness}", f"http://127.0.0.1:{port}", tiny_dir, "max_steps=3",
                      f"max_staleness={staleness}") == 1
        err = capsys.readouterr().err
        assert "no answer" in err and f" --max-loras {slots} " in err, err[-2000:]
