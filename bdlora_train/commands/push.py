"""`bdlora push ADAPTER --repo-id me/name`: upload an adapter with its model card to the Hugging Face Hub."""

from __future__ import annotations

import argparse

from bdlora_train.adapters import read_adapter
from bdlora_train.hub import push_adapter, write_model_card


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="bdlora push", description="Push an adapter dir (with a model card) to the Hub."
    )
    parser.add_argument("adapter", help="adapter directory, e.g. runs/x/adapter")
    parser.add_argument("--repo-id", required=True, help="target model repo, e.g. me/llama-bdlora")
    parser.add_argument("--private", action="store_true", help="create the repo as private")
    parser.add_argument("--revision", default=None, help="branch to push to (default: main)")
    parser.add_argument("--commit-message", default=None)
    parser.add_argument(
        "--card-only", action="store_true", help="write README.md into the adapter dir and stop (no upload)"
    )
    args = parser.parse_args(argv)
    if args.card_only:
        read_adapter(args.adapter)
        print(write_model_card(args.adapter, repo_id=args.repo_id))
        return 0
    url = push_adapter(
        args.adapter, args.repo_id, private=args.private, revision=args.revision, commit_message=args.commit_message
    )
    print(f"bdlora push: uploaded {args.adapter} -> {url}")
    return 0
