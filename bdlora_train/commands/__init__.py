"""The `bdlora` commands: argument parsing and text/JSON output, one module per command.

Each module has `main(argv) -> exit code` and calls library functions that know nothing of argparse or printing.
"""
