"""The RL run's rollout-server client (bdlora_train/rl/vllm_server.py and its parts) against real `vllm serve`s of
the embedded SmolLM2-135M (fp32), three servers in all:

1. the server as an RL run needs it, at TP 3 (the BD adapters' nblocks): `check` passes with the base's probe
   log-probs within TOL of HF's, the run's initial adapter loaded; completions under it and under a second version
   loaded at run time (both in the engine's batches at once) have HF+PEFT's log-probs of the sampled tokens
   (vLLM's raw log-probs, sampled at temperature 0.8); the old version, unloaded, is gone from /v1/models and
   refused by name; then each refusal `check` gives on that server: another base (a run on a random tiny Llama),
   an adapter rank above --max-lora-rank, nblocks the TP degree cannot cut, and the next load answered with the
   earlier refusal (vLLM 0.32 at TP > 1);
2. at TP 1, started at the same time as 3: without --enable-lora (and with --logprobs-mode processed_logprobs,
   which its own check step finds), then killed (SIGKILL) during a completion request;
3. at TP 1: without VLLM_ALLOW_RUNTIME_LORA_UPDATING (and with --max-loras 1, which its own check step finds).
And a closed port: no answer.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from vllm_helpers import ENGINE_ENV, MEASURED, TOL

from bdlora_train.core.errors import RolloutError
from bdlora_train.rl.logprob_gap import gap_rule
from bdlora_train.rl.vllm_server import Completion, RolloutServer
from tools.vllm_harness import fixtures as fx
from tools.vllm_harness.server import free_port, serving

RULE = gap_rule("float32", TOL)  # the bound on every token's gap the tests hold float32 to

pytestmark = pytest.mark.vllm

PROBE = "Once upon a time, in a small village, there lived an old clockmaker who"
START = "START-COMMAND"  # what the messages print as the command that starts the server


def _env(**extra) -> dict:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, **ENGINE_ENV, "PATH": path, **extra}


def _command(model: str, flags: str) -> str:
    return (f"python -m vllm.entrypoints.openai.api_server --model {model} --max-model-len 256 --dtype float32 "
            f"{flags}")


@contextlib.contextmanager
def _servers(*specs):
    """Start every (command, log, env) server at once (each start is mostly waiting on its own processes); yield
    their URLs; stop them all."""
    managers = [serving(command, log, env) for command, log, env in specs]
    with ThreadPoolExecutor(len(managers)) as pool:
        started = [pool.submit(m.__enter__) for m in managers]
    try:
        yield [f.result() for f in started]
    finally:
        for manager, future in zip(managers, started):
            if future.exception() is None:
                manager.__exit__(None, None, None)


def _logprobs(model_dir, adapter_dir, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
    """HF (+PEFT) fp32: the log-softmax of the unscaled logits at each completion token, given what precedes it."""
    import torch
    from peft import PeftModel

    model = fx._load(model_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, completions, strict=True):
            ids = torch.tensor([p + c])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            out.append(logp[len(p) - 1:].gather(-1, torch.tensor(c)[:, None])[:, 0].tolist())
    return out


def _vs_reference(smollm2, adapter_key: str, prompts, answers: list[list[Completion]], label: str) -> float:
    flat_prompts = [p for p, group in zip(prompts, answers, strict=True) for _ in group]
    flat = [c for group in answers for c in group]
    ref = _logprobs(smollm2["model"], smollm2["adapters"][adapter_key], flat_prompts, [c.token_ids for c in flat])
    diff = max(abs(a - b) for c, r in zip(flat, ref, strict=True) for a, b in zip(c.logprobs, r, strict=True))
    MEASURED.setdefault("rl_server_logprob_diff_vs_hf_peft", {})[label] = f"{diff:.1e}"
    return diff


@pytest.fixture(scope="module")
def probe(smollm2, workdir) -> dict:
    """The probe's token ids and the log-probs a trainer computes for them (HF fp32): SmolLM2's, and those of a
    random tiny Llama with SmolLM2's tokenizer (another base)."""
    ids = fx.prompt_ids(smollm2["model"], [PROBE])[0]
    other = fx.tiny_model_dir(workdir / "tiny-llama", smollm2["model"], "llama")
    return {"ids": ids, "base": _logprobs(smollm2["model"], None, [ids[:1]], [ids[1:]])[0],
            "other": _logprobs(other, None, [ids[:1]], [ids[1:]])[0], "other_model": str(other)}


def _check(server: RolloutServer, smollm2, probe, adapter: str = "bd24", name: str = "run-v0", other=False):
    """`check` as a run on SmolLM2 calls it (other: a run on the tiny Llama)."""
    base, logprobs = (probe["other_model"], probe["other"]) if other else (smollm2["model"], probe["base"])
    return server.check(base_model=base, probe_ids=probe["ids"], probe_logprobs=logprobs,
                        adapter_dir=Path(smollm2["adapters"][adapter]), adapter_name=name, rule=RULE)


def _refusal(call) -> str:
    with pytest.raises(RolloutError) as err:
        call()
    text = str(err.value)
    assert "\n" not in text
    return text


def test_unreachable(smollm2, probe):
    url = f"http://127.0.0.1:{free_port()}"
    text = _refusal(lambda: _check(RolloutServer(url, start_command=START), smollm2, probe))
    assert text == f"rollout server {url}: no answer ([Errno 111] Connection refused); start it with: {START}"
    text = _refusal(lambda: _check(RolloutServer(url), smollm2, probe))
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 vllm serve " in text and "--enable-lora --max-loras 2" in text
    MEASURED.setdefault("rl_server_refusals", {})["unreachable"] = text


def test_tp3_server_check_round_trip_and_refusals(smollm2, probe, workdir):
    a, ids = smollm2["adapters"], smollm2["ids"]
    # --max-lora-rank 8: bd24 holds rank 24/3 per rank; bd48 (16) is refused
    command = _command(smollm2["model"], "--enable-lora --tensor-parallel-size 3 --max-loras 2 --max-lora-rank 8")
    refusals = MEASURED.setdefault("rl_server_refusals", {})
    t0 = time.perf_counter()
    with serving(command, workdir / "rl-server-tp3.log", _env(VLLM_ALLOW_RUNTIME_LORA_UPDATING="1")) as url:
        up = time.perf_counter()
        server = RolloutServer(url, start_command=START)
        found = _check(server, smollm2, probe)
        served_after_check = server.served_adapters()
        server.load("run-v1", Path(a["bd24b"]))
        served_both = server.served_adapters()
        with ThreadPoolExecutor(2) as pool:  # both versions in the engine's batches at once (--max-loras 2)
            v0 = pool.submit(server.complete, "run-v0", ids, n=2, max_tokens=4, temperature=0.8, seed=0)
            v1 = pool.submit(server.complete, "run-v1", ids, n=2, max_tokens=4, temperature=0.8, top_k=50, seed=1)
            v0, v1 = v0.result(), v1.result()
        server.unload("run-v0")
        served_after_unload = server.served_adapters()
        stale = _refusal(lambda: server.complete("run-v0", ids[:1], n=1, max_tokens=2, temperature=1.0))
        other_base = _refusal(lambda: _check(server, smollm2, probe, name="run-x", other=True))
        rank = _refusal(lambda: _check(server, smollm2, probe, adapter="bd48", name="run-rank"))
        nblocks = _refusal(lambda: _check(server, smollm2, probe, adapter="bd2", name="run-nblocks"))
        # vLLM 0.32 at TP > 1: the other ranks' replies to a refused load stay queued, and answer the next loads
        after = _refusal(lambda: server.load("run-v2", Path(a["bd24"])))
        served_at_end = server.served_adapters()
        calls = time.perf_counter() - up
    MEASURED.setdefault("engine_seconds", {})["rl-server-tp3 (start, calls)"] = [round(up - t0, 1), round(calls, 1)]
    assert found.tp == 3 and found.max_loras == 2 and found.vllm == "0.32.0", found
    assert found.base_logprob_diff <= TOL and found.probe_tokens == len(probe["ids"]) - 1, found
    MEASURED.setdefault("rl_server_check", {})["base_logprob_diff"] = f"{found.base_logprob_diff:.1e}"
    assert served_after_check == {"run-v0"} and served_both == {"run-v0", "run-v1"}
    assert served_after_unload == {"run-v1"} and served_at_end == {"run-v1"}
    for answers in (v0, v1):
        assert [len(group) for group in answers] == [2] * len(ids)
        assert all(c.finish_reason in ("length", "stop") and len(c.token_ids) == len(c.logprobs) for g in answers
                   for c in g)
    assert _vs_reference(smollm2, "bd24", ids, v0, "run-v0 (bd24), temperature 0.8") <= TOL
    assert _vs_reference(smollm2, "bd24b", ids, v1, "run-v1 (bd24b), temperature 0.8, top_k 50") <= TOL
    assert stale.startswith(f"rollout server {url} does not serve 'run-v0' (it serves ['run-v1'])"), stale
    assert other_base.startswith(f"rollout server {url} serves another base model: its '{smollm2['model']}' gives "
                                 f"the log-probs of the probe's {len(probe['ids']) - 1} tokens up to "), other_base
    assert f" from the trainer's '{probe['other_model']}' (max gap " in other_base, other_base
    assert other_base.endswith(f" > {TOL:g}, the recipe's rollout_max_logprob_diff); serve "
                               f"'{probe['other_model']}' at the trainer's dtype (e.g. --dtype float32), or train on "
                               f"'{smollm2['model']}'"), other_base
    assert rank.startswith(f"rollout server {url} cannot load {a['bd48']} as 'run-rank': HTTP 500: each rank holds "
                           "rank 16 (r=48 / TP 3 of the BD-LoRA adapter), above --max-lora-rank 8; fix: "
                           "--max-lora-rank 16; after the fix, restart the server (START-COMMAND)"), rank
    assert "nblocks 2 is not divisible by --tensor-parallel-size 3" in nblocks and "fix: serve at" in nblocks
    assert nblocks.startswith(f"rollout server {url} cannot load {a['bd2']} as 'run-nblocks': HTTP 500: "), nblocks
    assert after.startswith(f"rollout server {url} cannot load {a['bd24']} as 'run-v2': HTTP 500: each rank holds "
                            "rank 16"), after  # bd24 itself loads (it did as run-v0): the answer is bd48's refusal
    refusals.update({"stale name": stale, "another base": other_base, "rank above --max-lora-rank": rank,
                     "nblocks at TP 3": nblocks, "a load after refusals (vLLM 0.32, TP > 1)": after})


def test_tp1_servers_without_lora_or_runtime_loading_and_killed(smollm2, probe, workdir):
    model = smollm2["model"]
    no_lora = (_command(model, "--logprobs-mode processed_logprobs"), workdir / "rl-server-no-lora.log",
               _env(VLLM_ALLOW_RUNTIME_LORA_UPDATING="1"))
    no_runtime = (_command(model, "--enable-lora --max-loras 1 --max-lora-rank 8"), workdir / "rl-server-static.log",
                  _env())
    refusals = MEASURED.setdefault("rl_server_refusals", {})
    t0 = time.perf_counter()
    with _servers(no_lora, no_runtime) as (url_a, url_b):
        up = time.perf_counter()
        a, b = RolloutServer(url_a, start_command=START), RolloutServer(url_b, start_command=START)
        without_lora = _refusal(lambda: _check(a, smollm2, probe))
        base = a.preflight.answers(START)
        scored = a.preflight.score(base, probe["ids"], model, START)
        mode = _refusal(lambda: a.preflight.check_logprobs_mode(base, probe["ids"], scored, RULE, START))
        without_runtime = _refusal(lambda: _check(b, smollm2, probe))
        b.preflight.score(b.preflight.answers(START), probe["ids"], model, START)  # the gauge's sample needs a step
        one_slot = _refusal(lambda: b.preflight.check_lora_slots(START))
        killed = _killed_during_completion(a, model, workdir / "rl-server-no-lora.log")
        calls = time.perf_counter() - up
    MEASURED.setdefault("engine_seconds", {})["rl-server-tp1 x2 (start, calls)"] = [round(up - t0, 1),
                                                                                    round(calls, 1)]
    assert without_lora == (f"rollout server {url_a} serves no adapters: it was started without --enable-lora (its "
                            f"/metrics have no vllm:lora_requests_info); restart it with --enable-lora: {START}")
    assert mode.startswith(f"rollout server {url_a} returns log-probs other than raw (the token sampled at "
                           "temperature 2 got "), mode
    assert mode.endswith("it was started with --logprobs-mode other than raw_logprobs; restart it without "
                         f"--logprobs-mode: {START}"), mode
    assert without_runtime == (f"rollout server {url_b} does not load adapters at run time (POST "
                               "/v1/load_lora_adapter answers 404): it was started without "
                               "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1; restart it with that variable in its environment: "
                               f"{START}")
    assert one_slot == (f"rollout server {url_b} runs with --max-loras 1: a sync loads the adapter's new version "
                        "before it unloads the old one, and the rollouts in flight keep theirs (max_staleness), so it "
                        f"needs --max-loras 2 or more; restart it as: {START}")
    assert re.fullmatch(rf"rollout server {url_a} stopped answering during the completions of 2 prompt\(s\) \(n 2\) "
                        rf"under '{model}': .+; restart it \({START}\) and run the same command again: the run resumes "
                        "from its last checkpoint", killed), killed
    refusals.update({"without --enable-lora": without_lora, "--logprobs-mode processed_logprobs": mode,
                     "without VLLM_ALLOW_RUNTIME_LORA_UPDATING": without_runtime, "--max-loras 1": one_slot,
                     "killed during a completion": killed})


def _killed_during_completion(server: RolloutServer, model: str, log: Path) -> str:
    """SIGKILL the server's process group (API server, engine, workers) while completion requests run."""
    out: dict = {"answered": 0}

    def run():  # request after request (one that ends early at EOS is answered), until the server is gone
        while True:
            try:
                server.complete(model, [[1, 504, 3575], [1, 19161, 2402]], n=2, max_tokens=200, temperature=1.0)
                out["answered"] += 1
            except RolloutError as err:
                out["error"] = str(err)
                return

    pid = int(re.search(r"APIServer pid=(\d+)", log.read_text()).group(1))
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(2)  # the request is in the engine (200 tokens take far longer on this CPU)
    os.killpg(pid, signal.SIGKILL)
    thread.join(60)
    assert not thread.is_alive() and "error" in out, out
    MEASURED.setdefault("rl_server_killed", {})["requests answered before the kill"] = out["answered"]
    return out["error"]
