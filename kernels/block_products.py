"""The precision of the CPU block kernels' products (``kernels.block_matmul_cpu``): float32, or
bfloat16 where the CPU has AVX-512 BF16 (x and the weights rounded to bf16, float32 sums). One
choice for edged's int4 on a CPU, both backends: ``[backend] products``, ``--products``.

``auto`` picks bfloat16 where this build has those products, as cloudd's dtype ``auto`` does
(``shared.engine.dtype_choice``); the kernels are built with ``-march=native``, so "built" is
"this CPU has AVX-512 BF16". Light to import (no Triton): the configs and CLIs check names here.
"""

from __future__ import annotations

from kernels.cpu_extension import cpu_kernels

PRODUCTS = ("auto", "float32", "bfloat16")


def check_products(name: str) -> str:
    """``name`` when it is one of ``PRODUCTS``; else ValueError naming them."""
    if name not in PRODUCTS:
        raise ValueError(f"products must be one of {', '.join(PRODUCTS)}, got products={name!r}")
    return name


def bf16_products_built() -> bool:
    """Whether the block kernels have bfloat16 products here (the CPU kernels built for a CPU
    with AVX-512 BF16)."""
    module = cpu_kernels()
    return module is not None and module.block_products_bf16_built()


def resolve_products(name: str) -> str:
    """``name`` (one of ``PRODUCTS``) as "float32" or "bfloat16": ``auto`` is bfloat16 where
    ``bf16_products_built()``, else float32. Raises ValueError for another name, or for
    bfloat16 where it is not built."""
    if check_products(name) == "auto":
        return "bfloat16" if bf16_products_built() else "float32"
    if name == "bfloat16" and not bf16_products_built():
        raise ValueError("products bfloat16 needs a CPU with AVX-512 BF16 (and the CPU kernels built)")
    return name
