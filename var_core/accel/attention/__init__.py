"""attention components: the sparse attention pattern of each block and scale (one per file; importing the package
registers nothing until a registry loads it). See :class:`var_core.accel.base.AttentionSparsity`."""
