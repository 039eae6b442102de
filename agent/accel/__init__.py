"""Accelerator stall-sample collectors: NVIDIA CUPTI PC sampling inside the target (an injection library
the agent builds and loads at start), and the Intel Xe EU stall stream the agent opens itself."""
