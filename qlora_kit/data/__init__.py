"""The data family: rows in, tokenized (and packed) training and validation sets out.

- ``formats``: each format's rendering (trained segments), its prompt for generation, tokenizing with
  labels (which formats exist is ``registries/formats``);
- ``chat``: chat-template rendering and where the trained assistant spans are; ``segments``: the pieces;
- ``preference``: preference pairs and labelled answers rendered and checked; ``feedback``: labelled
  answers as TRL's KTOTrainer reads and tokenizes them (KTO's data); ``prompts``: prompts and references for GRPO;
- ``rewards``: GRPO's reward functions, scoring completions against the references (training and
  evaluation both score with them);
- ``demo``: the builtin demo datasets and their files; ``shapes``: the vision-language demo's images;
- ``images``: chat rows with images for a vision-language model (image runs, text-side cuts, the collator);
  ``mrope``: an M-RoPE family's (Qwen-VL) packed rows, each example's 3-D positions as it has them alone;
- ``sources``: loading a source's rows through ``datasets`` (files, shard folders, the hub, builtin);
- ``row_tokens``: one row's token ids, masked labels and the facts the reports and the preflight read;
- ``mixture``: the data path every objective takes: each source split, in the objective's row format,
  mixed (``weight``, ``rows``), deduplicated and reported; ``PreparedData``, ``LengthReport``;
  ``format_hints``: which other format a refused row is in, named at the end of its error;
- ``prepare``: SFT's, DPO's and ORPO's row format (tokenizing under the length policy), collators; ``prompt_examples``:
  rows as a prompt and the reference answer (eval's exact match, answers before/after, parity);
- ``preflight``: the checks that stop a run whose data trains on nothing;
- ``packing``: best-fit packing of examples into rows, and the packed-row collator;
- ``layout``: ``data.packing: auto``, the layout (padding, group_by_length, packing) timed fastest, or that pads least;
- ``errors``: the diagnosis of a file that does not load (``DataError`` is in ``qlora_kit.errors``);
- ``report``: what ``qlora-kit data`` shows.

Modules are imported by path (``from qlora_kit.data import prepare``); this file imports nothing.
"""
