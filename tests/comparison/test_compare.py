"""The compare sweep: budget plan, end to end on the tiny model, resume, and the table/plot it writes."""

import json
import math
import re

import pytest

from bdlora_train.budget import budget_plan
from bdlora_train.commands.compare import main as compare_main
from bdlora_train.comparison import compare, planning, records, report
from bdlora_train.core.errors import CompareError
from bdlora_train.models import load_config, meta_model


def test_plan_on_smollm2_matches_hand_counts():
    """SmolLM2-135M: 30 layers; q/o 576->576, k/v 576->192, gate/up 576->1536, down 1536->576."""
    model = meta_model(load_config("embedded"))
    plan = budget_plan(model, [8, 16], 3, None)
    lora_per_rank = 30 * (1152 + 768 + 768 + 1152 + 2112 + 2112 + 2112)
    # BD-B (q,k,v,gate,up): d_in + d_out/3; BD-A (o, down): d_in/3 + d_out
    bd_per_rank = 30 * ((576 + 192) + (576 + 64) * 2 + (576 + 512) * 2 + (192 + 576) + (512 + 576))
    assert plan[0]["lora"]["params"] == 8 * lora_per_rank == 2_442_240
    assert plan[0]["matched"]["r"] == 12 and plan[0]["matched"]["params"] == 12 * bd_per_rank
    assert 15 * bd_per_rank > 8 * lora_per_rank  # 12 is the largest multiple of 3 at or below LoRA's budget
    assert plan[0]["double"]["r"] == 24 and plan[1]["matched"]["r"] == 24 and plan[1]["double"]["r"] == 48
    assert plan[0]["matched"]["ratio"] == pytest.approx(0.896, abs=1e-3)
    runs = planning.plan_runs(["analogies"], plan, [0, 1], with_base=True)
    shapes = [(r.method, r.r, r.seed) for r in runs]
    assert shapes[0] == ("base", 0, 0)
    # BD-LoRA r=24 serves two budgets and is trained once per seed: 5 distinct runs per seed.
    assert len(runs) == 1 + 2 * 5 and len(set(r.run_id for r in runs)) == len(runs)
    assert [s for s in shapes if s[2] == 0 and s[0] != "base"] == [
        ("lora", 8, 0),
        ("bdlora", 12, 0),
        ("bdlora", 24, 0),
        ("lora", 16, 0),
        ("bdlora", 48, 0),
    ]


def _fake_results():
    plan = [
        {
            "lora_rank": 8,
            "lora": {"method": "lora", "r": 8, "nblocks": 1, "params": 1000, "ratio": 1.0},
            "matched": {"method": "bdlora", "r": 12, "nblocks": 3, "params": 900, "ratio": 0.9},
            "double": {"method": "bdlora", "r": 24, "nblocks": 3, "params": 1800, "ratio": 1.8},
        }
    ]
    scores = {("lora", 8): [80.0, 82.0], ("bdlora", 12): [79.0, 83.0], ("bdlora", 24): [85.0, 84.0]}
    runs = [
        {
            "task": "analogies",
            "method": "base",
            "r": 0,
            "seed": 0,
            "metrics": {"accuracy": 11.0, "accuracy/family": 1.0},
        }
    ]
    for (method, r), values in scores.items():
        for seed, v in enumerate(values):
            runs.append(
                {
                    "task": "analogies",
                    "method": method,
                    "r": r,
                    "seed": seed,
                    "trainable_params": r * 100,
                    "train_wall_time_s": 100.0 + seed,
                    "tokens_per_second": 200.0,
                    "peak_memory_mb": 1500.0,
                    "adapter_file_size_bytes": 2**20,
                    "eval_time_s": 10.0,
                    "metrics": {"accuracy": v, "accuracy/family": v - 10},
                }
            )
    meta = {
        "model": "embedded",
        "tasks": ["analogies"],
        "plan": plan,
        "nblocks": 3,
        "seeds": [0, 1],
        "primary_metric": {"analogies": "accuracy"},
        "higher_is_better": {"analogies": True},
        "command": "bdlora compare ...",
        "recipe": {
            "max_steps": 80,
            "per_device_train_batch_size": 16,
            "learning_rate": 1e-3,
            "lora_alpha_ratio": 2.0,
            "use_rslora": False,
        },
    }
    return {"meta": meta, "runs": runs}


def test_table_means_stds_and_paired_deltas():
    text = report.markdown(_fake_results())
    rows = {
        cells[1]: cells
        for cells in (
            [c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| 8 |")
        )
    }
    assert rows["LoRA"][6] == "81.00 ± 1.41 (2)"
    assert rows["BD-LoRA matched"][6] == "81.00 ± 2.83 (2)"
    assert rows["LoRA"][7] == "n/a"  # binomial SE: these fake records carry no item count "n"
    assert rows["BD-LoRA matched"][8] == "+0.00 ± 1.41"  # per-seed deltas -1, +1
    assert rows["BD-LoRA double"][8] == "+3.50 ± 2.12"  # per-seed deltas +5, +2
    assert rows["BD-LoRA double"][5] == "1.80"
    assert "Base model without adapter: 11.00" in text
    assert re.search(r"\| family \| 1\.0 \| 71\.0 \| 71\.0 \| 74\.5 \|", text)  # base, then by trainable params


def test_the_plot_shows_each_methods_seed_means_and_report_only_rebuilds_from_the_written_json(tmp_path, capsys):
    """pareto.png draws a point per budget at its planned params and its mean over seeds (error bar: the std), the
    base model as a line; `bdlora compare --report-only` reads results.json back into the same table and plot."""
    import matplotlib.image
    import matplotlib.pyplot as plt
    import numpy as np

    from bdlora_train.comparison import plots

    fig = plots.pareto_figure(_fake_results())
    try:
        ax = fig.axes[0]
        drawn = {}
        for container in ax.containers:  # one errorbar per method: (data line, caps, bars)
            line, _, (bars,) = container.lines
            label = container.get_label().split(":")[0]
            spans = [top[1] - bottom[1] for bottom, top in bars.get_segments()]
            drawn[label] = [(x, y) for x, y in line.get_xydata()], spans
        # LoRA r=8: seeds 80, 82; BD-LoRA r=12 (900 params): 79, 83; r=24 (1800 params): 85, 84
        assert drawn["LoRA"][0] == [(1000, 81.0)]
        assert drawn["BD-LoRA nblocks 3"][0] == [(900, 81.0), (1800, 84.5)]  # ordered by params
        assert drawn["LoRA"][1] == pytest.approx([2 * math.sqrt(2)])  # the bar spans ± the sample std
        assert drawn["BD-LoRA nblocks 3"][1] == pytest.approx([4 * math.sqrt(2), math.sqrt(2)])
        assert [tuple(line.get_ydata()) for line in ax.lines if line.get_label() == "base model"] == [(11.0, 11.0)]
    finally:
        plt.close(fig)

    report.write_all(_fake_results(), tmp_path)
    assert not list(tmp_path.glob(".tmp-*"))
    image = matplotlib.image.imread(tmp_path / "pareto.png")[..., :3]

    def pixels(color):  # how many pixels of the image have this color
        return int((np.abs(image - np.array(matplotlib.colors.to_rgb(color))).max(axis=-1) < 0.02).sum())

    assert pixels("tab:blue") > 50 and pixels("tab:orange") > 50  # both methods' markers and lines are in the PNG
    written = (tmp_path / "results.md").read_text()
    for name in ("results.md", "pareto.png"):
        (tmp_path / name).unlink()
    assert compare_main(["--report-only", "--out", str(tmp_path)]) == 0
    rebuilt = (tmp_path / "results.md").read_text()
    assert "| 8 | LoRA | 8 | 1 | 1,000 | 1.00 | 81.00 ± 1.41 (2) |" in rebuilt  # from the records, not a copy
    assert rebuilt == written and capsys.readouterr().out.strip() == written.strip()  # and printed on stdout
    image = matplotlib.image.imread(tmp_path / "pareto.png")[..., :3]
    assert pixels("tab:blue") > 50 and pixels("tab:orange") > 50


@pytest.fixture
def tiny_task(tmp_path):
    rows = [{"prompt": f"{i} + 1 =", "completion": f" {i + 1}"} for i in range(40)]
    (tmp_path / "sums.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "sums.yaml").write_text("name: sums\ndata_files: sums.jsonl\nmatch: first_word\nmax_new_tokens: 3\n")
    return str(tmp_path / "sums.yaml")


def test_compare_end_to_end_on_tiny_model_and_resume(tmp_path, tiny_task, monkeypatch, capsys):
    out = tmp_path / "cmp"
    argv = [
        "--model",
        "tiny:llama",
        "--recipe",
        "recipes/tiny/lora.yaml",
        "--task",
        tiny_task,
        "--lora-ranks",
        "4",
        "--seeds",
        "1",
        "--steps",
        "3",
        "--out",
        str(out),
        "--quiet",
    ]
    assert compare_main(argv) == 0
    printed = capsys.readouterr()
    # --quiet: not one progress bar (datasets', the Trainer's, the sweep's) and no Trainer log dict anywhere
    assert not re.search(r"it/s|examples/s|\d+%\|", printed.err) and "{'" not in printed.out + printed.err
    assert "3 runs planned and the base model's score" in printed.err  # the count results.md gives
    results = json.loads((out / "results.json").read_text())
    runs = {r["run_id"]: r for r in results["runs"]}
    assert set(runs) == {"sums-base", "sums-lora-r4-s0", "sums-bdlora-r4-nb2-s0", "sums-bdlora-r8-nb2-s0"}
    plan = results["meta"]["plan"][0]
    for budget in ("lora", "matched", "double"):
        spec = plan[budget]
        rec = next(r for r in runs.values() if r["method"] == spec["method"] and r["r"] == spec["r"])
        assert rec["trainable_params"] == spec["params"]  # what PEFT built equals the planned budget
        assert rec["steps"] == 3 and rec["adapter_file_size_bytes"] > 0 and 0 <= rec["metrics"]["accuracy"] <= 100
        assert rec["train_wall_time_s"] > 0 and rec["peak_memory_mb"] > 0
        # the recipe names no bd_lr_ratio: BD-LoRA trains at the default auto (= nblocks 2), LoRA at one rate
        assert rec["bd_lr_ratio"] == (None if spec["method"] == "lora" else 2.0), rec["run_id"]
    assert plan["matched"]["params"] <= plan["lora"]["params"] < plan["double"]["params"]
    table = (out / "results.md").read_text()
    assert "bd_lr_ratio auto = nblocks (BD), loraplus_lr_ratio 1.0 (LoRA)" in table
    assert sum(line.startswith("| 4 | ") for line in table.splitlines()) == 3 and "not run yet" not in table
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert printed.out.startswith("# LoRA vs BD-LoRA") and "| 4 | BD-LoRA matched |" in printed.out  # table only
    assert "Cost: 3 trained runs of 3 planned; summed over runs " in table
    assert re.search(r"summed over runs \d+\.\d s training and \d+\.\d (s|min) evaluation", table)  # never "0.0 min"

    # Re-running resumes: nothing is trained again.
    import bdlora_train.train as train_mod

    def no_training(*a, **k):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(train_mod, "train", no_training)
    assert compare_main(argv) == 0
    # Records written before the shared fingerprint dropped the per-run lora_alpha (derived from lora_alpha_ratio)
    # kept it there: they still resume.
    for path in (out / "runs").glob("*/record.json"):
        record = json.loads(path.read_text())
        record["fingerprint"]["recipe"]["lora_alpha"] = 16
        path.write_text(json.dumps(record))
    assert compare_main(argv) == 0
    # Other shared settings in the same --out are refused rather than mixed into one table, naming a trained run:
    # the base model's score does not depend on the steps and is reused as it is.
    with pytest.raises(CompareError, match=r"sums-bdlora-r4-nb2-s0 was made with other settings .*max_steps: 3 then"):
        compare_main([a if a != "3" else "4" for a in argv])
    assert records.base_fingerprint(runs["sums-base"]["fingerprint"]) == records.base_fingerprint(
        {**runs["sums-base"]["fingerprint"], "recipe": {**results["meta"]["recipe"], "max_steps": 4}}
    )


def test_cli_errors_are_one_line(tmp_path, capsys):
    from bdlora_train.cli import main

    assert main(["compare", "--model", "tiny:llama", "--task", "analogy", "--out", str(tmp_path), "--dry-run"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("bdlora compare: error: task analogy: unknown") and "\n" not in err
    assert main(["compare", "--model", "some-model-dir", "--out", str(tmp_path), "--dry-run"]) == 1
    assert "--model some-model-dir: no such file or directory" in capsys.readouterr().err
    assert main(["compare", "--out", str(tmp_path / "none"), "--report-only"]) == 1
    assert "run the sweep first" in capsys.readouterr().err
    fresh = tmp_path / "fresh" / "cmp"
    assert main(["compare", "--model", "tiny:llama", "--task", "analogy", "--out", str(fresh)]) == 1
    assert not (tmp_path / "fresh").exists()  # a refused sweep leaves no empty --out/runs behind
    assert main(["compare", "--model", "tiny:llama", "--lora-ranks", "4", "--out", str(fresh), "--dry-run"]) == 0
    assert not (tmp_path / "fresh").exists()  # nor does a dry run


def test_lm_eval_missing_is_a_clear_error(tmp_path, capsys):
    import importlib.util

    if importlib.util.find_spec("lm_eval") is not None:
        pytest.skip("lm_eval is installed; this checks the message shown without it")
    from bdlora_train.cli import main

    assert main(["compare", "--model", "tiny:llama", "--lm-eval-tasks", "hellaswag", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert "lm-evaluation-harness" in err and "pip install" in err and "\n" not in err


@pytest.mark.slow  # importing lm_eval alone takes ~30 s here
def test_lm_eval_bridge_scores_a_local_task(tmp_path):
    """lm-eval's loglikelihood perplexity on a local task equals exp(-mean log p(completion | prompt)) by hand."""
    pytest.importorskip("lm_eval", reason="lm-eval is an optional extra (pip install 'bdlora-train[lm-eval]')")
    import torch

    from bdlora_train.comparison import lm_eval_bridge
    from bdlora_train.models import build_tiny_model, tiny_tokenizer

    rows = [{"prompt": f"{i} + 1 =", "completion": f" {i + 1}"} for i in range(4)]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "bdlora_sums.yaml").write_text(
        "task: bdlora_sums\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'data.jsonl'}\ntest_split: test\noutput_type: loglikelihood\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{completion}}"\nmetric_list:\n  - metric: perplexity\n'
    )
    model, tok = build_tiny_model("llama"), tiny_tokenizer()
    scores = lm_eval_bridge.evaluate(model, tok, ["bdlora_sums"], model_spec="tiny:llama", include_path=str(tmp_path))
    lls = []
    for r in rows:  # character tokenizer: prompt and completion tokens split exactly at the boundary
        ctx, cont = tok(r["prompt"])["input_ids"], tok(r["completion"])["input_ids"]
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logp = model(ids).logits[0, :-1].log_softmax(-1)
        lls.append(sum(logp[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont)))
    assert scores["lm_eval/bdlora_sums/perplexity"] == pytest.approx(math.exp(-sum(lls) / len(lls)), rel=1e-3)
    with pytest.raises(lm_eval_bridge.LmEvalError, match="does not know task"):
        lm_eval_bridge.evaluate(model, tok, ["no_such_task_xyz"], model_spec="tiny:llama", include_path=str(tmp_path))


# ---------------------------------------------------------------------------------------------- grid selection

# A task whose validation and test disagree on the best learning rate, by construction and on a real trained model:
# validation rewards a large adapter update (the L1 norm of every lora_B grows with the learning rate under Adam),
# test rewards a small one. Selection on validation must pick the largest learning rate; a selection that read
# the test split would pick the smallest.
_DISAGREE_TASK = """
from bdlora_train.tasks import GenerationTask

class Disagree(GenerationTask):
    def evaluate(self, model, tokenizer, batch_size=32, limit=None, progress=False, split="test"):
        self._held_out(split)
        norm = sum(p.detach().abs().sum().item() for n, p in model.named_parameters() if "lora_B" in n)
        return {"accuracy": norm if split == "validation" else -norm}

rows = [{"prompt": f"{i} + 1 =", "completion": f" {i + 1}"} for i in range(32)]
TASK = Disagree("disagree", rows[:24], rows[24:28], validation_rows=rows[28:])
"""


def test_grid_selection_uses_validation_only_and_reports_the_chosen_test_score(tmp_path, monkeypatch):
    (tmp_path / "disagree.py").write_text(_DISAGREE_TASK)
    out = tmp_path / "grid"
    argv = [
        "--model", "tiny:llama", "--recipe", "recipes/tiny/lora.yaml", "--task", str(tmp_path / "disagree.py"),
        "--lora-ranks", "4", "--seeds", "2", "--grid-seeds", "1", "--steps", "2", "--no-base",
        "--lr-grid", "1e-4", "1e-2", "--methods", "lora", "peft-bdlora=matched", "--out", str(out), "--quiet",
    ]  # fmt: skip
    assert compare_main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["grid"] == [["learning_rate", [1e-4, 1e-2]]] and results["meta"]["grid_seeds"] == [0]
    ids = sorted(r["run_id"] for r in results["runs"])
    # seed 0: 2 learning rates x (LoRA r4, PEFT BD-LoRA r4; peft-bdlora=matched skips r8); seed 1: the choice only
    assert ids == sorted(
        [f"disagree-lora-r4-s0-learning_rate={lr}" for lr in ("0.0001", "0.01")]
        + [f"disagree-peft-bdlora-r4-nb2-s0-learning_rate={lr}" for lr in ("0.0001", "0.01")]
        + ["disagree-lora-r4-s1-learning_rate=0.01", "disagree-peft-bdlora-r4-nb2-s1-learning_rate=0.01"]
    )
    assert results["meta"]["planned_runs"] == 6
    sel = report.selection(results)
    assert sorted(sel) == [("disagree", "lora", 4), ("disagree", "peft-bdlora", 4)]
    for (task, method, r), chosen in sel.items():
        assert chosen["choice"]["setting"] == {"learning_rate": 1e-2}, (method, r)
        assert not chosen["choice"]["provisional"] and chosen["choice"]["n"] == 1  # chosen on seed 0 only
        seed0 = {rec["setting"]["learning_rate"]: rec for rec in results["runs"]
                 if rec["method"] == method and rec["seed"] == 0}  # fmt: skip
        assert seed0[1e-2]["metrics"]["accuracy"] < seed0[1e-4]["metrics"]["accuracy"]  # test prefers 1e-4: a leak
        assert sorted(chosen["records"]) == [0, 1]  # would have chosen it; the report shows both seeds of 1e-2
    rows = {(row["method"], row["r"]): row for row in report.summarize(results)}
    assert rows[("lora", 4)]["chosen"] == "learning_rate=0.01" and rows[("lora", 4)]["n"] == 2
    high = [rec["metrics"]["accuracy"] for rec in results["runs"] if rec["method"] == "lora"
            and rec["setting"]["learning_rate"] == 1e-2]  # fmt: skip
    assert rows[("lora", 4)]["mean"] == pytest.approx(sum(high) / 2)
    table = (out / "results.md").read_text()
    assert "chosen on validation" in table and "| 4 | PEFT BD-LoRA matched | 4 |" in table
    assert "PEFT BD-LoRA double" not in table and "Cost: 6 trained runs of 6 planned" in table
    assert "Validation accuracy per grid setting" in table and "over seeds [0]" in table
    assert (out / "val_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Re-running resumes: nothing is trained again, the seed-1 runs included.
    import bdlora_train.train as train_mod

    def no_training(*a, **k):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(train_mod, "train", no_training)
    assert compare_main(argv) == 0


def test_grid_choice_is_on_the_seed_mean_with_ties_to_the_earlier_point():
    from bdlora_train.comparison import grid

    stats = [
        {"label": "a", "mean": 70.0, "n": 3},
        {"label": "b", "mean": 72.0, "n": 3},
        {"label": "c", "mean": 72.0, "n": 3},
    ]
    assert grid.choose(stats, 3, higher_is_better=True)["label"] == "b"
    assert grid.choose(stats, 3, higher_is_better=False)["label"] == "a"
    assert not grid.choose(stats, 3, True)["provisional"]
    partial = [{"label": "a", "mean": 1.0, "n": 2}, {"label": "b", "mean": 9.0, "n": 1}]
    pick = grid.choose(partial, 3, higher_is_better=True)  # only points with the most seeds compete
    assert pick["label"] == "a" and pick["provisional"]
    assert grid.choose([{"label": "a", "mean": float("nan"), "n": 0}], 3, True) is None


def test_selection_ignores_test_scores_in_fake_records():
    """Validation prefers lr 1e-3 for every config, test prefers 3e-3; the table must show the 1e-3 test score."""
    results = _fake_results()
    runs = []
    for rec in results["runs"]:
        if rec["method"] == "base":
            runs.append(rec)
            continue
        for lr, val_bonus, test_bonus in ((1e-3, 5.0, 0.0), (3e-3, 0.0, 9.0)):
            new = json.loads(json.dumps(rec))
            new["setting"] = {"learning_rate": lr}
            new["val_metrics"] = {"accuracy": rec["metrics"]["accuracy"] + val_bonus}
            new["metrics"]["accuracy"] += test_bonus
            runs.append(new)
    results["runs"] = runs
    results["meta"].update(grid=[["learning_rate", [1e-3, 3e-3]]], grid_points=[{"learning_rate": 1e-3},
                           {"learning_rate": 3e-3}])  # fmt: skip
    rows = {(r["method"], r["r"]): r for r in report.summarize(results)}
    assert rows[("lora", 8)]["chosen"] == "learning_rate=0.001" and rows[("lora", 8)]["mean"] == 81.0
    assert rows[("bdlora", 12)]["mean"] == 81.0 and rows[("bdlora", 12)]["delta"] == 0.0
    text = report.markdown(results)
    assert "**86.00 ± 1.41**" in text  # LoRA's validation mean at the chosen point, bold in the curve table


def test_grid_and_methods_errors_are_one_line(tmp_path, capsys):
    from bdlora_train.cli import main

    base = ["compare", "--model", "tiny:llama", "--out", str(tmp_path), "--dry-run"]
    for extra, message in (
        (["--grid", "lora_r=4,8"], "--grid lora_r: the sweep sets it per run"),
        (["--grid", "learning_rat=1"], "--grid learning_rat: not a recipe key"),
        (["--grid", "learning_rate"], "is not KEY=v1,v2"),
        (["--lr-grid", "1e-3", "--grid", "learning_rate=1"], "given twice"),
        (["--lr-grid", "fast"], "learning_rate='fast' is not a number"),
        (["--grid", "bd_lr_ratio=0"], "bd_lr_ratio=0.0 must be > 0"),
        (["--methods", "lora", "dora"], "--methods dora: unknown"),
        (["--methods", "lora", "bdlora=triple"], "takes budgets from matched double"),
        (["--seeds", "2", "--grid-seeds", "3", "--lr-grid", "1e-3"], "--grid-seeds 3; use 1..2"),
        (["--task", str(tmp_path / "t.py"), "--lr-grid", "1e-3"], "has no validation split"),
    ):
        (tmp_path / "t.py").write_text(
            "from bdlora_train.tasks import GenerationTask\n"
            "rows = [{'prompt': 'a', 'completion': ' b'}]\nTASK = GenerationTask('t', rows, rows)\n"
        )
        assert main(base + extra) == 1, extra
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, (extra, err)


def _spy_tokenize(monkeypatch):
    """Record the rows train() tokenizes for training (eval rows are tokenized with spec "eval data")."""
    import bdlora_train.objectives.supervised as tok  # the objective tokenizes with the `tokenize` it imported

    seen, real = [], tok.tokenize

    def spy(dataset, tokenizer, max_seq_length, spec="dataset", *a, **k):
        if spec != "eval data":
            seen.append(list(dataset["prompt"]))
        return real(dataset, tokenizer, max_seq_length, spec, *a, **k)

    monkeypatch.setattr(tok, "tokenize", spy)
    return seen


def test_each_run_tokenizes_only_the_rows_it_trains_on_the_same_for_every_method(tmp_path, tiny_task, monkeypatch):
    from bdlora_train.tasks.registry import get_task

    seen = _spy_tokenize(monkeypatch)
    common = ["--model", "tiny:llama", "--recipe", "recipes/tiny/lora.yaml", "--task", tiny_task, "--lora-ranks", "4",
              "--no-base", "--quiet"]  # fmt: skip
    # 2 steps x batch 2 x accumulation 3 = 12 rows of the task's 32 training rows, per run.
    argv = common + ["--seeds", "2", "--steps", "2", "--methods", "lora", "bdlora=matched", "--out",
                     str(tmp_path / "a"), "--set", "per_device_train_batch_size=2",
                     "gradient_accumulation_steps=3"]  # fmt: skip
    assert compare_main(argv) == 0
    assert [len(rows) for rows in seen] == [12, 12, 12, 12]  # seed 0: LoRA, BD-LoRA; seed 1: LoRA, BD-LoRA
    assert seen[0] == seen[1] and seen[2] == seen[3]  # the same rows, in the same order, for every method
    assert seen[0] != seen[2]  # another seed, other rows
    task = get_task(tiny_task)
    assert seen[0] == list(task.train_dataset(seed=0)["prompt"][:12])  # the first rows of the seed's order
    runs = json.loads((tmp_path / "a" / "results.json").read_text())["runs"]
    assert {(r["steps"], r["train_rows"]) for r in runs} == {(2, 12)}

    # Training by epochs reads every training row; more steps than rows caps at the dataset.
    seen.clear()
    argv = common + ["--seeds", "1", "--methods", "lora", "--out", str(tmp_path / "b"),
                     "--set", "max_steps=-1", "num_train_epochs=1", "per_device_train_batch_size=8"]  # fmt: skip
    assert compare_main(argv) == 0
    n_train = task.split_sizes()["train"]
    assert [len(rows) for rows in seen] == [n_train] and n_train == 32


def test_finished_runs_keep_no_checkpoints_and_json_prints_only_json(tmp_path, tiny_task):
    from bdlora_train.cli import main

    out = tmp_path / "cmp"
    argv = ["compare", "--model", "tiny:llama", "--recipe", "recipes/tiny/lora.yaml", "--task", tiny_task,
            "--lora-ranks", "4", "--seeds", "1", "--steps", "2", "--methods", "lora", "--no-base",
            "--set", "save_steps=1", "logging_steps=1", "--out", str(out), "--json"]  # fmt: skip
    import contextlib
    import io

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        assert main(argv) == 0
    printed = json.loads(stdout.getvalue())  # pure JSON: the Trainer's log dicts went to stderr
    assert printed == json.loads((out / "results.json").read_text())
    assert [r["run_id"] for r in printed["runs"]] == ["sums-lora-r4-s0"]
    assert "'loss'" in stderr.getvalue() and "wrote" in stderr.getvalue()
    run_dir = out / "runs" / "sums-lora-r4-s0"
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file() and (run_dir / "record.json").is_file()
    # save_steps=1 wrote checkpoint-1 and checkpoint-2 during the run; the recorded run is never resumed from them.
    assert not list(out.rglob("checkpoint-*")) and not list(out.rglob(".tmp-*"))

    # --dry-run --json: the plan, nothing trained.
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        assert main(argv[:-1] + ["--dry-run", "--json", "--out", str(tmp_path / "dry")]) == 0
    plan = json.loads(stdout.getvalue())
    assert plan["runs"] == [] and plan["meta"]["plan"][0]["lora"]["r"] == 4


def test_results_md_shows_the_binomial_standard_error_of_an_accuracy():
    results = _fake_results()
    for rec in results["runs"]:
        rec["metrics"]["n"] = 100.0
        if rec["method"] == "lora":
            rec["metrics"]["accuracy"] = 75.0  # p = 0.75 on 100 items: sqrt(0.75 * 0.25 / 100) = 4.33 points
    text = report.markdown(results)
    header = next(line for line in text.splitlines() if line.startswith("| budget"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    rows = {
        cells[1]: cells
        for cells in ([c.strip() for c in line.strip("|").split("|")] for line in text.splitlines())
        if cells[0] == "8"
    }
    se = cols.index("binomial SE (test items)")
    assert cols[se - 1].startswith("accuracy mean ± std") and rows["LoRA"][se - 1] == "75.00 ± 0.00 (2)"
    assert rows["LoRA"][se] == "4.33 (100)"
    assert rows["BD-LoRA double"][se] == f"{100 * math.sqrt(0.845 * 0.155 / 100):.2f} (100)"  # mean 84.5
    assert "sqrt(p(1−p)/n)" in text


def test_verdict_lines_hold_each_budget_to_its_bar_against_lora_and_the_base():
    results = _fake_results()  # LoRA 80, 82; BD matched 79, 83; BD double 85, 84; base 11
    for rec in results["runs"]:
        rec["metrics"]["n"] = 100.0
    text = report.markdown(results)
    lines = {line.split(":")[0]: line for line in text.splitlines() if line.startswith("- ")}
    # LoRA: mean 81, SE over 2 seeds = std 1.414 / sqrt 2 = 1.00; 70 points over the base = 70 / 3.92 binomial SE
    assert lines["- LoRA r=8 (1.00x)"] == (
        f"- LoRA r=8 (1.00x): 81.00 ± 1.00; +70.00 over the base = {70 / (100 * math.sqrt(0.81 * 0.19 / 100)):.1f} "
        "binomial SE (learns)"
    )
    # matched: 81 = LoRA's 81 -> holds; its own SE is 2.83 / sqrt 2 = 2.00
    assert lines["- BD-LoRA matched r=12 (0.90x)"].endswith("+0.00 vs LoRA: holds (bar: LoRA − 1 SE)")
    assert ": 81.00 ± 2.00;" in lines["- BD-LoRA matched r=12 (0.90x)"]
    assert lines["- BD-LoRA double r=24 (1.80x)"].endswith("+3.50 vs LoRA: holds (bar: LoRA)")
    # below the bar: matched 1.5 under LoRA (more than LoRA's SE of 1.00); double 0.5 under LoRA
    for rec in results["runs"]:
        if rec["method"] == "bdlora":
            rec["metrics"]["accuracy"] = {12: 79.5, 24: 80.5}[rec["r"]]
    lines = {line.split(":")[0]: line for line in report.markdown(results).splitlines() if line.startswith("- ")}
    assert lines["- BD-LoRA matched r=12 (0.90x)"].endswith("-1.50 vs LoRA: below (bar: LoRA − 1 SE)")
    assert lines["- BD-LoRA double r=24 (1.80x)"].endswith("-0.50 vs LoRA: below (bar: LoRA)")
    # a score within 2 binomial SE of the base does not count as learning
    for rec in results["runs"]:
        if rec["method"] == "lora":
            rec["metrics"]["accuracy"] = 16.0
    lines = {line.split(":")[0]: line for line in report.markdown(results).splitlines() if line.startswith("- ")}
    assert "+5.00 over the base = 1.4 binomial SE (not 2 SE above the base)" in lines["- LoRA r=8 (1.00x)"]


def test_the_header_says_how_alpha_was_set():
    results = _fake_results()  # alpha = 2r
    assert ", alpha ratio 2.0, rsLoRA" in report.markdown(results)
    results["meta"]["recipe"].update(lora_alpha_ratio=None, lora_alpha=16.0)  # one alpha for every rank (GRPO)
    assert ", lora_alpha 16.0 (fixed), rsLoRA" in report.markdown(results)


def _crowded_results():
    """SmolLM2's real budgets for LoRA 8/16, three methods, every score within half a point, base far below."""
    plan = []
    for lora_r, lora_p, (m_r, m_p), (d_r, d_p) in (
        (8, 2_442_240, (12, 2_188_800), (24, 4_377_600)),
        (16, 4_884_480, (24, 4_377_600), (48, 8_755_200)),
    ):
        plan.append({
            "lora_rank": lora_r,
            "lora": {"method": "lora", "r": lora_r, "nblocks": 1, "params": lora_p, "ratio": 1.0},
            "matched": {"method": "bdlora", "r": m_r, "nblocks": 3, "params": m_p, "ratio": m_p / lora_p},
            "double": {"method": "bdlora", "r": d_r, "nblocks": 3, "params": d_p, "ratio": d_p / lora_p},
        })  # fmt: skip
    runs = [{"task": "analogies", "method": "base", "r": 0, "seed": 0, "metrics": {"accuracy": 15.0}}]
    for i, (method, r) in enumerate(
        [("lora", 8), ("lora", 16)] + [(m, r) for m in ("bdlora", "peft-bdlora") for r in (12, 24, 48)]
    ):
        runs.append({"task": "analogies", "method": method, "r": r, "seed": 0,
                     "metrics": {"accuracy": 80.0 + 0.05 * i}})  # fmt: skip
    meta = {**_fake_results()["meta"], "plan": plan, "seeds": [0], "methods": ["lora", "bdlora", "peft-bdlora"]}
    meta.update(model="embedded", model_name="HuggingFaceTB/SmolLM2-135M-Instruct")
    return {"meta": meta, "runs": runs}


def test_pareto_labels_never_overlap_and_the_title_names_the_model():
    import matplotlib.pyplot as plt

    from bdlora_train.comparison import plots

    fig = plots.pareto_figure(_crowded_results())
    try:
        assert "SmolLM2-135M-Instruct" in fig._suptitle.get_text() and "embedded" in fig._suptitle.get_text()
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        ax = fig.axes[0]
        labels = [t for t in ax.texts if t.get_text().startswith("r=")]
        ticks = [t for t in ax.get_xticklabels() + ax.get_yticklabels() if t.get_visible() and t.get_text()]
        boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in labels + ticks]
        for i, (a, box_a) in enumerate(boxes):
            for b, box_b in boxes[i + 1 :]:
                assert not box_a.overlaps(box_b), (a, b)
        assert fig.bbox.contains(*fig._suptitle.get_window_extent(renderer).min)
        assert fig.bbox.contains(*fig._suptitle.get_window_extent(renderer).max)  # the title is not cut off
        frame = ax.get_window_extent(renderer)
        assert all(frame.contains(*box.min) and frame.contains(*box.max) for _, box in boxes[: len(labels)])
        assert len(labels) >= 5  # most points keep their label (9 points: 2 LoRA, 3 + 3 BD, one r shared)
        xticks = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
        assert "2.44M" in xticks and "4.88M" in xticks  # LoRA's budgets keep their tick labels
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "BD-LoRA nblocks 3: r=12, 24, 48" in legend  # every rank is named even when a label has no room
    finally:
        plt.close(fig)


def test_runs_recorded_before_the_row_selection_are_refused(tmp_path):
    """An older record let the Trainer sample from every training row: its data differs, so it is never mixed in."""
    run_dir = tmp_path / "runs" / "sums-lora-r4-s0"
    run_dir.mkdir(parents=True)
    fingerprint = {"model": "tiny:llama", "splits": {"sums": {"train": 32}}}
    (run_dir / "record.json").write_text(json.dumps({"run_id": "sums-lora-r4-s0", "fingerprint": fingerprint}))
    with pytest.raises(CompareError, match="trained on only the rows it reads"):
        records.load_records(tmp_path, {**fingerprint, "train_data": compare.TRAIN_DATA_RULE})
    fingerprint["train_data"] = compare.TRAIN_DATA_RULE
    (run_dir / "record.json").write_text(json.dumps({"run_id": "sums-lora-r4-s0", "fingerprint": fingerprint}))
    assert list(records.load_records(tmp_path, fingerprint)) == ["sums-lora-r4-s0"]


def test_per_category_columns_follow_the_main_table_and_costs_read_in_seconds():
    results = _fake_results()
    for run in results["runs"]:  # real budgets: matched BD-LoRA has fewer parameters than LoRA
        run["trainable_params"] = {8: 1000, 12: 900, 24: 1800}.get(run["r"], 0)
        run["train_wall_time_s"] = 1.5 if run["method"] != "base" else None
        run["eval_time_s"] = 2.0
    results["meta"]["sweep_wall_time_s"] = 42.0
    text = report.markdown(results)
    main_order = [line.split("|")[2].strip() for line in text.splitlines() if line.startswith("| 8 |")]
    assert main_order == ["LoRA", "BD-LoRA matched", "BD-LoRA double"]
    assert "| category | base | LoRA r=8 | BD-LoRA r=12 | BD-LoRA r=24 |" in text  # not sorted by parameters
    assert "Sweep wall time (this invocation): 42.0 s." in text
    assert "summed over runs 9.0 s training and 14.0 s evaluation" in text
    assert report.duration(59.9) == "59.9 s" and report.duration(90) == "1.5 min" and report.duration(7200) == "2.0 h"


def test_all_equal_accuracies_plot_no_negative_ticks_and_empty_curves_warn_nothing(tmp_path):
    import warnings

    from bdlora_train.comparison import plots

    results = _fake_results()
    for run in results["runs"]:
        run["metrics"] = {"accuracy": 0.0}  # a tiny random model after 5 steps: 0.00 everywhere
    fig = plots.pareto_figure(results)
    low, high = fig.axes[0].get_ylim()
    assert low >= 0 and high - low >= 2.0 and min(fig.axes[0].get_yticks()[(fig.axes[0].get_yticks() >= low)]) >= 0
    results["meta"].update(grid=[["learning_rate", [1e-3, 3e-3]]], grid_points=[{"learning_rate": 1e-3}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels found to put in legend"
        plots.val_curves(results, tmp_path / "val_curves.png")  # no run has validation scores yet
    assert (tmp_path / "val_curves.png").is_file()
