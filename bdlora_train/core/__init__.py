"""The pure core: names, head counts, block layout, the parameter formula, errors and atomic files.

Nothing here imports PEFT, transformers or any other bdlora_train package; every layer above builds on it.

  errors.py   BlockDiagLoraError and its subclasses (every user-facing error), first_line()
  files.py    atomic writes, output-path safety
  naming.py   module-name rules: dotted-suffix matching, PEFT's substring role rule, wrapper levels, family aliases
  heads.py    attention / KV head counts, the TP degrees that split them, the default nblocks
  blocks.py   roles, which rows and rank columns a TP rank owns, packed <-> dense factors, the parameter formula
  layout.py   Layout: where a TP-sharded layer splits and which factor is block-diagonal; expert (E, d1, d2) axes
  dtypes.py   torch dtype names
  helptext.py `--help`: every option's default, spelled as the user types it (null, true, false)
"""
