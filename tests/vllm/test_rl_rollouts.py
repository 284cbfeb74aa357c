"""GRPO whose rollouts run in `vllm serve` at TP 3 with the plugin, the adapter synced as an adapter every step
(objectives/grpo.py, rl/rollouts.py, docs/rl.md), on the embedded SmolLM2-135M in float32:

1. with no server, the run refuses in one line that holds the server command and leaves no version directory; that
   command, run as printed from an environment with no VLLM_* variable, starts the server;
2. three GRPO steps against it: every sync moves only the adapter's files (its tensors and config, not the base's
   weights), every step's largest |server - trainer| log-prob is at most TOL, and each version is loaded rank-local;
   then two steps with the trainer at TP 3 too (torchrun): each version gathered from the ranks' blocks and synced
   once, every rank's gap at most TOL;
3. a sync gone wrong on purpose (the server given another adapter than the trainer's) is refused, not trained on;
4. the server killed mid-run, in a run shorter than its save_steps, stops the run in one line with a checkpoint of its
   last completed step; the same command, after the server is back, resumes from it and syncs again;
5. the final adapter loads in stock PEFT, and the server serves it with HF+PEFT's greedy tokens and log-probs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
from vllm_helpers import ENGINE_ENV, MAX_TOKENS, MEASURED, REPO, TOL, max_diff

from bdlora_train.rl.logprob_gap import gap_rule
from bdlora_train.serving.engines import numa_nodes
from tools.vllm_harness import fixtures as fx
from tools.vllm_harness.server import free_port, models

RECIPE = REPO / "recipes" / "smollm2-135m" / "analogies" / "grpo.yaml"
STEPS = ["per_device_train_batch_size=8", "num_generations=4", "max_completion_length=4", "logging_steps=1",
         "save_steps=1", "save_total_limit=10"]


def _env() -> dict:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, **ENGINE_ENV, "PATH": path}


def _train(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bdlora_train.cli", "train", str(RECIPE), *args], env=_env(),
                          capture_output=True, text=True, timeout=1800, cwd=REPO, **kwargs)


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "error: " in line]
    assert lines, stderr[-3000:]
    return lines[-1][lines[-1].index("error: "):]


class Server:
    """The printed command run as printed (a shell line: the environment assignment in front of it included)."""

    def __init__(self, command: str, url: str, log: Path):
        self.command, self.url, self.log = command, url, log

    def __enter__(self):
        self.file = open(self.log, "w")
        # no VLLM_* variable and no thread setting: the command sets what vLLM's CPU build needs to start at TP 3
        env = {k: v for k, v in _env().items() if not k.startswith("VLLM_") and k != "OMP_NUM_THREADS"}
        self.proc = subprocess.Popen(["bash", "-c", self.command], env=env, stdout=self.file,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 900
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}): {self.log.read_text()[-3000:]}")
            try:
                models(self.url)
                return self
            except OSError:
                assert time.time() < deadline, f"the server did not come up: {self.log}"
                time.sleep(3)

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
        self.file.close()


def _stale_sync_refused(url: str, model: str, adapters: dict, workdir: Path) -> None:
    """ServerRollouts whose `save` hands the server another adapter (bd24b) than the trainer's policy (bd24): the
    step is refused with the measured gap; with its own adapter the same rollout passes."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bdlora_train.core.errors import RolloutError
    from bdlora_train.rl.rollouts import ServerRollouts
    from bdlora_train.rl.vllm_server import RolloutServer

    tokenizer = AutoTokenizer.from_pretrained(model)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    policy = PeftModel.from_pretrained(base, adapters["bd24"])
    trainer = SimpleNamespace(
        state=SimpleNamespace(global_step=0), model=policy, _metrics={"train": defaultdict(list)},
        accelerator=SimpleNamespace(unwrap_model=lambda m: m),
        args=SimpleNamespace(max_completion_length=4, temperature=1.0, top_p=1.0, top_k=0, seed=0),
    )
    prompts = ["Athens is to Greece as Baghdad is to"] * 4

    def rollouts(source: str, root: Path) -> ServerRollouts:
        return ServerRollouts(RolloutServer(url), lambda path: shutil.copytree(source, path),
                              lambda texts: [tokenizer(t)["input_ids"] for t in texts], root, "stale-test",
                              gap_rule("float32", TOL))

    good = rollouts(adapters["bd24"], workdir / "sync-good")
    out = good(prompts, trainer)
    assert len(out["completion_ids"]) == 4 and good.diffs[0]["max_abs_logprob_diff"] <= TOL
    good.close()
    stale = rollouts(adapters["bd24b"], workdir / "sync-stale")
    with pytest.raises(RolloutError, match=r"at step 0 its log-probs of the sampled tokens differ from the trainer's "
                                           r"under adapter stale-test-\w+-v0 \(version 0\): max gap .* > 0.001, "):
        stale(prompts, trainer)
    MEASURED.setdefault("rl", {})["stale_sync_gap"] = f"{stale.diffs[0]['max_abs_logprob_diff']:.2e}"
    stale.close()


def _tp3_trainer_against_the_server(args: list[str], out: Path, adapter_bytes: int, server: Server) -> None:
    shutil.rmtree(out, ignore_errors=True)
    port = str(free_port())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--master_port", port, "-m",
           "bdlora_train.train", str(RECIPE), *(a for a in args if not a.startswith("output_dir=")),
           f"output_dir={out}", "tp_size=3", "max_steps=2"]
    run = subprocess.run(cmd, env={**_env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=1800,
                         cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["parallelism"] == "tp3" and metrics["world_size"] == 3
    rollout = metrics["rollout"]
    assert [s["step"] for s in rollout["steps"]] == [0, 1] and [s["step"] for s in rollout["syncs"]] == [0, 1]
    assert rollout["max_abs_logprob_diff"] <= TOL, rollout
    for sync in rollout["syncs"]:  # the whole adapter, gathered from the ranks' blocks: its size, no more
        assert adapter_bytes <= sync["bytes"] <= adapter_bytes + 20_000
    served = [ln for ln in server.log.read_text().splitlines() if "bdlora: " in ln and "grpo-run-tp3-" in ln]
    assert len(served) >= 2 and all("block-diagonal and rank-local" in ln for ln in served), served[:3]
    MEASURED.setdefault("rl", {})["tp3_trainer_max_abs_logprob_diff"] = f"{rollout['max_abs_logprob_diff']:.2e}"


@pytest.mark.timeout(1800)  # the server started twice, four trainings (one at TP 3) and their faults
def test_grpo_rollouts_in_vllm_serve_tp3(smollm2, workdir):
    model, adapters = smollm2["model"], smollm2["adapters"]
    out = workdir / "grpo-run"
    shutil.rmtree(out, ignore_errors=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [f"model={model}", f"output_dir={out}", f"rollout_server={url}", *STEPS]

    # 1. no server: one line, and the command that starts the right one
    first = _train([*args, "max_steps=3"])
    assert first.returncode == 1
    line = _error_line(first.stderr)
    assert line.startswith(f"error: rollout server {url}: no answer ("), line
    command = line.split("start it with: ", 1)[1]
    # check-serving's launcher for the CPU build (its `vllm` script dies at start), this environment's interpreter;
    # on one NUMA node (this machine) the threads vLLM's CPU build needs at TP 3 (docs/serving-vllm.md)
    per_rank = max(1, os.cpu_count() // 3)
    threads = "" if numa_nodes() >= 3 else f"VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS={per_rank} "
    # and the KV cache size that lets the CPU worker start on a machine whose RAM is partly in use (1 GiB here)
    assert command == (f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 VLLM_CPU_KVCACHE_SPACE=1 {threads}{sys.executable} -m "
                       f"vllm.entrypoints.openai.api_server --model {model} --enable-lora --tensor-parallel-size 3 "
                       f"--max-lora-rank 8 --max-loras 2 --dtype float32 --host 127.0.0.1 --port {port}")
    assert not list(out.glob("checkpoint-*"))
    assert not (out / "rollout-adapters").exists()  # nothing half-made: no adapter version left by the refusal

    t0 = time.perf_counter()
    with Server(command, url, workdir / "rl-serve-1.log") as server:
        # 2. three steps against the server
        run = _train([*args, "max_steps=3"])
        assert run.returncode == 0, run.stderr[-3000:]
        metrics = json.loads((out / "metrics.json").read_text())
        rollout = metrics["rollout"]
        assert [s["step"] for s in rollout["steps"]] == [0, 1, 2]
        assert rollout["max_abs_logprob_diff"] <= TOL, rollout
        assert [s["step"] for s in rollout["syncs"]] == [0, 1, 2]
        adapter_bytes = sum(f.stat().st_size for f in (out / "adapter").glob("adapter_*"))
        weights = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
        for sync in rollout["syncs"]:  # the adapter's tensors and config, within a README's size; not the base
            assert adapter_bytes <= sync["bytes"] <= adapter_bytes + 20_000 and sync["bytes"] < weights / 20
        assert not (out / "rollout-adapters").exists()  # versions are deleted once unloaded, the last at the end
        served = [ln for ln in server.log.read_text().splitlines() if "bdlora: " in ln and "grpo-run-" in ln]
        assert len(served) >= 3 and all("block-diagonal and rank-local" in ln for ln in served), served[:3]
        MEASURED.setdefault("rl", {}).update(
            max_abs_logprob_diff=f"{rollout['max_abs_logprob_diff']:.2e}", sync_bytes=rollout["syncs"][0]["bytes"],
            sync_seconds=[s["seconds"] for s in rollout["syncs"]], base_weight_bytes=weights)

        # 2b. the trainer at TP 3 too (torchrun, one TP group): its main process syncs each version once, gathered
        # from the three ranks' blocks (the adapter's bytes, never more), the group's first rank asks and shares the
        # completions, and every rank checks the server's log-probs against the TP model's
        _tp3_trainer_against_the_server(args, out.parent / "grpo-run-tp3", adapter_bytes, server)

        # 2c. asynchronous: the server samples the next step while the trainer trains; each step after the first
        # trains one version behind, checked under the version that sampled, with TRL's importance ratios recorded
        ahead = out.parent / "grpo-run-async"
        shutil.rmtree(ahead, ignore_errors=True)
        run = _train([*(a for a in args if not a.startswith("output_dir=")), f"output_dir={ahead}", "max_steps=3",
                      "max_staleness=1"])
        assert run.returncode == 0, run.stderr[-3000:]
        rollout = json.loads((ahead / "metrics.json").read_text())["rollout"]
        assert [(s["step"], s["lag"]) for s in rollout["steps"]] == [(0, 0), (1, 1), (2, 1)], rollout["steps"]
        assert rollout["max_abs_logprob_diff"] <= TOL, rollout
        # at lag 0 the ratio of two float32 forwards of one policy: 1 within a sequence's summed rounding
        first = rollout["steps"][0]["importance_sampling"]
        assert all(abs(first[k] - 1) <= 1e-3 for k in ("mean", "min", "max")), first
        MEASURED["rl"]["async_max_abs_logprob_diff"] = f"{rollout['max_abs_logprob_diff']:.2e}"

        # 3. a sync gone wrong on purpose is refused
        _stale_sync_refused(url, model, adapters, workdir)

        # 4. the server dies mid-run in a run shorter than its save_steps: one line, the last completed step kept
        # (a fresh output_dir: a resumed run keeps its checkpoint's save_steps, transformers' TrainerState)
        fault = workdir / "grpo-fault"
        shutil.rmtree(fault, ignore_errors=True)
        longer = [*(a for a in args if not a.startswith(("save_steps=", "output_dir="))), f"output_dir={fault}",
                  "max_steps=8", "save_steps=100"]
        proc = subprocess.Popen([sys.executable, "-m", "bdlora_train.cli", "train", str(RECIPE), *longer],
                                env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        deadline = time.time() + 900
        while not (fault / "rollout-adapters" / "v3").exists():  # step 3 done: its adapter is being synced
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        server.kill()
        _, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 1
        line = _error_line(stderr)
        assert line.startswith(f"error: rollout server {url} stopped answering"), line
        assert "run the same command again" in line, line
        kept = sorted(int(p.name.split("-")[1]) for p in fault.glob("checkpoint-*"))
        # save_steps=100 saves none: the one checkpoint is the fault's, of the last completed step (3, or 4 when the
        # step under way when the server died had its completions already)
        assert len(kept) == 1 and kept[0] in (3, 4), kept
        assert not (fault / "adapter").exists()
    MEASURED.setdefault("engine_seconds", {})["rl-serve-1"] = round(time.perf_counter() - t0, 1)

    # the same command after the server is back: resumes and syncs again, then serves the final adapter
    with Server(command, url, workdir / "rl-serve-2.log"):
        again = _train(longer)
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"resuming from {fault / f'checkpoint-{kept[-1]}'}" in again.stderr
        metrics = json.loads((fault / "metrics.json").read_text())
        assert metrics["steps"] == 8 and metrics["rollout"]["syncs"][0]["step"] == kept[-1]
        assert metrics["rollout"]["max_abs_logprob_diff"] <= TOL

        # 5. the final adapter: stock PEFT loads it (the reference), the server serves it with the same log-probs
        from tools.vllm_harness.server import post

        final = fault / "adapter"
        status, body = post(f"{url}/v1/load_lora_adapter", {"lora_name": "final", "lora_path": str(final)})
        assert status == 200, body
        ids = smollm2["ids"]
        ref = fx.reference_greedy(model, final, ids, MAX_TOKENS)
        got = []
        for prompt in ids:
            status, body = post(f"{url}/v1/completions", {
                "model": "final", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 1,
                "ignore_eos": True, "return_tokens_as_token_ids": True})
            assert status == 200, body
            lp = json.loads(body)["choices"][0]["logprobs"]
            got.append({"tokens": [int(t.split(":")[1]) for t in lp["tokens"]], "logprobs": lp["token_logprobs"]})
        diff = max_diff(got, ref, "final GRPO adapter")
        MEASURED["rl"]["final_adapter_vs_hf_peft"] = f"{diff:.2e}"
        assert diff <= TOL
