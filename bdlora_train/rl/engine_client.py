"""HTTP to a running `vllm serve` (its OpenAI-compatible server): one request, its status and body text, and the
words for a server that did not answer. What the answers mean is read by the callers (server_check.py,
server_adapters.py, server_sampling.py).

Standard library only (urllib, no proxies: the server is reached directly, and a proxy would turn a dead server into
its own error page).

How a server that stops answers: killed (SIGKILL), the requests in flight lose their connection ("Remote end closed
connection without response"); stopped with Ctrl-C (SIGINT), they answer HTTP 500 "EngineCore encountered an
issue" (said as the server that stopped answering, too); with SIGTERM they were seen to wait until the process
ended. A server that never answers is given up after `timeout_s`.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request

from bdlora_train.core.errors import RolloutError, first_line

ENGINE_DEAD = "EngineCore encountered an issue"  # vLLM's EngineDeadError: the requests in flight when it stops
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class NoAnswer(Exception):
    """The connection failed, broke or timed out: `reason` in words."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class EngineClient:
    """HTTP to the server at `url` (http://host:port); `timeout_s`: the longest wait for one answer."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def call(self, method: str, path: str, body: dict | None, what: str, start: str) -> tuple[int, str]:
        """`request`; a lost connection, or an engine that died (vLLM's answer to the requests in flight when it is
        stopped), said as the server that stopped answering during `what` (`start`: the command that restarts it)."""
        try:
            status, text = self.request(method, path, body)
            if status >= 500 and ENGINE_DEAD in text:
                raise NoAnswer(f"its engine died (HTTP {status}: {error_reason(text)})")
            return status, text
        except NoAnswer as err:
            raise RolloutError(
                f"rollout server {self.url} stopped answering during {what}: {err.reason}; restart it ({start}) and "
                "run the same command again: the run resumes from its last checkpoint") from None

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, str]:
        """(HTTP status, body text), error statuses included; `NoAnswer` when no answer came."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
        try:
            with _OPENER.open(req, timeout=self.timeout_s) as resp:
                return resp.status, resp.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as err:
            try:
                return err.code, err.read().decode("utf-8", "replace")
            except (OSError, http.client.HTTPException) as broken:
                raise NoAnswer(_words(broken, self.timeout_s)) from None
        except urllib.error.URLError as err:
            raise NoAnswer(_words(err.reason, self.timeout_s)) from None
        except (OSError, http.client.HTTPException) as err:
            raise NoAnswer(_words(err, self.timeout_s)) from None


def _words(err, timeout_s: float) -> str:
    if isinstance(err, TimeoutError) or str(err) == "timed out":
        return f"no answer in {timeout_s:g} s"
    return first_line(err if isinstance(err, BaseException) else str(err)) or type(err).__name__


def json_object(text: str) -> dict:
    """An answer's JSON object ({} for anything else)."""
    try:
        out = json.loads(text)
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def error_reason(text: str) -> str:
    """An error answer's message (vLLM's {"error": {"message"}} or FastAPI's {"detail"}), as one line."""
    out = json_object(text)
    err = out.get("error")
    message = err.get("message") if isinstance(err, dict) else out.get("detail", text)
    return " ".join(str(message).split())[:600].rstrip(".") or "(empty answer)"
