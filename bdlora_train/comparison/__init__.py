"""Evaluation: the matched-budget LoRA vs BD-LoRA sweep (`bdlora compare`), its grid choice, report and plots.

  compare.py         the sweep: plan the runs, train and score each (per_run.py), resume, results.json
  planning.py        `Run` and `plan_runs`: the runs a sweep plans, in the order it trains them
  records.py         record.json per finished run, the shared settings a resumed --out must match
  per_run.py         one run: its recipe, the rows it trains on, its record
  grid.py            grid points, the per-method choice on the validation split
  summary.py         records -> rows (mean ± std over seeds), selection and cost: what report and plots show
  report.py          results.md
  plots.py           pareto.png, val_curves.png
  lm_eval_bridge.py  optional lm-evaluation-harness scores
Tasks themselves live in bdlora_train/tasks.
"""
