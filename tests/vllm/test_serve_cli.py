"""vLLM's OpenAI-compatible server as users deploy it, through the OpenAI Python client.

1. The command `bdlora check-serving` prints, run as printed plus the test's `--host/--port` and `--dtype float32`
   (vLLM's CPU build serves a float32 checkpoint in bfloat16 by default; the comparison with HF+PEFT is in fp32): a
   tiny Phi-3 BD-LoRA adapter trained by `bdlora train` (fused qkv_proj / gate_up_proj, segment-aware blocks) at TP 2.
2. SmolLM2 at TP 3: BD adapters and a plain LoRA given at start-up, a BD adapter loaded at run time
   (`POST /v1/load_lora_adapter`), every `--max-loras` slot occupied while base requests run concurrently, a BD
   adapter that cannot be served refused with an HTTP error carrying the plugin's reason, the server serving on,
   `POST /v1/unload_lora_adapter`; a run-time adapter replaced under its name (`"load_inplace": true`) by another
   adapter through the plugin, and a replacement the plugin refuses leaving it as it was.
Greedy tokens and log-probs are compared with HF+PEFT (TOL, see test_engine.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vllm_helpers import ENGINE_ENV, MAX_TOKENS, MEASURED, TOL, max_diff

from tools.vllm_harness.server import models, post, serving


def _env(**extra) -> dict:
    # `python` in a printed command is this environment's interpreter (as in an activated venv)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, **ENGINE_ENV, "PATH": path, **extra}


def _complete(client, model: str, ids: list[int]) -> dict:
    """One greedy completion through the OpenAI client: its tokens and their log-probs."""
    out = client.completions.create(model=model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1,
                                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = out.choices[0].logprobs
    return {"tokens": [int(t.split(":")[1]) for t in lp.tokens], "logprobs": lp.token_logprobs}


def _round(url: str, served: dict, ids: list[list[int]]) -> dict:
    """Every prompt for every served model, all at once (the server batches them): {model key: [results]}."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none", timeout=600, max_retries=0)
    jobs = [(key, i) for key in served for i in range(len(ids))]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: _complete(client, served[job[0]], ids[job[1]]), jobs))
    got: dict = {}
    for (key, i), res in zip(jobs, results):
        got.setdefault(key, [None] * len(ids))[i] = res
    return got


def _differs(a: list[dict], b: list[dict]) -> bool:
    """Two references that no tolerance confuses: other greedy tokens, or log-probs more than 0.1 apart."""
    return any(x["tokens"] != y["tokens"] or max(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"])) > 0.1
               for x, y in zip(a, b, strict=True))


def _check(got: dict, refs: dict, label: str) -> dict:
    diffs = {key: max_diff(res, refs[key], f"{label} {key}") for key, res in got.items()}
    MEASURED.setdefault("max_abs_logprob_diff_vs_hf_peft", {})[label] = {k: f"{v:.1e}" for k, v in diffs.items()}
    for key, diff in diffs.items():
        assert diff <= TOL, f"{label} {key}: max |Δ log-prob| {diff:.2e} vs HF+PEFT > {TOL}"
    return diffs


def test_printed_command_serves_phi3_at_tp2(fused, workdir):
    """check-serving's route, checks and command for the trained Phi-3 adapter; the command as printed serves it
    with the same log-probs as HF+PEFT and every adapted module (fused qkv_proj and gate_up_proj too) rank-local."""
    from bdlora_train.serving.plan import serving_lines

    a = fused["phi3"]
    adapter = a["adapters"]["bd"]
    cmd = [sys.executable, "-m", "bdlora_train.cli", "check-serving", adapter, "--tp", "2", "--model", a["model"]]
    text = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert text.returncode == 0, text.stdout + text.stderr
    report = json.loads(subprocess.run([*cmd, "--json"], env=_env(), capture_output=True, text=True,
                                       timeout=600).stdout)
    assert report["ready"] and report["route"] == "plugin" and report["max_lora_rank"] == 8  # r 16 / TP 2
    command = report["command"]
    assert text.stdout.strip().splitlines()[-1] == f"ready: {command}"
    name = Path(adapter).name  # the rule: the served directory's name
    assert command.endswith(f"--lora-modules {name}={Path(adapter).resolve()}")
    # the model card's serve line for the same directory: same flags and name (it prints `vllm serve`: CUDA)
    from bdlora_train.adapters.reader import read_adapter

    card = next(line for line in serving_lines(read_adapter(adapter), a["model"], str(Path(adapter).resolve()))
                if line.startswith("vllm serve"))
    assert card.split(" --enable-lora", 1)[1] == command.split(" --enable-lora", 1)[1]
    t0 = time.perf_counter()
    log = workdir / "serve-phi3-tp2.log"
    with serving(f"{command} --dtype float32", log, _env()) as url:
        got = _round(url, {"base": a["model"], "bd": name}, a["ids"])
    MEASURED.setdefault("engine_seconds", {})["vllm-serve-phi3-tp2"] = round(time.perf_counter() - t0, 1)
    _check(got, a["refs"], "printed command, phi3 tp2 (OpenAI client)")
    lines = [line for line in log.read_text().splitlines() if "bdlora: " in line and f"'{name}'" in line]
    assert lines, "no load line from the plugin"
    MEASURED.setdefault("load_lines", {})["phi3 tp2"] = lines[0].split("bdlora: ", 1)[1]
    assert "8 of 8 adapted modules block-diagonal and rank-local" in lines[0], lines[0]
    assert "gate_up_proj x2" in lines[0] and "qkv_proj x2" in lines[0] and "each rank holds rank 8 of 16" in lines[0]


def test_openai_client_tp3_start_up_run_time_full_slots_refusal_unload(smollm2, workdir):
    a = smollm2["adapters"]
    refs, ids = smollm2["refs"], smollm2["ids"]
    start = ["bd48", "bd24", "plain8"]
    # --max-lora-rank 16: bd48's per-rank rank 48/3 (bd24: 8, plain8: 8); --max-loras 4 = every adapter below
    command = (f"python -m vllm.entrypoints.openai.api_server --model {smollm2['model']} --enable-lora "
               "--tensor-parallel-size 3 --max-lora-rank 16 --max-loras 4 --max-model-len 256 --dtype float32 "
               "--lora-modules " + " ".join(f"{k}={a[k]}" for k in start))
    t0 = time.perf_counter()
    log = workdir / "serve-smollm2-tp3.log"
    with serving(command, log, _env(VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")) as url:
        listed = models(url)
        assert set(start) <= listed
        status, body = post(f"{url}/v1/load_lora_adapter", {"lora_name": "bd24b", "lora_path": a["bd24b"]})
        assert status == 200, body
        # 4 adapters in one batch with --max-loras 4: every slot occupied while base requests run
        served = {"base": smollm2["model"], **{k: k for k in [*start, "bd24b"]}}
        first = _round(url, served, ids)
        # vLLM's in-place reload: the name bd24b now serves bd24's factors, loaded through the plugin's checks
        inplace = post(f"{url}/v1/load_lora_adapter", {"lora_name": "bd24b", "lora_path": a["bd24"],
                                                       "load_inplace": True})
        replaced = _round(url, {"bd24b": "bd24b"}, ids)
        # a replacement the plugin refuses (nblocks 2 at TP 3): HTTP error, bd24b serves what it served before
        inplace_refused = post(f"{url}/v1/load_lora_adapter", {"lora_name": "bd24b", "lora_path": a["bd2"],
                                                               "load_inplace": True})
        kept = _round(url, {"bd24b": "bd24b"}, ids)
        status, body = post(f"{url}/v1/load_lora_adapter", {"lora_name": "bd2", "lora_path": a["bd2"]})
        refusal = body
        status_unload, body_unload = post(f"{url}/v1/unload_lora_adapter", {"lora_name": "bd24b"})
        second = _round(url, {k: v for k, v in served.items() if k != "bd24b"}, ids)
        gone, gone_body = post(f"{url}/v1/completions", {"model": "bd24b", "prompt": ids[0], "max_tokens": 1})
        listed_after = models(url)
    MEASURED.setdefault("engine_seconds", {})["vllm-serve-smollm2-tp3"] = round(time.perf_counter() - t0, 1)
    _check(first, refs, "vllm serve tp3, every slot occupied (OpenAI client)")
    assert inplace[0] == 200, inplace
    assert _differs(refs["bd24"], refs["bd24b"])  # so serving bd24's output under bd24b proves the replacement
    _check({"bd24b": replaced["bd24b"]}, {"bd24b": refs["bd24"]}, "vllm serve tp3, bd24b replaced in place by bd24")
    assert inplace_refused[0] >= 400 and "nblocks 2 is not divisible" in inplace_refused[1], inplace_refused
    _check({"bd24b": kept["bd24b"]}, {"bd24b": refs["bd24"]}, "vllm serve tp3, after a refused in-place replacement")
    reloads = [line for line in log.read_text().splitlines() if "bdlora: " in line and "adapter 'bd24b'" in line
               and str(a["bd24"]) in line]
    assert reloads, "no plugin load line for the in-place replacement"
    # vLLM before 0.34 keeps load_inplace on the request it caches, so every later step reloads the adapter
    MEASURED.setdefault("in_place_reload", {})["loads of the replacement (rank 0 load lines)"] = len(reloads)
    assert status >= 400, f"the nblocks-2 adapter was loaded at TP 3: {refusal}"
    MEASURED.setdefault("refusals", {})["vllm serve tp3 run-time load of nblocks 2"] = f"HTTP {status}: {refusal}"
    assert "nblocks 2 is not divisible by --tensor-parallel-size 3" in refusal and "fix:" in refusal
    assert status_unload == 200, body_unload
    _check(second, refs, "vllm serve tp3, after the refusal and the unload")
    assert gone == 404 and "bd24b" in gone_body and "bd24b" not in listed_after and "bd2" not in listed_after
    lines = [line for line in log.read_text().splitlines() if "bdlora: " in line and "adapter 'bd48'" in line]
    assert lines, "no load line from the plugin"
    MEASURED.setdefault("load_lines", {})["smollm2 tp3 bd48"] = lines[0].split("bdlora: ", 1)[1]
    assert "210 of 210 adapted modules block-diagonal and rank-local" in lines[0]  # 30 layers x 7 projections
    assert any("vLLM's CPU LoRA ops replaced by grouped ones" in line for line in log.read_text().splitlines())


def test_readme_serve_path_runs_as_printed(workdir):
    """README step 3, line by line: train on the embedded SmolLM2, check-serving with --save-base, and the serve line
    it prints (the README's, with absolute paths), run as printed: the server answers for the adapter."""
    import shlex

    from vllm_helpers import REPO

    blocks = [b.split("```", 1)[0] for b in (REPO / "README.md").read_text().split("```bash\n")[1:]]
    block = next(b for b in blocks if "--save-base" in b)
    lines = [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]
    train = next(line for line in lines if line.startswith("bdlora train"))
    check = next(line for line in lines if "check-serving" in line)
    serve = next(line for line in lines if "vllm.entrypoints.openai.api_server" in line)
    cwd = workdir / "readme-path"
    cwd.mkdir(exist_ok=True)
    if not (cwd / "recipes").exists():
        (cwd / "recipes").symlink_to(REPO / "recipes")
    env = _env(PYTHONPATH=str(REPO))
    env.update(dict(line.split(" ", 1)[1].split("=", 1) for line in lines if line.startswith("export ")))
    bdlora = [sys.executable, "-m", "bdlora_train.cli"]
    if not (cwd / "runs/s/adapter/adapter_config.json").exists():
        subprocess.run([*bdlora, *shlex.split(train)[1:]], cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL,
                       timeout=900)
    assert check.startswith(".venv-vllm/bin/bdlora check-serving")
    out = subprocess.run([*bdlora, *shlex.split(check)[1:]], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    printed = out.stdout.strip().splitlines()[-1]
    assert printed.startswith("ready: "), out.stdout
    command = printed.removeprefix("ready: ")
    assert command == serve.replace(".venv-vllm/bin/python", sys.executable).replace(" runs/", f" {cwd}/runs/") \
        .replace("=runs/", f"={cwd}/runs/"), (command, serve)
    t0 = time.perf_counter()
    log = workdir / "serve-readme-path.log"
    with serving(command, log, env) as url:
        listed = models(url)
        status, body = post(f"{url}/v1/completions", {"model": "adapter", "prompt": "12+30=", "max_tokens": 4})
    MEASURED.setdefault("engine_seconds", {})["readme-path-smollm2-tp3"] = round(time.perf_counter() - t0, 1)
    assert "adapter" in listed and status == 200 and json.loads(body)["choices"][0]["text"], body
    assert any("210 of 210 adapted modules block-diagonal and rank-local" in line
               for line in log.read_text().splitlines()), "no load line from the plugin"
