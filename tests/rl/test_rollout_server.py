"""The rollout server's client (bdlora_train/rl/vllm_server.py and the parts it composes) against a stand-in for
`vllm serve` (fake_vllm.py, standard library): the requests each call sends, in order, and the one-line refusal each
misconfiguration gets. tests/vllm/test_rl_server.py holds the same client to real engines."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from fake_vllm import FakeVllm, logprob

from bdlora_train.core.errors import RolloutError
from bdlora_train.rl.logprob_gap import gap_rule
from bdlora_train.rl.rollouts import ServerRollouts
from bdlora_train.rl.vllm_server import RolloutServer

START = "START-COMMAND"
PROBE = [1, 5, 9, 13, 20, 31, 8]
FLOAT32 = gap_rule("float32", None)


def _check(server: RolloutServer, adapter_dir="/runs/a/v-1", name="run-v-1"):
    return server.check(base_model="org/base", probe_ids=PROBE, probe_logprobs=[logprob(t) for t in PROBE[1:]],
                        adapter_dir=Path(adapter_dir), adapter_name=name, rule=FLOAT32)


def _refusal(call) -> str:
    with pytest.raises(RolloutError) as err:
        call()
    assert "\n" not in str(err.value)
    return str(err.value)


def test_check_passes_in_order_and_loads_the_initial_adapter(monkeypatch):
    # a proxy in the environment is not used: the server is reached directly
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    fake = FakeVllm(tp=3)
    with fake as url:
        found = _check(RolloutServer(url, start_command=START))
    assert (found.base_model, found.vllm, found.tp, found.max_loras) == ("org/base", "0.32.0", 3, 2)
    assert found.base_logprob_diff == 0.0 and found.probe_tokens == len(PROBE) - 1
    assert fake.adapters == {"run-v-1": "/runs/a/v-1"}
    steps = [(method, path) for method, path, _ in fake.requests]
    assert steps == [("GET", "/v1/models"), ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/completions"),
                     ("GET", "/metrics"), ("POST", "/v1/completions"), ("POST", "/v1/load_lora_adapter")]
    probe, mode = fake.requests[2][2], fake.requests[4][2]
    assert probe["prompt"] == PROBE and probe["prompt_logprobs"] == 0 and probe["temperature"] == 2.0
    assert mode["prompt"][:-1] == PROBE and mode["temperature"] == 0.0  # the sampled token, scored as a prompt token


@pytest.mark.parametrize(("setting", "expected"), [
    ({"runtime_loading": False}, "does not load adapters at run time (POST /v1/load_lora_adapter answers 404): it was "
                                 "started without VLLM_ALLOW_RUNTIME_LORA_UPDATING=1; restart it with that variable in "
                                 f"its environment: {START}"),
    ({"enable_lora": False}, "serves no adapters: it was started without --enable-lora (its /metrics have no "
                             f"vllm:lora_requests_info); restart it with --enable-lora: {START}"),
    ({"max_loras": 1}, "runs with --max-loras 1: a sync loads the adapter's new version before it unloads the old "
                       "one, and the rollouts in flight keep theirs (max_staleness), so it needs --max-loras 2 or "
                       f"more; restart it as: {START}"),
    ({"raw_logprobs": False}, "returns log-probs other than raw (the token sampled at temperature 2 got -0.2000, "
                              "-0.4000 as a prompt token): it was started with --logprobs-mode other than "
                              f"raw_logprobs; restart it without --logprobs-mode: {START}"),
    ({"shift": 0.05}, "serves another base model: its 'org/base' gives the log-probs of the probe's 6 tokens up to "
                      "0.05 from the trainer's 'org/base' (max gap 5.00e-02 over 6 tokens > 0.001, the bound for "
                      "float32 (rollout_max_logprob_diff sets another)); serve 'org/base' at the trainer's dtype "
                      "(e.g. --dtype float32), or train on 'org/base'"),
    ({"api_key": True}, "asks for an API key (started with --api-key), which this client does not send; start it "
                        f"without --api-key: {START}"),
])
def test_each_misconfiguration_is_refused_before_any_adapter_loads(setting, expected):
    fake = FakeVllm(**setting)
    with fake as url:
        text = _refusal(lambda: _check(RolloutServer(url, start_command=START)))
    assert text == f"rollout server {url} {expected}" or text == f"rollout server {url}: {expected}", text
    assert fake.adapters == {}


def test_without_a_start_command_the_refusal_says_how_to_start_it():
    with FakeVllm(runtime_loading=False) as url:
        text = _refusal(lambda: _check(RolloutServer(url), adapter_dir="/runs/a/v-1"))
    assert text.endswith("VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 vllm serve org/base --enable-lora --max-loras 2 "
                         "--max-lora-rank R (R and the TP degree: `bdlora check-serving /runs/a/v-1 --tp N` prints "
                         "them)"), text


def test_a_plugin_refusal_says_to_restart_at_tp_above_1():
    refusal = "each rank holds rank 16, above --max-lora-rank 8"
    texts = {}
    for tp in (1, 3):
        with FakeVllm(tp=tp, worker_refusals={"/big": refusal}) as url:
            server = RolloutServer(url, start_command=START)
            _check(server)
            texts[tp] = _refusal(lambda: server.load("run-v0", Path("/big")))
    with FakeVllm(tp=1, worker_refusals={"/big": refusal}) as url:  # the initial adapter, before the first step
        texts["check"] = _refusal(lambda: _check(RolloutServer(url, start_command=START), adapter_dir="/big"))
    assert texts["check"] == f"rollout server {url} cannot load /big as 'run-v-1': HTTP 500: {refusal}"
    where = "cannot load /big as 'run-v0': HTTP 500: " + refusal
    assert texts[1].endswith(f"{where}; restart it ({START}) and run the same command again"), texts[1]
    assert texts[3].endswith(f"{where}; after the fix, restart the server ({START}): at TP > 1 vLLM 0.32 answers "
                             "every later load with this refusal (vllm-project/vllm#58242)"), texts[3]


def test_complete_sends_every_sampling_setting_and_a_seed_per_prompt():
    fake = FakeVllm(adapters={"run-v0": "/runs/a/v0"})
    with fake as url:
        answers = RolloutServer(url).complete("run-v0", [[1, 2], [3, 4, 5], [1, 2]], n=2, max_tokens=3,
                                              temperature=0.7, seed=10)
    bodies = sorted((body for _, _, body in fake.requests), key=lambda body: body["seed"])
    assert [(b["prompt"], b["seed"]) for b in bodies] == [([1, 2], 10), ([3, 4, 5], 12), ([1, 2], 14)]
    assert all(b["top_k"] == 0 and b["min_p"] == 0.0 and b["repetition_penalty"] == 1.0 and b["top_p"] == 1.0
               and b["n"] == 2 and b["logprobs"] == 0 for b in bodies)
    # the answers in prompt order: prompt i's samples start from its own seed (the stand-in's tokens follow it)
    assert [[c.token_ids[0] for c in group] for group in answers] == [[13, 14], [15, 16], [17, 18]]
    assert all(c.logprobs == [logprob(t) for t in c.token_ids] for group in answers for c in group)


def test_a_stale_name_a_failed_unload_and_a_dead_engine_are_one_line_each():
    fake = FakeVllm(adapters={"run-v1": "/runs/a/v1"})
    with fake as url:
        server = RolloutServer(url, start_command=START)
        stale = _refusal(lambda: server.complete("run-v0", [[1]], n=1, max_tokens=1, temperature=1.0))
        unload = _refusal(lambda: server.unload("run-v0"))
        fake.engine_dead = True
        dead = _refusal(lambda: server.complete("run-v1", [[1]], n=1, max_tokens=1, temperature=1.0))
    assert stale == (f"rollout server {url} does not serve 'run-v0' (it serves ['run-v1']): it was restarted or the "
                     "adapter unloaded since the sync; run the same command again: the run resumes from its last "
                     "checkpoint")
    assert unload == (f"rollout server {url} cannot unload 'run-v0': HTTP 404: The lora adapter 'run-v0' cannot be "
                      "found; it serves ['run-v1']")
    assert dead == (f"rollout server {url} stopped answering during the completions of 1 prompt(s) (n 1) under "
                    "'run-v1': its engine died (HTTP 500: EngineCore encountered an issue); restart it "
                    f"({START}) and run the same command again: the run resumes from its last checkpoint")


def test_no_server_at_the_url():
    url = f"http://127.0.0.1:{_closed_port()}"
    text = _refusal(lambda: _check(RolloutServer(url, start_command=START)))
    assert text == f"rollout server {url}: no answer ([Errno 111] Connection refused); start it with: {START}"
    text = _refusal(lambda: RolloutServer(url, start_command=START).served_adapters())
    assert text.startswith(f"rollout server {url} stopped answering during listing models: "), text


def test_sync_loads_the_new_version_before_unloading_the_old(tmp_path):
    """ServerRollouts' sync against the stand-in: one version served at a time, the old directory deleted, and a
    later process of the same run unloads what an earlier one left."""
    fake = FakeVllm()

    def save(path: Path) -> None:
        path.mkdir()
        (path / "adapter_model.safetensors").write_bytes(b"0" * 100)

    with fake as url:
        rollouts = ServerRollouts(RolloutServer(url), save, lambda prompts: prompts, tmp_path, "run", FLOAT32)
        first, second = rollouts.sync(0), rollouts.sync(1)
        calls = [(path.rsplit("_", 2)[0], body["lora_name"]) for _, path, body in fake.requests if body]
        assert calls == [("/v1/load", first), ("/v1/load", second), ("/v1/unload", first)]
        assert fake.adapters == {second: str(tmp_path / "rollout-adapters" / "v1")}
        assert sorted(p.name for p in (tmp_path / "rollout-adapters").iterdir()) == ["v1"]
        assert rollouts.syncs[-1]["bytes"] == 100
        later = ServerRollouts(RolloutServer(url), save, lambda prompts: prompts, tmp_path, "run", FLOAT32)
        assert later.prefix != rollouts.prefix and later.clear_stale() == [second]
        assert fake.adapters == {}


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
