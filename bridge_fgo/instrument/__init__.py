"""How bridge_fgo reaches Megatron-Bridge's loop: the patch targets, the wrappers at the call sites, the
per-optimizer decision and its refusals, the Megatron-Core offload generations, and `bridge-fgo status`'s
diagnosis. Nothing here imports torch or Megatron at import time."""
