"""`bdlora push ADAPTER --repo-id me/name`: upload an adapter with its model card to the Hugging Face Hub."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bdlora_train.core.helptext import DefaultsHelpFormatter


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="bdlora push",
        description="Push an adapter dir (with a model card) to the Hub.",
    )
    parser.add_argument("adapter", help="adapter directory, e.g. runs/x/adapter")
    parser.add_argument("--repo-id", required=True, help="target model repo, e.g. me/llama-bdlora")
    parser.add_argument("--private", action="store_true", help="create the repo as private")
    parser.add_argument("--revision", default=None, help="branch to push to (default: main)")
    parser.add_argument(
        "--commit-message", default=None, help="Hub commit message (default: 'Upload BD-LoRA adapter (bdlora-train)')"
    )
    parser.add_argument(
        "--card-only", action="store_true", help="write README.md into the adapter dir and stop (no upload)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON: {adapter, repo_id, url or card}")
    args = parser.parse_args(argv)
    from bdlora_train.adapters.reader import read_adapter  # after parsing: `--help` loads no torch
    from bdlora_train.cards import CARD_NAME
    from bdlora_train.core.files import atomic_write_text
    from bdlora_train.hub import check_adapter_dir, check_repo_id, hub_card, push_adapter

    check_repo_id(args.repo_id)
    if args.card_only:
        check_adapter_dir(args.adapter)
        card = Path(args.adapter) / CARD_NAME  # the card that `bdlora push` uploads, written into the dir
        atomic_write_text(card, hub_card(args.adapter, read_adapter(args.adapter), args.repo_id))
        print(json.dumps({"adapter": args.adapter, "repo_id": args.repo_id, "card": str(card)}) if args.json else card)
        return 0
    url = push_adapter(
        args.adapter, args.repo_id, private=args.private, revision=args.revision, commit_message=args.commit_message
    )
    _record_in_run(args.adapter, args.repo_id, url)
    if args.json:
        print(json.dumps({"adapter": args.adapter, "repo_id": args.repo_id, "url": url}))
    else:
        print(f"bdlora push: uploaded {args.adapter} -> {url}")
    return 0


def _record_in_run(adapter: str, repo_id: str, url: str) -> None:
    """The adapter of a `bdlora train` run whose push to this repo failed (metrics.json: `"pushed": false`): record
    that it is pushed now, so re-running the train command finds nothing left to do."""
    from pathlib import Path

    from bdlora_train.train import rundir

    adapter_dir = Path(adapter)
    metrics_file = adapter_dir.parent / rundir.METRICS_NAME
    if adapter_dir.name != rundir.ADAPTER_NAME or not metrics_file.is_file():
        return
    try:
        metrics = json.loads(metrics_file.read_text())
    except (OSError, json.JSONDecodeError):
        return
    if isinstance(metrics, dict) and metrics.get("pushed") is False and metrics.get("hub_repo_id") == repo_id:
        rundir.record_push(adapter_dir.parent, metrics, repo_id, url)
