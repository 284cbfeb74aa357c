"""Training entry point: recipes, the tiny recipe end to end through the real CLI, kill -9 and resume, bad input."""

import functools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bdlora_train import cli
from bdlora_train.train import RecipeError, load_recipe, train
from tests.launching import cli_env, kill_9_when, stock_peft

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny" / "bdlora.yaml")
TRAINING_RECIPES = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if "accelerate" not in p.parts)


pytestmark = pytest.mark.usefixtures("one_thread")


def run_cli(*args, timeout=240, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bdlora_train.cli", "train", *args],
        cwd=ROOT,
        env=cli_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def adapter_tensors(run_dir) -> dict:
    return load_file(str(Path(run_dir) / "adapter" / "adapter_model.safetensors"))


def assert_same_tensors(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# ---------------------------------------------------------------------------------------------- recipes


def test_yaml_and_key_value_overrides_are_typed(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model: tiny:llama\nlora_r: 4\nlearning_rate: 1.0e-3\n")
    recipe = load_recipe(
        str(path),
        [
            "lora_r=8",
            "learning_rate=1e-4",
            "lora_target_modules=q_proj,v_proj",
            "resume_from_checkpoint=false",
            "fsdp_config={version: 2}",
            "lora_alpha=32",
            "hub_model_id=me/x",
            "run_name=123",
        ],
    )
    assert recipe.lora_r == 8 and recipe.learning_rate == pytest.approx(1e-4)  # "1e-4" is a YAML string, read as float
    assert recipe.lora_target_modules == ["q_proj", "v_proj"]
    assert recipe.resume_from_checkpoint is False and recipe.fsdp_config == {"version": 2}
    assert recipe.lora_alpha == 32.0 and isinstance(recipe.lora_alpha, float)
    assert recipe.run_name == "123" and recipe.model == "tiny:llama"
    assert (
        load_recipe(None, ["resume_from_checkpoint=runs/x/checkpoint-10"]).resume_from_checkpoint
        == "runs/x/checkpoint-10"
    )


@pytest.mark.parametrize(
    "override, match",
    [
        ("lora_rank=4", "unknown key 'lora_rank'; did you mean 'lora_r'"),
        ("learnig_rate=1", "did you mean 'learning_rate'"),
        ("lora_r=abc", "lora_r='abc' is not an integer"),
        ("packing=maybe", "packing='maybe' is not a bool"),
        ("max_steps=0", "max_steps=0 trains nothing"),
        ("method=dora", "method='dora'; use one of"),
        ("push_to_hub=true", "push_to_hub=true needs hub_model_id"),
        ("max_steps", "is not key=value"),
    ],
)
def test_bad_recipe_values_name_key_and_fix(override, match):
    with pytest.raises(RecipeError, match=match):
        load_recipe(None, [override])


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("nblock: 4\n")
    with pytest.raises(RecipeError, match="did you mean 'nblocks'"):
        load_recipe(str(path))


@functools.lru_cache(maxsize=None)
def _model_for(spec: str):
    from bdlora_train.models import load_config, meta_model

    return meta_model(load_config(spec))


@pytest.mark.parametrize("path", TRAINING_RECIPES, ids=lambda p: str(p.relative_to(ROOT / "recipes")))
def test_every_recipe_loads_documents_its_launch_and_lines_up_with_tp(path):
    from peft import LoraConfig

    from bdlora_train.budget import adapter_layout, count_adapter_params, match_budget
    from bdlora_train.core.heads import choose_nblocks
    from bdlora_train.peft_integration.config import BlockDiagLoraConfig, prepare_bdlora_config

    text = path.read_text()
    rel = str(path.relative_to(ROOT))
    assert "# Launch:" in text and rel in text.split("\n\n")[0], f"{rel}: header must give its launch command"
    recipe = load_recipe(str(path))
    if recipe.dataset.startswith("packaged:"):
        from bdlora_train.data.rows import DataSpec, load_rows

        assert len(load_rows(DataSpec(recipe.dataset))) > 0
    model = _model_for(recipe.model)
    if recipe.model_parallel:  # a TP recipe: what its run checks before the weights load, on the config alone
        from bdlora_train.tp_runtime.styles import EXPERT_PARALLEL
        from bdlora_train.train.run_plan import check_model_parallel

        # per decoder layer: q, k, v, o and gate, up, down; a Qwen3-MoE layer's MLP is its experts' gate_up and down;
        # under expert parallelism alone (tp_size 1) only those two: attention trains data-parallel, with no style
        styles = check_model_parallel(recipe).tp_styles
        per_layer = 2 if recipe.tp_size == 1 else 6 if model.config.model_type == "qwen3_moe" else 7
        assert len(styles) == per_layer * model.config.num_hidden_layers
        assert (set(styles.values()) == {EXPERT_PARALLEL}) == (recipe.tp_size == 1)
    if recipe.method == "lora":
        assert adapter_layout(model, LoraConfig(r=recipe.lora_r, target_modules=recipe.targets))
        return
    r = recipe.lora_r
    nblocks = choose_nblocks(model.config, recipe.nblocks, recipe.tp_size)
    if recipe.match_budget_of_lora_rank:
        r = match_budget(model, recipe.match_budget_of_lora_rank, nblocks, "below", recipe.targets)
    config = BlockDiagLoraConfig(r=r, nblocks=nblocks, target_modules=recipe.targets)
    roles = prepare_bdlora_config(model, config).resolved_roles  # raises on any TP misalignment
    assert set(roles.values()) == {"bd_a", "bd_b"}
    if "bdlora_r" in path.stem:  # the paper's 2x / 4x ranks: about 0.86x / 1.73x of LoRA r=16 on Llama-3.1
        lora16 = count_adapter_params(model, LoraConfig(r=16, target_modules=recipe.targets))
        ratio = count_adapter_params(model, config) / lora16
        expected = {32: (0.8, 0.92), 64: (1.6, 1.85)}[r]
        assert expected[0] < ratio < expected[1], (rel, ratio)


def test_accelerate_configs_and_deepspeed_jsons():
    from accelerate.commands.config.config_args import ClusterConfig

    acc = ROOT / "recipes" / "accelerate"
    for name in ("single", "ddp", "zero2", "zero3", "fsdp", "tp"):
        path = acc / f"{name}.yaml"
        assert f"recipes/accelerate/{name}.yaml" in path.read_text().split("\n\n")[0]
        config = ClusterConfig.from_yaml_file(str(path))
        if name.startswith("zero"):
            ds = config.deepspeed_config
            # accelerate refuses settings given both in the YAML and the JSON: the YAML only points at the JSON
            assert set(ds) <= {"deepspeed_config_file", "zero3_init_flag"}
            settings = json.loads((ROOT / ds["deepspeed_config_file"]).read_text())
            assert settings["zero_optimization"]["stage"] == int(name[-1])
            assert (
                settings["train_micro_batch_size_per_gpu"] == "auto"
                and settings["gradient_accumulation_steps"] == "auto"
            )
    zero3 = json.loads((acc / "zero3.json").read_text())
    assert zero3["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


# ---------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny recipe through the real CLI, as a user types it."""
    out = tmp_path_factory.mktemp("tiny") / "run"
    proc = run_cli(TINY, f"output_dir={out}", "max_steps=40", "save_steps=20")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_tiny_recipe_writes_adapter_checkpoints_and_metrics(tiny_run):
    out, proc = tiny_run
    metrics = json.loads((out / "metrics.json").read_text())
    for key in (
        "method",
        "r",
        "nblocks",
        "trainable_params",
        "train_wall_time_s",
        "tokens_per_second",
        "peak_memory_mb",
        "final_loss",
        "steps",
        "world_size",
    ):
        assert metrics[key] is not None, key
    assert metrics["method"] == "bdlora" and metrics["r"] == 8 and metrics["nblocks"] == 2
    assert metrics["steps"] == 40 and metrics["world_size"] == 1 and metrics["parallelism"] == "single"
    assert metrics["tokens_per_second"] > 0 and metrics["peak_memory_mb"] > 0
    state = json.loads((out / "checkpoint-40" / "trainer_state.json").read_text())
    losses = [e["loss"] for e in state["log_history"] if "loss" in e]
    assert losses[-1] == pytest.approx(metrics["final_loss"]) and losses[-1] < losses[0]  # it learned something
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-20",
        "checkpoint-40",
    ]
    assert not list(out.glob(".tmp-*"))
    tensors = adapter_tensors(out)
    assert sum(t.numel() for t in tensors.values()) == metrics["trainable_params"]
    assert not (out / "adapter" / "training_args.bin").exists()  # no pickles in what gets shared
    summary = [line for line in proc.stdout.splitlines() if line.startswith("bdlora train:")]
    assert len(summary) == 1 and "step 40" in summary[0] and "adapter ->" in summary[0]


def test_adapter_loads_in_stock_peft_and_computes_the_trained_function(tiny_run):
    """A fresh interpreter with only transformers + PEFT loads the adapter; its logits equal the base model
    with the adapter's dense delta (from the packed blocks) merged in by hand."""
    from bdlora_train.adapters.reader import read_adapter
    from bdlora_train.models import build_tiny_model

    out, _ = tiny_run
    stock = stock_peft(out / "adapter")
    assert stock["bd_variant"] and not stock["bdlora_imported"]
    base = build_tiny_model("llama", seed=0)
    adapter = read_adapter(out / "adapter")
    with torch.no_grad():
        for name, module in adapter.modules.items():
            base.get_submodule(name).weight += module.delta_weight()
        expected = base(input_ids=torch.arange(3, 40).view(1, -1)).logits[0, -1]
    assert adapter.nblocks == 2 and any(m.role == "bd_a" for m in adapter.modules.values())
    torch.testing.assert_close(torch.tensor(stock["logits"]), expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(
        expected, build_tiny_model("llama", seed=0)(input_ids=torch.arange(3, 40).view(1, -1)).logits[0, -1]
    )


def test_a_killed_run_says_where_it_resumes_and_warns_of_nothing(tmp_path, tiny_inputs, capsys, tiny_recipe):
    """A re-run after a kill (checkpoint-2 of 4 on disk, no adapter yet) prints one line on where it resumes; the
    schedule is the one it was trained on, so there is no warning."""
    import shutil

    model, tok, rows = tiny_inputs
    out = tmp_path / "k"
    train(tiny_recipe(out, max_steps=4, save_steps=2), model, tok, rows)
    for done in ("checkpoint-4", "adapter"):  # what a kill between the two checkpoints leaves
        shutil.rmtree(out / done)
    (out / "metrics.json").unlink()
    capsys.readouterr()
    again = train(tiny_recipe(out, max_steps=4, save_steps=2), model, tok, rows)
    assert again.metrics["resumed_from"].endswith("checkpoint-2") and again.metrics["steps_this_run"] == 2
    err = re.split(r"[\r\n]", capsys.readouterr().err)  # a progress bar ends its lines with \\r
    assert f"bdlora train: resuming from {out}/checkpoint-2 (step 2 of 4)" in err, err
    assert not [line for line in err if "warning" in line], err


def test_kill_9_mid_run_then_rerun_equals_uninterrupted_run(tmp_path):
    args = [TINY, "max_steps=120", "save_steps=10", "save_total_limit=3", "logging_steps=10"]
    killed = tmp_path / "killed"
    kill_9_when([sys.executable, "-m", "bdlora_train.cli", "train", *args, f"output_dir={killed}"],
                killed / "checkpoint-10")
    assert not (killed / "adapter").exists(), "the run finished before the kill; the test needs a slower run"
    # what a crash mid-save looks like: a staging dir, and a checkpoint dir without its trainer_state.json
    (killed / ".tmp-checkpoint-110" / "checkpoint-110").mkdir(parents=True)
    (killed / "checkpoint-115").mkdir()
    (killed / "checkpoint-115" / "adapter_model.safetensors").write_bytes(b"half")

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the killed subprocess (OMP_NUM_THREADS=1), so float sums agree bit for bit
    try:
        assert cli.main(["train", *args, f"output_dir={killed}"]) == 0  # the very same command, in this process
        fresh = tmp_path / "fresh"
        assert cli.main(["train", *args, f"output_dir={fresh}"]) == 0
    finally:
        torch.set_num_threads(threads)
    metrics = json.loads((killed / "metrics.json").read_text())
    assert metrics["resumed_from"] is not None and "checkpoint-115" not in metrics["resumed_from"]
    assert 0 < metrics["steps_this_run"] < 120 and metrics["steps"] == 120
    assert not list(killed.glob(".tmp-*"))
    assert_same_tensors(adapter_tensors(killed), adapter_tensors(fresh))


# ---------------------------------------------------------------------------------------------- bad input


def _cli_error(capsys, *args) -> str:
    code = cli.main(["train", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err, "expected a one-line error"
    return err[-1]


def test_bad_inputs_are_one_line_errors_before_training(tmp_path, capsys):
    (tmp_path / "cols.jsonl").write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "file").write_text("not a dir")
    cases = {
        f"dataset={tmp_path / 'cols.jsonl'}": "match no known format",
        f"dataset={tmp_path / 'empty.jsonl'}": "dataset",
        "max_steps=0": "max_steps=0 trains nothing",
        "model=/no/such/model/dir": "recipe: model=/no/such/model/dir: no such file",
        "nblocks=3": "nblocks",  # tiny Llama has 4 heads / 2 KV heads: 3 blocks cannot line up
    }
    for i, (override, match) in enumerate(cases.items()):
        out = tmp_path / f"run{i}"
        line = _cli_error(capsys, TINY, f"output_dir={out}", override)
        assert line.startswith("bdlora train: error:") and match in line, line
        assert not list(out.glob("checkpoint-*")) and not (out / "adapter").exists()
    line = _cli_error(capsys, TINY, f"output_dir={tmp_path / 'file' / 'sub'}")
    assert "output_dir" in line and "not writable" in line
    line = _cli_error(capsys, str(tmp_path / "missing.yaml"))
    assert "file not found" in line


def test_cli_prints_resolved_recipe(capsys):
    assert cli.main(["train", TINY, "lora_r=4", "--print-recipe"]) == 0
    printed = capsys.readouterr().out
    assert "lora_r: 4" in printed and "model: tiny:llama" in printed


# ---------------------------------------------------------------------------------------------- API


def test_train_api_leaves_the_callers_model_untouched_and_is_deterministic(tmp_path, tiny_inputs, tiny_recipe):
    model, tok, rows = tiny_inputs
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.set_num_threads(2)
    first = train(tiny_recipe(tmp_path / "a", cpu_threads=1), model, tok, rows)
    assert torch.get_num_threads() == 2  # cpu_threads applies to the run only
    torch.set_num_threads(1)
    train(tiny_recipe(tmp_path / "b"), model, tok, rows)
    train(tiny_recipe(tmp_path / "c", seed=1), model, tok, rows)
    lora = train(tiny_recipe(tmp_path / "d", method="lora"), model, tok, rows)
    assert model.state_dict().keys() == before.keys() and all(
        torch.equal(model.state_dict()[k], v) for k, v in before.items()
    )
    assert not any("lora_" in name for name, _ in model.named_modules())
    assert_same_tensors(adapter_tensors(tmp_path / "a"), adapter_tensors(tmp_path / "b"))
    a, c = adapter_tensors(tmp_path / "a"), adapter_tensors(tmp_path / "c")
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert first.metrics["nblocks"] == 2 and lora.metrics["nblocks"] == 1 and lora.metrics["method"] == "lora"
    assert lora.metrics["trainable_params"] > first.metrics["trainable_params"]  # same rank, LoRA has no blocks
    assert first.adapter_dir == tmp_path / "a" / "adapter"
    assert json.loads((tmp_path / "a" / "metrics.json").read_text()) == first.metrics
    assert type(first.model).__name__ == "PeftModelForCausalLM"
    assert first.model.get_base_model().config.use_cache == model.config.use_cache


def test_max_train_samples_caps_a_passed_in_dataset_too(tmp_path, tiny_inputs, monkeypatch, tiny_recipe):
    import bdlora_train.objectives.supervised as tok  # the objective tokenizes with the `tokenize` it imported

    model, tokenizer, rows = tiny_inputs
    seen, real = [], tok.tokenize
    monkeypatch.setattr(tok, "tokenize", lambda data, *a, **k: seen.append(list(data["prompt"])) or real(data, *a, **k))
    train(tiny_recipe(tmp_path / "a", max_train_samples=5, max_steps=1), model, tokenizer, rows)
    assert seen == [list(rows["prompt"][:5])]  # the first 5 rows, as for a recipe's own dataset


def test_match_budget_picks_the_bdlora_rank_at_or_below_the_lora_budget(tmp_path, tiny_inputs, tiny_recipe):
    from peft import LoraConfig

    from bdlora_train.budget import count_adapter_params

    model, tok, rows = tiny_inputs
    result = train(
        tiny_recipe(tmp_path / "m", match_budget_of_lora_rank=8, lora_alpha_ratio=2.0, max_steps=1), model, tok, rows
    )
    m = result.metrics
    lora8 = count_adapter_params(model, LoraConfig(r=8, target_modules=m["target_modules"]))
    assert m["matched_lora_rank"] == 8 and m["matched_lora_params"] == lora8
    assert m["trainable_params"] <= lora8 and m["r"] % 2 == 0 and m["r"] > 8 and m["lora_alpha"] == 2 * m["r"]
    assert "matched LoRA budget: LoRA r = 8" in (result.adapter_dir / "README.md").read_text()


def test_packing_gives_the_same_first_step_loss_as_padding(tmp_path, tiny_inputs, tiny_recipe):
    model, tok, rows = tiny_inputs
    padded = train(tiny_recipe(tmp_path / "pad", max_steps=1), model, tok, rows)
    packed = train(tiny_recipe(tmp_path / "pack", max_steps=1, packing=True), model, tok, rows)
    assert packed.metrics["final_loss"] == pytest.approx(padded.metrics["final_loss"], rel=1e-4)
    assert packed.metrics["tokens_seen"] == padded.metrics["tokens_seen"]  # padding tokens are not counted


def test_chat_dataset_trains(tmp_path, tiny_recipe):
    result = train(tiny_recipe(tmp_path / "chat", dataset="packaged:tiny_chat.jsonl", max_steps=2))
    assert result.metrics["steps"] == 2 and result.metrics["final_loss"] > 0


def test_wandb_logs_offline_and_never_needs_the_network(tmp_path, tiny_inputs, monkeypatch, tiny_recipe):
    model, tok, rows = tiny_inputs
    # no mode set and no API key anywhere: the run must go offline by itself, not stall on a login
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a key
    start = time.monotonic()
    train(tiny_recipe(tmp_path / "w", max_steps=2, report_to="wandb"), model, tok, rows)
    assert time.monotonic() - start < 120
    runs = list((tmp_path / "w" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].rglob("*.wandb"))
    assert "WANDB_MODE" not in os.environ and "WANDB_DIR" not in os.environ  # nothing leaks into the next run


def test_rerun_resumes_with_more_steps_and_false_starts_over(tmp_path, tiny_inputs, capsys, tiny_recipe):
    model, tok, rows = tiny_inputs
    out = tmp_path / "r"
    train(tiny_recipe(out, max_steps=4, save_steps=2), model, tok, rows)
    capsys.readouterr()
    more = train(tiny_recipe(out, max_steps=6, save_steps=2), model, tok, rows)
    assert more.metrics["resumed_from"].endswith("checkpoint-4") and more.metrics["steps_this_run"] == 2
    err = re.split(r"[\r\n]", capsys.readouterr().err)  # a progress bar ends its lines with \\r
    assert any("changed keys: max_steps (4 -> 6)" in line for line in err)
    # issue 30: where it resumes, and that a finished run's schedule made the result differ from a fresh run's
    assert f"bdlora train: resuming from {out}/checkpoint-4 (step 4 of 6)" in err, err
    assert (
        "bdlora train: warning: checkpoint-4 was trained on a 4-step learning-rate schedule, this run has 6 steps: "
        "the result differs from a fresh run of 6 steps; for a fresh run use resume_from_checkpoint=false or a new "
        "output_dir"
    ) in err, err
    over = train(tiny_recipe(out, max_steps=2, save_steps=2, resume_from_checkpoint=False), model, tok, rows)
    assert over.metrics["resumed_from"] is None and over.metrics["steps"] == 2
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]  # no stale checkpoint-6 to resume later


@pytest.mark.slow
@pytest.mark.embedded
def test_smollm2_recipe_trains_the_embedded_model(tmp_path):
    proc = run_cli(
        str(ROOT / "recipes/smollm2-135m/analogies/bdlora.yaml"),
        f"output_dir={tmp_path}",
        "max_steps=2",
        "logging_steps=1",
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["r"] == 12 and metrics["nblocks"] == 3 and metrics["trainable_params"] == 2_188_800
    assert metrics["matched_lora_params"] == 2_442_240
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in (tmp_path / "adapter" / "README.md").read_text()


def test_accelerate_launch_cpu_with_two_processes_is_refused_not_run_alone(tmp_path):
    """`accelerate launch --cpu --num_processes 2` starts ONE process and tells it nothing (accelerate 1.15): the run
    must refuse in one line instead of training alone while the user believes two ranks share it."""
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "bdlora_train.train", TINY,
           f"output_dir={out}", "max_steps=1"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("bdlora train: error: ")]
    assert ours == [
        "bdlora train: error: recipe: accelerate launch was asked for --num_processes 2 but started one (it starts "
        "several only with a distributed config: --multi_gpu on GPUs); on CPU start 2 ranks with "
        f"`ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 -m bdlora_train.train {TINY} output_dir={out} "
        "max_steps=1`"  # the run's own arguments: the command runs as printed
    ]
    assert not out.exists()  # refused before anything was written
