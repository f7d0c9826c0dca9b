"""Model weights on a node: where they come from, how they arrive, what they need.

`sources` parses a profile's `source:` (hf://, https://, a path, pkg:) and says which engines take it;
`download` makes a source local under the node's cache dir (`hub` through huggingface_hub's cache
layout, `url` with ranged requests), resuming and verifying, one download per file on a node
(`lock`); `cache` is the node's index of complete sources and the LRU eviction decision; `fit`
estimates what a profile needs from the weights' own headers (`gguf`, `safetensors`) and decides
whether it fits a GPU or a CPU node; `gpuhealth` turns NVML or nvidia-smi readings into a verdict per
GPU. The decisions are pure; the I/O is in thin shells with seams a test drives.
"""
