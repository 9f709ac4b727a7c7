"""The memory family: what a run keeps on the device and how qlora_kit decides and measures it.

- ``checkpointing``: the activation-checkpointing policy applied to the decoder layers (none, selective,
  full, or one per layer);
- ``selective``: the selective policy's op-level choice: keep the 4-bit matmuls' and attention's outputs,
  recompute the cheap ops;
- ``offload``: offloaded checkpoints, each checkpointed layer's saved input in host memory until backward;
- ``experts_on_host``: a mixture's frozen experts in host memory, a layer at a time on the device;
- ``tiled_mlp``: each decoder layer's MLP in sequence tiles, each recomputed on its own;
- ``attention_fit``: a quadratic attention kernel refused at a length whose scores would not fit;
- ``optimizers``: building the recipe's optimizer, its state report, re-paging after a resume (which
  optimizers exist is ``registries/optimizers``);
- ``loss_head``: the chunked, recomputed output head and loss;
- ``accounting``: bytes saved for backward, CUDA peaks per phase;
- ``monitor``: the Trainer callback that records them at each log (``metrics.jsonl`` is
  ``training/watch/metrics_log``);
- ``shapes``: a model's shapes and weight bytes from its config alone;
- ``tracing``: the bytes each decoder layer keeps, traced on fake tensors through the run's own code;
  ``fake_forward``: one such traced forward pass, counted;
- ``saved_by_op``: what a real forward saved and what the trace counted, per op and module, side by side;
- ``formula``: the planner's closed forms (the Llama-shaped fallback, the loss head's selection);
- ``planner``: peak memory predicted per policy; ``pixels``: a vision-language batch's images in it;
  ``kept_activations``: what each policy keeps, per layer and in the head; ``experts_plan``: a mixture's
  experts in it (memory.experts_on_host's host and device split, their load and their working set);
- ``max_length``: the longest row each way of keeping activations fits (``plan --max-seq-len``);
- ``auto``: ``checkpointing: auto`` resolved from the plan, layer by layer;
- ``layer_choice``: auto's search for each layer's policy (least recompute cost within a byte budget);
- ``layer_costs``: auto's recompute costs, timed once per run on its device (kept in every checkpoint);
- ``layout_costs``: ``data.packing: auto``'s real tokens a second per layout, timed on batches of the
  run's own data that data/layout.py lays out (kept in every checkpoint); memory/ imports nothing from
  data/, the stage that joins them is training/batch_layout.py;
- ``cut_model``: a few of the run's decoder layers built at random and loaded as the run loads them, and
  the clock that times them (for ``layer_costs`` and ``layout_costs``);
- ``saved_facts``: writing and reading those measured figures beside a checkpoint;
- ``fault_seam``: the one point where a test's fault injector (qlora_kit/testing/) enters a run, read as
  the run is built; none unless a test installs one;
- ``device_kernels``: the attention kernel the target device runs, for the planner's trace;
- ``loss_choice``: ``memory.chunked_loss: auto``, full logits where the plan with them fits.

Arrows: auto -> planner; auto -> layer_choice; auto -> layer_costs -> cut_model -> tracing, checkpointing; layout_costs -> cut_model; layer_costs, layout_costs -> saved_facts; planner -> formula; planner -> pixels; planner -> experts_plan; planner -> kept_activations -> tracing -> fake_forward -> checkpointing; saved_by_op -> fake_forward -> selective -> accounting;
checkpointing -> offload, tiled_mlp, fault_seam; max_length -> planner; monitor -> accounting; fault_seam -> accounting. Modules are imported by
path (``from qlora_kit.memory import planner``); this file imports nothing.
"""
