"""Hub failures through real HTTP: a local stand-in for the Hub (http.server in a thread) answering 401/403/409/429/5xx,
a closed port, an endpoint that never answers. Nothing of the toolkit or of huggingface_hub is mocked: only
huggingface_hub's endpoint is pointed at the stand-in (`constants.ENDPOINT` in-process, HF_ENDPOINT in subprocesses).
"""

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from huggingface_hub import constants

from bdlora_train import cli
from bdlora_train.core.errors import ModelSpecError
from bdlora_train.models import load_config, reach
from bdlora_train.train import Recipe, train

SECRET = "hf_secretTOKENvalue0123456789"
ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny" / "bdlora.yaml"

pytestmark = pytest.mark.usefixtures("one_thread")


class StandIn:
    """A local Hub: `status=None` answers create_repo / preupload / commit as the Hub does; an int answers every
    API call with that status (and a JSON error that echoes the bearer token, which must never reach the user)."""

    def __init__(self):
        self.status: int | None = None
        self.requests: list[tuple[str, str]] = []
        self.commits: list[dict] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                stand_in.requests.append(("HEAD", self.path))
                self.send_response(200)
                self.end_headers()

            def do_GET(self):
                self._answer("GET")

            def do_POST(self):
                self._answer("POST")

            def _answer(self, method):
                stand_in.requests.append((method, self.path))
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if stand_in.status is not None:
                    token = self.headers.get("Authorization", "").removeprefix("Bearer ")
                    error = {"error": f"refused for token {token}"}
                    if stand_in.status == 409:  # the Hub's "repo exists" answer names the repo (create_repo reads it)
                        error["url"] = f"{stand_in.url}/me/tiny-bdlora"
                    return self._json(stand_in.status, error)
                path = self.path.split("?")[0]
                if path == "/api/repos/create":
                    data = json.loads(body)
                    return self._json(200, {"url": f"{stand_in.url}/{data['organization']}/{data['name']}"})
                if path == "/api/validate-yaml":  # the model card's metadata, checked by the Hub at commit time
                    return self._json(200, {"warnings": []})
                if "/preupload/" in path:
                    files = json.loads(body)["files"]
                    return self._json(200, {"files": [
                        {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files
                    ]})
                if "/commit/" in path:
                    lines = [json.loads(line) for line in body.splitlines() if line.strip()]
                    stand_in.commits.append({"path": path, "files": [
                        x["value"]["path"] for x in lines if x.get("key") == "file"
                    ]})
                    repo = path.removeprefix("/api/models/").split("/commit/")[0]
                    return self._json(200, {"commitUrl": f"{stand_in.url}/{repo}/commit/abc123", "commitOid": "abc123"})
                return self._json(404, {"error": f"not found: {method} {path}"})

            def _json(self, status, data):
                payload = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there now: connection refused at once


@pytest.fixture
def stand_in():
    hub = StandIn()
    yield hub
    hub.close()


@pytest.fixture
def online(monkeypatch):
    """The Hub reachable as far as configuration goes (no offline mode, a token); `point(url)` picks the endpoint."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", SECRET)

    def point(url: str) -> None:
        monkeypatch.setattr(constants, "ENDPOINT", url)
        reach.forget()

    yield point
    reach.forget()


def _env(endpoint: str, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    return {**env, "HF_ENDPOINT": endpoint, "HF_TOKEN": SECRET, "PYTHONPATH": str(ROOT), **extra}


def _bdlora(args, env, cwd=ROOT, timeout=300):
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "bdlora_train.cli", *args], env=env, cwd=cwd, capture_output=True, text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - started


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    out = tmp_path_factory.mktemp("hubfail") / "run"
    recipe = Recipe(
        model="tiny:llama", dataset="packaged:tiny_sums.jsonl", nblocks=2, lora_r=4, max_steps=1, save_steps=0,
        output_dir=str(out), match_budget_of_lora_rank=None,
    )
    result = train(recipe)
    assert "pushed" not in result.metrics and "hub_url" not in result.metrics  # push_to_hub=false: unaffected
    return result.adapter_dir


def _one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert SECRET not in err
    return err


@pytest.mark.parametrize(
    ("status", "says"),
    [
        (401, r"refused the token \(401.*hf auth login"),
        (403, r"may not write to me/tiny-bdlora \(403.*write access to 'me'"),
        (409, r"conflict \(409.*exists with other content.*another --repo-id"),
        (429, r"rate limited by the Hub \(429.*wait a few minutes"),
        (500, r"server error \(500"),
        (503, r"server error \(503"),
    ],
)
def test_every_hub_refusal_is_one_line_naming_repo_and_fix_without_the_token(
    adapter, stand_in, online, capsys, status, says
):
    online(stand_in.url)
    stand_in.status = status
    started = time.monotonic()
    code = cli.main(["push", str(adapter), "--repo-id", "me/tiny-bdlora"])
    elapsed = time.monotonic() - started
    out = capsys.readouterr()
    assert code == 1
    err = _one_line(out.err)
    assert SECRET not in out.out
    assert "me/tiny-bdlora" in err and re.search(says, err), err
    assert f"then retry `bdlora push {adapter} --repo-id me/tiny-bdlora`" in err
    assert "<token>" in err  # the stand-in echoed the token back; the message shows a placeholder
    assert any(method == "POST" for method, _ in stand_in.requests)  # it really went over HTTP
    assert elapsed < 20, elapsed  # create_repo is not retried: no 1+2+4+8+8 s of backoff


def test_unreachable_endpoint_answers_in_seconds_in_process(adapter, online, capsys):
    online(_closed_port())
    started = time.monotonic()
    assert cli.main(["push", str(adapter), "--repo-id", "me/tiny-bdlora"]) == 1
    elapsed = time.monotonic() - started
    err = _one_line(capsys.readouterr().err)
    assert "unreachable" in err and constants.ENDPOINT in err and "me/tiny-bdlora" in err
    assert elapsed < 5, elapsed


def test_endpoint_that_never_answers_is_given_up_after_the_probe_timeout(adapter, online, capsys):
    silent = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        online(f"http://127.0.0.1:{silent.getsockname()[1]}")
        started = time.monotonic()
        assert cli.main(["push", str(adapter), "--repo-id", "me/tiny-bdlora"]) == 1
        elapsed = time.monotonic() - started
    finally:
        silent.close()
    err = _one_line(capsys.readouterr().err)
    assert f"no answer within {reach.PROBE_TIMEOUT_S:g} s" in err
    assert elapsed < reach.PROBE_TIMEOUT_S + 5, elapsed


def test_unreachable_hub_push_from_the_command_line_is_one_line_without_traceback(adapter):
    proc, _ = _bdlora(["push", str(adapter), "--repo-id", "me/tiny-bdlora"], _env(_closed_port()))
    assert proc.returncode == 1, proc.stderr
    err = _one_line(proc.stderr)
    assert "ConnectError" in err and "unreachable" in err and "Retrying" not in err
    assert SECRET not in proc.stdout


def test_push_names_a_missing_directory_and_a_merged_model(tmp_path, online, capsys):
    online(_closed_port())
    assert cli.main(["push", str(tmp_path / "nonexist"), "--repo-id", "me/x"]) == 1
    err = _one_line(capsys.readouterr().err)
    assert "does not exist" in err and "adapter_config.json" not in err
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / "config.json").write_text('{"model_type": "llama"}')
    (merged / "model.safetensors").write_bytes(b"")
    for extra in ([], ["--card-only"]):
        assert cli.main(["push", str(merged), "--repo-id", "me/x", *extra]) == 1
        err = _one_line(capsys.readouterr().err)
        assert "is a merged model" in err and "hf upload" in err, err


def test_push_and_card_only_say_exactly_what_the_directory_is(tmp_path, online, capsys):
    """Issue 30: the whole line, for a missing path and a file, with and without --card-only (no upload tried)."""
    online(_closed_port())
    missing, a_file = tmp_path / "nonexist", tmp_path / "adapter.txt"
    a_file.write_text("not an adapter")
    for extra in ([], ["--card-only"]):
        assert cli.main(["push", str(missing), "--repo-id", "me/x", *extra]) == 1
        assert capsys.readouterr().err == (
            f"bdlora push: error: {missing} does not exist; pass the adapter directory of a run (e.g. runs/x/adapter)\n"
        )
        assert cli.main(["push", str(a_file), "--repo-id", "me/x", *extra]) == 1
        assert capsys.readouterr().err == (
            f"bdlora push: error: {a_file} is not a directory; pass the adapter directory (e.g. runs/x/adapter)\n"
        )
    assert not missing.exists()


def test_push_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        cli.main(["push", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--commit-message COMMIT_MESSAGE Hub commit message" in text


def test_failed_push_after_training_is_recorded_retried_by_the_printed_line_and_by_rerunning(
    tmp_path, stand_in, online, capsys
):
    out = tmp_path / "run"
    command = ["train", str(RECIPE), "push_to_hub=true", "hub_model_id=me/tiny-bdlora", f"output_dir={out}",
               "max_steps=2", "save_steps=0"]
    online(stand_in.url)
    stand_in.status = 503
    assert cli.main(command) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert SECRET not in err and "server error (503" in err
    assert (out / "adapter" / "adapter_model.safetensors").is_file()  # the run keeps its adapter
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["pushed"] is False and metrics["hub_repo_id"] == "me/tiny-bdlora" and metrics["hub_url"] is None
    retry = re.search(r"then retry `(bdlora push [^`]+)`", err).group(1)
    assert retry == f"bdlora push {out / 'adapter'} --repo-id me/tiny-bdlora"

    # the same train command again: the push it owes is retried, nothing is trained
    steps = metrics["train_wall_time_s"]
    assert cli.main(command) == 1
    err = capsys.readouterr().err
    assert "not yet pushed to me/tiny-bdlora; pushing it" in err and "nothing to do" not in err
    assert json.loads((out / "metrics.json").read_text())["train_wall_time_s"] == steps

    # the printed line, run as printed against the Hub now answering
    stand_in.status = None
    proc, _ = _bdlora(shlex.split(retry)[1:], _env(stand_in.url))
    assert proc.returncode == 0, proc.stderr
    assert SECRET not in proc.stdout + proc.stderr
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= set(stand_in.commits[-1]["files"])
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["pushed"] is True and metrics["hub_url"].endswith("/me/tiny-bdlora/commit/abc123")
    assert cli.main(command) == 0
    assert "nothing to do" in capsys.readouterr().err


def test_rerunning_train_retries_the_push_and_records_it(tmp_path, stand_in, online, capsys):
    out = tmp_path / "run"
    recipe = Recipe(
        model="tiny:llama", dataset="packaged:tiny_sums.jsonl", nblocks=2, lora_r=4, max_steps=1, save_steps=0,
        output_dir=str(out), push_to_hub=True, hub_model_id="me/again",
    )
    online(_closed_port())
    with pytest.raises(Exception, match=r"unreachable.*then retry `bdlora push .*adapter --repo-id me/again`"):
        train(recipe)
    assert json.loads((out / "metrics.json").read_text())["pushed"] is False
    online(stand_in.url)
    result = train(recipe)
    assert result.trained is False and result.metrics["pushed"] is True
    assert json.loads((out / "metrics.json").read_text())["hub_url"].endswith("/me/again/commit/abc123")
    assert len(stand_in.commits) == 1
    capsys.readouterr()
    train(recipe)
    assert "nothing to do" in capsys.readouterr().err and len(stand_in.commits) == 1


def test_hub_ids_answer_in_seconds_when_the_hub_is_unreachable(online):
    online(_closed_port())
    started = time.monotonic()
    config = load_config("meta-llama/Llama-3.1-8B")  # the bundled snapshot answers
    assert config.num_hidden_layers == 32
    with pytest.raises(ModelSpecError, match=r"the Hub at http://127\.0\.0\.1:\d+ is unreachable .*not in the local"):
        load_config("nosuch-org/nosuch-model")
    assert time.monotonic() - started < 5
    assert reach.cache_only("./local/dir") == {} and reach.cache_only("tiny:llama") == {}


def test_unknown_hub_id_from_the_command_line_is_one_line_without_retries(tmp_path):
    proc, _ = _bdlora(
        ["budget", "--model", "nosuch-org/nosuch-model", "--lora-ranks", "8"],
        _env(_closed_port(), HF_HOME=str(tmp_path / "hf")),
    )
    assert proc.returncode == 1
    err = _one_line(proc.stderr)
    assert "unreachable" in err and "hf download nosuch-org/nosuch-model" in err and "Retrying" not in err


def test_check_serving_is_not_ok_about_a_hub_it_cannot_reach(adapter, online, capsys):
    online(_closed_port())
    cli.main(["check-serving", str(adapter), "--tp", "1", "--model", "meta-llama/Llama-3.1-8B", "--json"])
    report = json.loads(capsys.readouterr().out)
    loadable = next(c for c in report["checks"] if c["check"] == "loadable")
    assert loadable["status"] == "fix" and "unreachable" in loadable["message"]
    assert "hf download meta-llama/Llama-3.1-8B" in loadable["message"] and not report["ready"]


def test_an_adapter_save_with_the_hub_out_of_reach_warns_nothing(tmp_path):
    """PEFT's save looks the base's config.json up on the Hub (a resized vocabulary?); out of reach without
    HF_HUB_OFFLINE it warns "Unable to fetch remote file ...", which the toolkit's saves drop (quiet_peft_save): the
    same save outside it warns, in a subprocess pointed at a closed port."""
    code = (
        "import warnings\n"
        "from peft import LoraConfig, get_peft_model\n"
        "from bdlora_train.models import build_tiny_model\n"
        "from bdlora_train.peft_integration.storage import quiet_peft_save\n"
        "model = build_tiny_model('llama')\n"
        "peft = get_peft_model(model, LoraConfig(r=2, target_modules=['q_proj']))\n"
        "peft.peft_config['default'].base_model_name_or_path = 'HuggingFaceTB/SmolLM2-135M-Instruct'\n"
        "for quiet, out in ((True, 'a'), (False, 'b')):\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        warnings.simplefilter('always')\n"
        "        with quiet_peft_save() if quiet else warnings.catch_warnings():\n"
        f"            peft.save_pretrained({str(tmp_path)!r} + '/' + out)\n"
        "    print(quiet, sum('Unable to fetch remote file' in str(w.message) for w in caught))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=_env(_closed_port()), capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "0", "False", "1"], proc.stdout + proc.stderr[-1000:]
