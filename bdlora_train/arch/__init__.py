"""How each decoder family is laid out under tensor parallelism, and exactly what an adapter request adapts.

Read from the model (transformers' TP plans and module shapes), never from PEFT:

  plans.py    transformers' plan styles, the plan of a config (plus families it ships without one), a module's role
  scope.py    the language model's decoder inside a (multimodal) model; routers; a module view for resolution
  fused.py    the segments of a fused column-parallel output, confirmed by probing a tiny model of the family
  targets.py  Target and resolve_targets: from what was asked to exactly what gets adapted, or one line why not
  checks.py   every alignment check (heads, ranks, segments, layer types) with its one-line refusal
"""
