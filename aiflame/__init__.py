"""aiflame: a low-overhead eBPF profiling agent for AI hosts."""

__version__ = "0.1.0"
