"""After training: ``evaluate`` (loss, perplexity, exact match), ``generate`` (and the chat loop's
completion) and ``merge`` (export with a drift check). A sub-package, not top-level modules: a module
``qlora_kit/evaluate.py`` would replace the package's ``qlora_kit.evaluate()`` function as an
attribute the moment it is imported (the same holds for generate and merge)."""
