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
    from bdlora_train.hub import check_adapter_dir, check_repo_id
    from bdlora_train.train.push import hub_card, push_adapter, record_in_run

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
    record_in_run(args.adapter, args.repo_id, url)
    if args.json:
        print(json.dumps({"adapter": args.adapter, "repo_id": args.repo_id, "url": url}))
    else:
        print(f"bdlora push: uploaded {args.adapter} -> {url}")
    return 0

