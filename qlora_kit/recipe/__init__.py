"""The typed recipe: the one source of truth for a run's settings.

- ``base``: what every section shares (the pydantic base, local paths vs hub ids, one-line errors);
- ``data``: the data section (one path or a mixture of sources, formats, lengths, layout, preflight);
- ``preference``: the preference section (how ``train.objective: dpo`` scores pairs);
- ``memory``: the memory section (checkpointing per layer, offload, the chunked loss head);
- ``grpo``: the grpo section (how ``train.objective: grpo`` samples, scores and learns) and its rules;
- ``paths``: the recipe's input paths, listed in one place (``Recipe.input_paths``);
- ``recipe``: the other sections, the cross-section rules and YAML loading;
- ``objective_rules``: the rules ``train.objective`` sets across sections (formats, preference, GRPO);
- ``overrides``: ``--set`` at any depth, each value typed as its field takes it;
- ``options``: a command line's numeric option checked as the recipe checks the field it stands for;
- ``shipped``: the recipes shipped inside the package, found by name (``qlora-kit train demo``).

Modules are imported by path (``from qlora_kit.recipe.recipe import Recipe``; the public API exports
``qlora_kit.Recipe``); this file imports nothing.
"""
