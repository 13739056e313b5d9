"""Weights kept quantized in memory: GGUF block types as shipped, int8/int4 at load.

``packed`` defines the two in-memory layouts, ``gguf_repack`` maps GGUF block
types onto them, ``modules`` are the linear/embedding layers that read them,
``cpu_kernels`` binds the C kernels (pipeserve/kernels/quant_matmul.c) and
``load`` builds a stage without allocating a ``--dtype`` copy of any weight.
"""
