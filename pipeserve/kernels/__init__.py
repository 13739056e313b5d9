"""C kernels for the CPU hot paths, compiled on first use (see ``build``)."""
