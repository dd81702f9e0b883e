"""Triton attention kernels for framework, and the ``triton`` attention backend on them.

Importing this package imports neither Triton nor torch; the backend class is
``framework_triton_attention.backend:TritonAttnBackend``, registered in the
``framework.attention_backends`` entry-point group as ``triton``.
"""
