"""The registries: tables every layer reads, one entry per extension (standard library only).

- ``formats``: one ``FormatSpec`` per ``data.format``, the Alpaca template and the plain system prefix;
- ``optimizers``: one ``OptimizerSpec`` per ``optimizer.name`` (class, paged, 8-bit, state bytes);
- ``attention``: the attention kernels a recipe may name, what each needs, how packed rows reach it;
- ``rewards``: one ``RewardSpec`` per builtin reward of ``grpo.rewards`` (its arguments, what it scores);
- ``metric_keys``: the names of the figures a run writes to ``metrics.jsonl`` and reads back;
- ``families``: one ``Family`` per model_type (layer names, MLP shape, GGUF form or why none, tiny config);
- ``family_traits``: what an entry is made of (``Family`` and its facets) and the traits read across families;
- ``shared_facets``: facet values several entries reuse (Llama's linears and GGUF form, Qwen-VL's vision side);
- ``objectives``: one ``ObjectiveSpec`` per ``train.objective`` (its traits and the module that builds it);
- ``checkpointing``: one ``PolicySpec`` per ``memory.checkpointing`` (how it expands per layer, what a
  layer keeps, its recompute share, its context function).

Adding a format, an optimizer, a kernel, a model family, an objective or a checkpointing policy is one
entry here plus its module and its tests. Modules are imported by path;
this file imports nothing.
"""
