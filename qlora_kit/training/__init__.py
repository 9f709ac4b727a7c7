"""The training family: a run from recipe to saved adapter, and everything that watches it, by kind.

Assembling a run, here at the top:

- ``pipeline``: ``build(recipe)`` sets a run up stage by stage, ``run(recipe)`` trains and saves;
- ``resolved``: what a recipe leaves to the machine, data or launch (precision, layout, checkpointing
  auto, the objective, the launch), resolved once into one object every later stage reads;
- ``objective_trainer``: ``train.objective`` -> its module (each imported explicitly, on first use) and
  the Trainer that runs it, with qlora_kit's callbacks;
- ``sample_prompts``: the validation prompts a run answers before and after training;
- ``batch_layout``: ``data.packing: auto``'s stage: the data's layouts (data/layout.py) timed
  (memory/layout_costs.py) or read back from a checkpoint, and the choice;
- ``recipe_plan``: what ``qlora-kit plan`` plans: the batch the run will have (from its data when read),
  the loss head auto resolves to, the planner's figures;
- ``distributed``: what one process of several does differently (DDP, FSDP2): the ranks, the launch's
  FSDP settings, a flag or a figure gathered over the ranks (the step and ``watch/`` both read it);
- ``compiled``: ``train.compile``'s mechanism: each decoder layer compiled (one graph for all), the layers
  left eager and why, and whether the device's compiler works;
- ``compile_choice``: ``train.compile`` resolved (``auto``: a timed eager and compiled step against the
  planned steps) and applied before step 1.

And four sub-packages, each listing its modules:

- ``step/``: the Trainer subclass and one training step (guards, interrupts, out-of-memory recovery);
- ``objectives/``: each ``train.objective``'s module (sft, dpo, kto, ``grpo/``) and what they share;
- ``watch/``: what a run reports while it trains (metrics file, throughput, trackers, experts' routing,
  console, log);
- ``run_folder/``: the output folder (policy, atomic checkpoints), the manifest and the run read back.

(``data.packing: auto``'s timing is ``memory/layout_costs``, beside checkpointing auto's
``memory/layer_costs``.) Modules are imported by path (``from qlora_kit.training import pipeline``); this
file imports nothing.
"""
