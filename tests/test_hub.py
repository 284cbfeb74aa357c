"""Model card (cards.py) and Hub push (hub.py), tested offline at the huggingface_hub API boundary."""

import json
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import HfApi

from bdlora_train import cards, cli, hub
from bdlora_train.adapters.reader import read_adapter
from bdlora_train.core.errors import HubError
from bdlora_train.models import reach
from bdlora_train.peft_integration.patterns import stock_roles
from bdlora_train.serving.plan import serving_lines
from bdlora_train.train import train

SECRET = "hf_secretTOKENvalue0123456789"


def model_card(adapter_dir, metrics=None, repo_id=None, **kwargs) -> str:
    """The card as `bdlora train` / `bdlora push` render it: with the serving lines of the same adapter and name."""
    adapter = read_adapter(adapter_dir)
    location = repo_id or str(Path(adapter_dir).resolve())
    serving = serving_lines(adapter, cards.card_base(adapter, metrics), location, hub=repo_id is not None)
    return cards.model_card(adapter_dir, serving, metrics=metrics, repo_id=repo_id, **kwargs)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_recipe):
    out = tmp_path_factory.mktemp("hub") / "run"
    # seed 7: neither the Recipe default (42) nor build_tiny_model's (0), so the card snippet must carry the run's
    result = train(tiny_recipe(out, dataset="packaged:tiny_sums.jsonl", lora_r=8, max_steps=2, seed=7))
    (out / "eval_results.json").write_text(json.dumps({"task": "sums", "accuracy": 61.25, "per_family": {"add": 0.5}}))
    return result


@pytest.fixture
def fake_hub(monkeypatch):
    """Record create_repo / create_commit calls and snapshot what would be uploaded."""
    calls = {"create": [], "upload": [], "files": {}}

    def create_repo(self, repo_id, **kwargs):
        calls["create"].append((repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def create_commit(self, *, repo_id, operations, **kwargs):
        calls["upload"].append((repo_id, kwargs))
        for op in operations:
            data = op.path_or_fileobj
            calls["files"][op.path_in_repo] = data if isinstance(data, bytes) else Path(data).read_bytes()
        return type("Commit", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/abc123"})()

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    # the faked HfApi answers, so the endpoint counts as answering (reach.py's probe; real HTTP in test_hub_failures)
    monkeypatch.setitem(reach._answers, huggingface_hub.constants.ENDPOINT, None)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    return calls


def _front_matter(card: str) -> dict:
    import yaml

    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_model_card_has_peft_metadata_roles_budget_eval_and_serving(trained):
    adapter = trained.adapter_dir
    card = (adapter / "README.md").read_text()  # written by train(); PEFT's generic card replaced
    meta = _front_matter(card)
    assert meta["library_name"] == "peft" and meta["pipeline_tag"] == "text-generation"
    assert "base_model" not in meta  # "tiny:llama" is no Hub id: never written as one
    assert set(cards.TAGS) <= set(meta["tags"]) and "nblocks-2" in meta["tags"]
    # counted by hand, not read from the run: tiny Llama (hidden 64, head_dim 16, 4 q / 2 kv heads, MLP 128, 2 layers),
    # r 8, nblocks 2; per rank a BD-B module (q, k, v, gate, up) holds d_in + d_out/2 params, a BD-A one (o, down)
    # d_in/2 + d_out (dense LoRA would hold d_in + d_out: 16,384)
    per_rank = (64 + 32) + 2 * (64 + 16) + 2 * (64 + 64) + (32 + 64) + (64 + 64)
    assert "nblocks = 2" in card and f"trainable params: {2 * 8 * per_rank:,}" in card  # 11,776
    assert trained.metrics["trainable_params"] == 2 * 8 * per_rank  # what the run reports trained the same
    # roles in the card are the roles stock PEFT reads from adapter_config.json
    config = json.loads((adapter / "adapter_config.json").read_text())
    kinds = [f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + [
        f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")
    ]
    roles = stock_roles([f"model.layers.0.{kind}" for kind in kinds], config["use_bdlora"])
    assert sorted(set(roles.values())) == ["bd_a", "bd_b"]
    for module, role in roles.items():
        kind = module.removeprefix("model.layers.0.")
        assert any(line.startswith(f"| {kind} | 2 | {role} |") for line in card.splitlines()), (kind, role)
    # a tiny:llama base is no model vLLM loads: the card prints no serve command (tests/serving/test_serving.py: the
    # lines)
    assert "vLLM cannot load: no serve command applies" in card and "vllm serve" not in card
    # eval_results.json next to the adapter shows up once the card is regenerated (bdlora push does that)
    fresh = model_card(adapter)
    assert "## Evaluation" in fresh and "| accuracy | 61.25 |" in fresh and "| per_family/add | 0.5 |" in fresh
    results = {r["metric_type"]: r["metric_value"] for r in _model_index(fresh)}
    assert results == {"accuracy": 61.25, "per_family/add": 0.5}


def _model_index(card: str) -> list[dict]:
    from huggingface_hub import ModelCard

    data = ModelCard(card).data
    return [
        {"metric_type": r.metric_type, "metric_value": r.metric_value, "dataset_name": r.dataset_name}
        for r in data.eval_results or []
    ]


def test_card_metadata_round_trips_through_model_card_load_with_hub_base_and_awkward_values(trained, tmp_path):
    from huggingface_hub import ModelCard

    awkward = "my data: v2 #1"
    metrics = {**trained.metrics, "dataset": awkward}
    card = model_card(trained.adapter_dir, metrics=metrics, eval_results={"accuracy": 50.0}, repo_id="me/x")
    (tmp_path / "README.md").write_text(card)
    loaded = ModelCard.load(tmp_path / "README.md")
    assert loaded.data.library_name == "peft" and loaded.data.pipeline_tag == "text-generation"
    assert loaded.data.eval_results[0].dataset_name == awkward and loaded.data.eval_results[0].metric_value == 50.0
    data = cards.card_data("HuggingFaceTB/SmolLM2-135M-Instruct", 3, None, None, "me/x")
    assert data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "base_model:adapter:HuggingFaceTB/SmolLM2-135M-Instruct" in data.tags
    for not_hub in ("tiny:llama", "./runs/base", "/abs/base", "embedded"):
        assert cards.card_data(not_hub, 2, None, None, None).base_model is None, not_hub


def test_card_reports_the_matched_lora_budget(trained, tmp_path):
    metrics = {
        **trained.metrics,
        "matched_lora_rank": 4,
        "matched_lora_params": 2 * trained.metrics["trainable_params"],
    }
    card = model_card(trained.adapter_dir, metrics=metrics)
    assert f"LoRA r = 4 on the same modules has {metrics['matched_lora_params']:,} params" in card
    assert "0.50x" in card


def test_bdlora_push_uploads_adapter_and_card_without_showing_the_token(trained, fake_hub, capsys):
    code = cli.main(["push", str(trained.adapter_dir), "--repo-id", "me/tiny-bdlora", "--private"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert SECRET not in out.out + out.err
    assert fake_hub["create"] == [("me/tiny-bdlora", {"private": True, "exist_ok": True, "repo_type": "model"})]
    assert [repo for repo, _ in fake_hub["upload"]] == ["me/tiny-bdlora"]
    files = fake_hub["files"]
    assert {"README.md", "adapter_config.json", "adapter_model.safetensors"} <= set(files)
    assert not any(name.endswith(".bin") or name.startswith(".") for name in files)
    card = files["README.md"].decode()
    assert "# me/tiny-bdlora" in card and "| accuracy | 61.25 |" in card and SECRET not in card
    assert (trained.adapter_dir / "README.md").read_bytes() != files["README.md"]  # the local card is left alone
    assert "https://huggingface.co/me/tiny-bdlora/commit/abc123" in out.out


def test_push_refuses_without_token_offline_mode_or_adapter(trained, fake_hub, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    assert cli.main(["push", str(trained.adapter_dir), "--repo-id", "me/x"]) == 1
    assert "no Hugging Face token" in capsys.readouterr().err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match="HF_HUB_OFFLINE=1"):
        hub.require_token()
    assert cli.main(["push", str(tmp_path), "--repo-id", "me/x"]) == 1
    assert "adapter_config.json" in capsys.readouterr().err
    local_card = (trained.adapter_dir / "README.md").read_bytes()
    for bad in ("no-namespace", "me/has space", "me/x/y"):
        assert cli.main(["push", str(trained.adapter_dir), "--repo-id", bad]) == 1
        assert "repo_id" in capsys.readouterr().err
        assert cli.main(["push", str(trained.adapter_dir), "--repo-id", bad, "--card-only"]) == 1
    assert fake_hub["create"] == [] and fake_hub["upload"] == []
    assert (trained.adapter_dir / "README.md").read_bytes() == local_card  # nothing rewritten before validation


def test_hub_network_errors_are_one_line_and_name_the_retry(trained, fake_hub, monkeypatch, capsys):
    import httpx2  # huggingface_hub's HTTP client; the old httpx's errors are caught too (hub._network_errors)

    def offline(self, *args, **kwargs):
        raise httpx2.ConnectError("[Errno -2] Name or service not known")

    monkeypatch.setattr(HfApi, "create_repo", offline)
    assert cli.main(["push", str(trained.adapter_dir), "--repo-id", "me/x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ConnectError" in err and "retry `bdlora push" in err


def test_push_to_hub_from_the_recipe(tmp_path, fake_hub, monkeypatch, tiny_recipe):
    keys = dict(dataset="packaged:tiny_sums.jsonl", max_steps=1, push_to_hub=True, hub_model_id="me/from-recipe")
    result = train(tiny_recipe(tmp_path / "run", **keys))
    assert result.metrics["hub_url"].endswith("/commit/abc123")
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["hub_url"] == result.metrics["hub_url"]
    assert [repo for repo, _ in fake_hub["upload"]] == ["me/from-recipe"]
    assert "# me/from-recipe" in fake_hub["files"]["README.md"].decode()
    # without a token the run stops before training, not after an hour of it
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(HubError, match="no Hugging Face token"):
        train(tiny_recipe(tmp_path / "run2", **keys))
    assert not (tmp_path / "run2" / "adapter").exists()


def test_push_to_hub_from_a_grpo_recipe_says_how_it_was_trained(tmp_path, fake_hub):
    from bdlora_train.recipe.load import load_recipe

    tiny_grpo = str(Path(__file__).resolve().parents[1] / "recipes" / "tiny" / "grpo.yaml")
    recipe = load_recipe(tiny_grpo, [f"output_dir={tmp_path / 'run'}", "max_steps=2", "save_steps=0",
                                     "push_to_hub=true", "hub_model_id=me/grpo"])
    result = train(recipe)
    assert [repo for repo, _ in fake_hub["upload"]] == ["me/grpo"] and result.metrics["hub_url"].endswith("/abc123")
    card = fake_hub["files"]["README.md"].decode()
    objective = "- objective: GRPO (TRL's GRPOTrainer), 4 sampled completions per prompt, rewards: `exact_match`"
    assert f"{objective} (weight 1)\n" in card
    first, last = result.metrics["reward_first"], result.metrics["reward_last"]
    assert f"- mean reward of the sampled completions: {first:.4f} at the first step, {last:.4f} at the last" in card
    assert "final training loss" not in card  # GRPO's loss is not a measure of the adapter
    assert {"trl", "grpo", "bdlora"} <= set(_front_matter(card)["tags"])
    assert "adapter_model.safetensors" in fake_hub["files"]


def test_failed_upload_after_training_keeps_the_adapter_and_says_how_to_retry(
    tmp_path, fake_hub, monkeypatch, tiny_recipe
):
    def refuse(self, *args, **kwargs):
        raise PermissionError("403 Forbidden: you cannot write to me/taken")

    monkeypatch.setattr(HfApi, "create_commit", refuse)
    recipe = tiny_recipe(
        tmp_path / "run", dataset="packaged:tiny_sums.jsonl", max_steps=1, push_to_hub=True, hub_model_id="me/taken"
    )
    with pytest.raises(
        HubError, match=r"adapter is in .*403 Forbidden.*retry `bdlora push .*adapter --repo-id me/taken`"
    ):
        train(recipe)
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "run" / "metrics.json").is_file()


def _snippet(card: str) -> str:
    return card.split("```python\n", 1)[1].split("```", 1)[0]


def test_card_names_the_adapter_and_its_snippet_loads_the_trained_model_as_printed(trained, tmp_path, monkeypatch):
    import torch

    card = (trained.adapter_dir / "README.md").read_text()
    head = card.split("## Serving")[0]  # the serving section is check-serving's (tests/serving/test_serving.py)
    assert "ADAPTER" not in head and "\n# BD-LoRA adapter for tiny:llama\n" in card
    assert "[bdlora-train]" not in card  # the toolkit's name once linked to the paper
    assert "BD-LoRA (block-diagonal LoRA; Wang et al., [arXiv 2510.23346](https://arxiv.org/abs/2510.23346))" in card
    snippet = _snippet(card)
    assert f"PeftModel.from_pretrained(base, {str(trained.adapter_dir.resolve())!r})" in snippet
    assert "seed=7" in snippet  # tiny:llama's random weights follow the run's seed (7, see `trained`)
    monkeypatch.chdir(tmp_path)  # an absolute path: the snippet runs from any directory
    scope = {}
    exec(snippet, scope)
    ids = torch.tensor([[5, 17, 40, 3, 9]])
    with torch.no_grad():  # stock PEFT's BD-LoRA layer against the toolkit's fused one: the same function
        torch.testing.assert_close(scope["model"].eval()(ids).logits, trained.model.eval()(ids).logits)
    pushed = model_card(trained.adapter_dir, repo_id="me/tiny-bdlora")
    assert "\n# me/tiny-bdlora\n" in pushed and "PeftModel.from_pretrained(base, 'me/tiny-bdlora')" in _snippet(pushed)
    from huggingface_hub import ModelCard

    assert ModelCard(pushed).data.model_name == "me/tiny-bdlora"  # the model-index name, with eval results


def test_snippet_for_hub_and_local_bases(tmp_path):
    hub_lines = cards.load_snippet("meta-llama/Llama-3.1-8B", "me/x")
    assert 'base = AutoModelForCausalLM.from_pretrained("meta-llama/Llama-3.1-8B")'.replace('"', "'") in hub_lines
    local = tmp_path / "base"
    local.mkdir()
    assert f"base = AutoModelForCausalLM.from_pretrained({str(local)!r})" in cards.load_snippet(str(local), "a")
    embedded = cards.load_snippet("HuggingFaceTB/SmolLM2-135M-Instruct", "a")  # the embedded model's saved name
    assert "base, tokenizer = load_model('embedded')  # built by bdlora-train, no download" in embedded


def test_bdlora_push_records_itself_only_in_the_run_whose_push_to_that_repo_failed(tmp_path):
    from bdlora_train.train.push import record_in_run

    def run_dir(name: str, metrics: dict) -> Path:
        adapter = tmp_path / name / "adapter"
        adapter.mkdir(parents=True)
        (tmp_path / name / "metrics.json").write_text(json.dumps(metrics))
        return adapter

    failed = {"method": "bdlora", "pushed": False, "hub_repo_id": "me/a", "hub_url": None}
    url = "https://huggingface.co/me/a/commit/abc123"
    owed = run_dir("owed", failed)
    record_in_run(owed, "me/a", url)
    assert json.loads((owed.parent / "metrics.json").read_text()) == {**failed, "pushed": True, "hub_url": url}
    other_repo = run_dir("other", failed)
    record_in_run(other_repo, "me/b", url)  # a push to another repo settles nothing this run owes
    assert json.loads((other_repo.parent / "metrics.json").read_text()) == failed
    never = run_dir("never", {"method": "bdlora"})  # push_to_hub was off: nothing to record
    record_in_run(never, "me/a", url)
    assert json.loads((never.parent / "metrics.json").read_text()) == {"method": "bdlora"}
    loose = tmp_path / "loose"  # not a run's adapter/ dir: its parent's metrics.json is not the adapter's
    loose.mkdir()
    (tmp_path / "metrics.json").write_text(json.dumps(failed))
    record_in_run(loose, "me/a", url)
    assert json.loads((tmp_path / "metrics.json").read_text()) == failed
