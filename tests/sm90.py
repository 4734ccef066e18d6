"""Compile a recorded launch for sm_90 on a machine without a GPU, as an engine's AOT build
does: the kernel tests that read PTX, TTGIR or SASS share this."""

from __future__ import annotations


def compile_for_sm90(spec, cache_dir):
    """The compiled kernel (its .asm holds ttgir, ptx, cubin) of a KernelSpec recorded by
    `recorded_launches()`, replayed through the AOT path and cached under cache_dir."""
    import triton
    from triton.compiler import make_backend

    from ingot.plugins import aot

    target = aot.parse_target("sm_90")
    _, src, options = aot._replay(spec, make_backend(target))
    with aot.use_cache_dir(cache_dir):
        return triton.compile(src, target=target, options=options.__dict__)
