"""One adapter per way of moving optimizer states: each Megatron-Core generation, and the builtin engine."""
