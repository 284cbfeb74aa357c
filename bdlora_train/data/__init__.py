"""Reading training data: any dataset spec -> checked rows -> token ids with completion-only labels.

rows.py          `load_rows(DataSpec)`: prompt/completion, chat or text rows, checked; eval splits
sources.py       where a spec's rows come from (task:, glue:, packaged:, local files, save_to_disk dirs, the Hub)
formats.py       the formats converted to canonical rows (alpaca, sharegpt, messages, ...)
written_rows.py  local files read as written (row numbers and column names for error messages)
tokenize.py      tokens with completion-only labels, and the collator
"""
