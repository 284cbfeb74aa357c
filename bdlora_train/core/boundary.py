"""The error boundary of every command line the toolkit runs: `bdlora <command>` (cli.py) and torchrun's
`python -m bdlora_train.train` (train/__main__.py) both call `run_command`.

A `BlockDiagLoraError` (bad input, a setting that cannot work) and the failures a user can cause in other libraries
(a corrupt safetensors file, a Hub or network error, a full disk) print one line and exit 1; Ctrl-C exits 130.
A bad option (argparse) is such a user error too. Anything else is a bug and keeps its traceback. `--traceback`
shows the traceback of every error.

Under a launcher (torchrun, accelerate launch: RANK / LOCAL_RANK set) a refusal is said once: rank 0 prints the line
and writes it to torch elastic's error file (TORCHELASTIC_ERROR_FILE), so the launcher's own `ChildFailedError`
report, which torch prints whenever a rank exits nonzero (no rank can stop that), shows the line as its root cause;
a rank other than 0 waits, quiet, for the launcher to stop it once rank 0 has failed (all ranks check the same
recipe), and prints and records the line itself only if the launcher does not (a refusal of its own).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import time

from bdlora_train.core import launch_env
from bdlora_train.core.errors import BlockDiagLoraError, first_line

INTERRUPTED = 130
# How long a rank other than 0 waits, after a refusal, for the launcher to stop it (rank 0 refused too: the launcher
# stops every rank at once) before it prints the line itself (the refusal was its own). Every rank checks the same
# recipe at the same point, so rank 0 gets there within seconds; this bounds the case where it never does.
RANK_WAIT_S = 30.0


class UsageError(BlockDiagLoraError):
    """A command line argparse refuses (a bad value, a missing option)."""


def _installed(names) -> list[type[BaseException]]:
    """The exception classes ("module", "name") of the libraries installed here."""
    found = []
    for module, name in names:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return found


def network_errors() -> tuple[type[BaseException], ...]:
    """What a request to the Hub raises when the network or the server says no: OSError (huggingface_hub's
    HfHubHTTPError is one) and the transport errors of whichever HTTP client huggingface_hub uses on this install
    (httpx2 in huggingface_hub >= 1.x: ConnectError, ReadTimeout, ...; httpx or requests before), named by module."""
    return (OSError, *_installed((("httpx2", "HTTPError"), ("httpx", "HTTPError"), ("requests", "RequestException"))))


def user_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions a user can cause (bad files, network, disk), besides our own BlockDiagLoraError."""
    more = (
        ("safetensors", "SafetensorError"),
        ("huggingface_hub.errors", "HfHubHTTPError"),
        ("huggingface_hub.errors", "OfflineModeIsEnabled"),
    )
    return (BlockDiagLoraError, *network_errors(), *_installed(more))


def error_line(command: str, err: BaseException) -> str:
    """`bdlora <command>: error: <first line>`, without repeating a `<command>: ` prefix the message already has. Our
    own errors are whole (their fixes are commands that must run as printed); another library's line is cut."""
    text = first_line(err, limit=None if isinstance(err, BlockDiagLoraError) else 500)
    for prefix in (f"{command}: ", f"bdlora {command}: "):
        text = text.removeprefix(prefix)
    return f"bdlora {command}: error: {text}"


def default_deepspeed_accelerator() -> None:
    """DS_ACCELERATOR=cpu on machines without a GPU: what DeepSpeed picks there anyway, without its "Setting
    accelerator to CPU" warning, which every model save_pretrained would print (accelerate's unwrap imports
    DeepSpeed). Costs a torch import: skipped for `--help`, which never gets that far."""
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


@contextlib.contextmanager
def argparse_errors_raise():
    """argparse answers a bad option with the usage and exit 2; under the boundary every parser a command builds
    raises `UsageError` instead, so a bad option gets the one line and exit 1 of every other user error. One
    mechanism for all commands (those of commands/ and any parser they call), scoped to the command's run."""
    original = argparse.ArgumentParser.error

    def error(parser: argparse.ArgumentParser, message: str):
        raise UsageError(f"{message} (see `{parser.prog} --help`)")

    argparse.ArgumentParser.error = error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original


def run_command(name: str, target: str, argv: list[str], show_traceback: bool = False) -> int:
    """Run the command `name`, whose `main(argv) -> int` is `target` ("package.module:function", imported here, after
    library chatter is silenced), inside the error boundary; returns the exit code."""
    from bdlora_train.core.chatter import quiet_library_chatter

    quiet_library_chatter()
    if not {"-h", "--help"} & set(argv):
        default_deepspeed_accelerator()
    module_name, func_name = target.split(":")
    try:
        func = getattr(importlib.import_module(module_name), func_name)
        with argparse_errors_raise():
            return int(func(argv) or 0)
    except BrokenPipeError:  # `bdlora inspect ... | head`: the reader left; nothing to report
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        if show_traceback:
            raise
        print(f"\nbdlora {name}: interrupted; re-run the same command to resume", file=sys.stderr)
        return INTERRUPTED
    except user_error_types() as err:
        if show_traceback:
            raise
        report(error_line(name, err))
        return 1


def report(line: str) -> None:
    """Print a refusal's one line: once per run under a launcher (module docstring), as it is otherwise; on a line
    of its own (own_line), so `grep '^bdlora'` finds it after a progress bar."""
    if launch_env.local_rank() is not None:
        if not launch_env.is_main_process():
            _wait_for_the_launcher()  # usually ends here: the launcher stops this rank once rank 0 has failed
        _write_elastic_error_file(line)
    print(own_line(line), file=sys.stderr, flush=True)


def own_line(line: str) -> str:
    """`line` as printed to stderr so that it starts a line of its own: after a newline while a progress bar is open.
    A tqdm bar (the Trainer's, datasets', the sweeps') redraws itself with carriage returns and leaves the cursor at
    the end of its line until it closes; a bar a failing run left open is never closed. tqdm keeps its open bars in
    the class attribute `_instances` (no public accessor; tests/peft_integration/test_peft_contract.py checks it)."""
    tqdm = sys.modules.get("tqdm")  # no bar can be open where tqdm was never imported
    if tqdm is None:
        return line
    return f"\n{line}" if any(not bar.disable for bar in list(tqdm.tqdm._instances)) else line


def _write_elastic_error_file(line: str) -> None:
    """torch elastic's error file for this rank, in the format its ErrorHandler writes: the launcher shows
    `py_callstack` as the failure's traceback, here the one line."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OSError):
        with open(path, "w") as handle:
            json.dump(data, handle)


def _wait_for_the_launcher() -> None:
    """Sleep until the launcher stops this rank (SIGTERM, its default action: the rank ends, quiet) or RANK_WAIT_S
    passes."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with contextlib.suppress(KeyboardInterrupt):
        time.sleep(RANK_WAIT_S)
