"""`bdlora check-serving` tells the truth about the installed engine: the route (the vLLM plugin, the dense-lora
export, plain LoRA), the checks that route needs, and a command that works there — never a flag no release has."""

import json

import pytest

from bdlora_train import cli, get_peft_model
from bdlora_train.export import export
from bdlora_train.hub import model_card
from bdlora_train.models import build_tiny_model, tiny_config
from bdlora_train.peft_seam.config import BlockDiagLoraConfig
from bdlora_train.serving.check import check_serving, serving_lines
from bdlora_train.serving.engines import serving_status
from bdlora_train.tp import random_adapter

WIDE = dict(num_attention_heads=8, num_key_value_heads=4)  # so nblocks 4 lines up with the heads
TESTED = ["0.32.0"]
ACTIVE = dict(
    engine="vllm",
    version="0.32.0",
    plugin=True,
    supported=True,
    tested_versions=TESTED,
    active=True,
    message="vllm 0.32.0 with the bdlora plugin: BD-LoRA adapters load with --lora-modules.",
)
MISSING = dict(
    engine=None,
    version=None,
    plugin=False,
    supported=False,
    tested_versions=TESTED,
    active=False,
    message="vLLM is not installed",
)
UNTESTED = dict(
    engine="vllm",
    version="0.33.0",
    plugin=True,
    supported=False,
    tested_versions=TESTED,
    active=False,
    message="vllm 0.33.0 is not a tested version (tested: 0.32.0); fix: pip install 'vllm==0.32.0'.",
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def nb2(tmp_path_factory):
    return random_adapter(tmp_path_factory.mktemp("serve") / "nb2", "tiny:llama", tp=2, r=8, seed=2)


@pytest.fixture(scope="module")
def nb4(tmp_path_factory):
    return random_adapter(tmp_path_factory.mktemp("serve") / "nb4", "tiny:llama", tp=4, r=8, overrides=WIDE, seed=1)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A base model config a serving engine could point at (4 heads / 2 KV heads)."""
    path = tmp_path_factory.mktemp("base")
    tiny_config("llama").save_pretrained(path)
    return path


def _statuses(report):
    return {c["check"]: c["status"] for c in report["checks"]}


def test_serving_status_reads_the_installed_vllm_without_importing_it():
    import sys

    status = serving_status()
    assert {"engine", "version", "plugin", "supported", "tested_versions", "active", "message"} <= set(status)
    assert "vllm" not in sys.modules


def test_plugin_route_prints_the_stock_vllm_command(nb2, base_dir, capsys, monkeypatch):
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


def test_tp_dividing_nblocks_and_tp_1_are_served_by_the_plugin(nb4, nb2):
    report = check_serving(nb4, tp=2, engine=ACTIVE)
    assert report["ready"] and "re-blocked to 2 at load" in _message(report, "nblocks")
    assert report["command"].endswith(f"--lora-modules nb4={nb4.resolve()}")  # no export step needed
    one = check_serving(nb2, tp=1, engine=ACTIVE)
    assert one["ready"] and "--max-lora-rank 8" in one["command"]  # TP 1: the whole rank r on one GPU


def _message(report, check):
    return next(c["message"] for c in report["checks"] if c["check"] == check)


def test_what_the_plugin_cannot_serve_is_refused_with_the_fix(nb4, nb2, base_dir):
    straddle = check_serving(nb4, tp=3, engine=ACTIVE)
    assert not straddle["ready"] and straddle["command"] is None and _statuses(straddle)["nblocks"] == "fail"
    assert "--to dense-lora" in _message(straddle, "nblocks")
    assert _statuses(check_serving(nb4, tp=4, max_lora_rank=12, engine=ACTIVE))["rank"] == "fail"  # not a vLLM value
    small = check_serving(nb4, tp=2, max_lora_rank=1, engine=ACTIVE)  # each GPU holds rank 4 > 1
    assert _statuses(small)["rank"] == "fail" and "use --max-lora-rank 8" in _message(small, "rank")
    kv = check_serving(nb2, tp=4, base=str(base_dir), engine=ACTIVE)  # 2 KV heads at TP 4: vLLM replicates them
    assert not kv["ready"] and _statuses(kv)["kv_heads"] == "fail" and "replicates KV heads" in _message(kv, "kv_heads")


def test_an_engine_without_the_active_plugin_gets_the_dense_export(nb2):
    report = check_serving(nb2, tp=2, engine=UNTESTED)
    assert report["route"] == "dense-lora" and not report["ready"] and _statuses(report)["engine"] == "fix"
    assert report["fixes"] == [f"bdlora export {nb2} --to dense-lora --out {nb2}-dense"]
    assert report["command"].endswith(f"--max-lora-rank 8 --lora-modules nb2={nb2.resolve()}-dense")
    assert "pip install 'vllm==0.32.0'" in _message(report, "engine")


def test_no_engine_here_points_to_the_plugin_install(nb2):
    report = check_serving(nb2, tp=2, engine=MISSING)
    assert report["route"] == "plugin" and _statuses(report)["engine"] == "warn"
    assert "pip install 'bdlora-train[vllm]'" in _message(report, "engine")


def test_no_route_prints_a_flag_released_vllm_lacks(nb2, nb4):
    for adapter in (nb2, nb4):
        for engine in (ACTIVE, MISSING, UNTESTED):
            for tp in (1, 2, 4):
                report = check_serving(adapter, tp=tp, engine=engine)
                assert "--block-diagonal-sharded-loras" not in json.dumps(report)
                if report["command"] and not engine["active"] and engine["engine"]:
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
    tiny_config("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3).save_pretrained(tmp_path)
    dense = export(nb2, tmp_path / "dense", to="dense-lora")
    assert _statuses(check_serving(dense, tp=4, base=str(tmp_path), engine=ACTIVE))["kv_heads"] == "fail"
    assert _statuses(check_serving(dense, tp=6, base=str(tmp_path), engine=ACTIVE))["kv_heads"] == "ok"


def test_model_card_serving_lines_match_check_serving(nb2):
    lines = "\n".join(serving_lines("base/model", "me/x", r=48, nblocks=3, is_bdlora=True))
    assert "pip install 'bdlora-train[vllm]'" in lines and "--block-diagonal-sharded-loras" not in lines
    assert "--tensor-parallel-size 3 --max-lora-rank 16 --lora-modules bdlora=ADAPTER_DIR" in lines  # 48 / 3
    assert "hf download me/x --local-dir ADAPTER_DIR" in lines and "--max-lora-rank 64" in lines  # dense: r = 48
    report = check_serving(nb2, tp=2, engine=ACTIVE)  # the card gives the same TP and --max-lora-rank
    assert f"--tensor-parallel-size 2 --max-lora-rank {report['max_lora_rank']} --lora-modules" in model_card(nb2)
