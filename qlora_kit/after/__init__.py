"""After training: what a trained adapter is used for.

- ``evaluate``: loss, perplexity and exact match on held-out rows; ``preference_eval``: the same for pairs;
  ``image_eval``: exact match on a vision-language model's rows with their images;
  ``grpo_eval``: a GRPO run's rewards on held-out prompts, greedy and sampled;
- ``generate``: answers to prompts wrapped as training saw them;
- ``merge``: the adapter merged into a 16-bit model, with a drift check (its bounds: ``drift_bounds``; a
  mixture's routing flipped at a near-tie, left out of it: ``routing_ties``);
- ``export``: a merged folder or a GGUF (``gguf_writer``, each architecture's form in ``gguf_families``, a
  mixture's experts in ``gguf_experts``, ``modelfile``), checked by ``parity`` against the floor its type sets (``floor``: the trained weights merged
  in fp32 and rounded as the export stores them; ``image_parity``: a vision-language run's image rows as
  its prompts; ``replay``: figures already computed, as readers) and, where installed, by llama.cpp
  (``llama_cpp_reader``); ``parity_judgement`` holds each reader to the bound derived for it.

A sub-package, not top-level modules: a module ``qlora_kit/evaluate.py`` would replace the package's
``qlora_kit.evaluate()`` function as an attribute the moment it is imported (the same holds for generate
and merge). Modules are imported by path; this file imports nothing.
"""
