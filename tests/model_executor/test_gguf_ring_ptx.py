"""The ring GEMV (`gguf_ring_gemv`, Gluon) compiled for sm_90 on this CPU box: what it may do before its PDL wait.

Before `griddepcontrol.wait` a program may only copy weights (`cp.async` into its ring: no kernel of a step
writes weights); the activations, its predecessor's output, are read after it, and nothing is stored. The
dependents' trigger is where the launch asks for it. Numbers are checked on the device
(tests/gpu/test_gguf_ring_gpu.py); Gluon has no interpreter."""

from __future__ import annotations

import re
from typing import Any

import pytest

from pagedllm.model_executor.layers.quantization import gguf_ring_gemv as rg

pytestmark = pytest.mark.skipif(not rg.HAS_GLUON, reason="needs a Triton with Gluon")

_MEM = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:ld|st|atom|red|cp\.async|prefetch)\.(?!param|shared|local|const)\S*", re.M)


def _ptx(qtype: int, k: int, trig: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    bn, bk, stages, warps, _, _ = rg.RingConfig()
    gs = bk // 32
    consts: dict[str, Any] = dict(
        K=k, QT=qtype, BN=bn, BK=bk, S=stages, L4=rg._compute_layout(gs, warps),
        CLW=rg._copy_layout(bn, gs * 4, 4, warps), CLD=rg._copy_layout(bn, gs // 8 if qtype == 12 else gs, 2, warps),
        CLS=rg._copy_layout(bn, gs, 1, warps), CLX=gl.BlockedLayout([4], [32], [warps], [0]),
        CLG=gl.BlockedLayout([1], [32], [warps], [0]), PDL=1, TRIG=trig, PRE=stages - 1,
    )  # fmt: skip
    ptrs = dict(xq_ptr="*i32", xd_ptr="*fp32", xs_ptr="*fp32", lo_ptr="*i32", d_ptr="*fp16", dm_ptr="*fp16")
    ptrs.update(sc_ptr="*u8", mn_ptr="*u8", out_ptr="*bf16")
    fn = rg._gguf_ring_gemv_kernel
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            constexprs[(i,)] = consts[name]
            continue
        signature[name] = ptrs.get(name, "i32")
        if name in ptrs or name.startswith("stride"):  # (as Triton specializes the real strides: all % 16)
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = GluonASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    except Exception as e:  # noqa: BLE001  (no NVIDIA backend / ptxas in this build)
        if "CompilationError" in type(e).__name__:
            raise
        pytest.skip(f"no sm_90 compile here: {type(e).__name__}: {str(e)[:200]}")
    return str(compiled.asm["ptx"])


@pytest.mark.parametrize("trig", [0, 1, 2])
@pytest.mark.parametrize(("qtype", "k"), [(3, 4096), (3, 14336), (12, 14336), (2, 4096)])
def test_ring_copies_only_weights_before_the_wait(qtype: int, k: int, trig: int) -> None:
    ptx = _ptx(qtype, k, trig)
    body = ptx[ptx.index("{", ptx.index(".entry")) :]
    wait = body.find("griddepcontrol.wait")
    assert wait >= 0, "the kernel never waits for its predecessor"
    before = [m.group(0).strip() for m in _MEM.finditer(body[:wait])]
    copies = [op for op in before if "cp.async" in op]
    assert copies, "no weight copied before the wait"
    assert all("cp.async" in op for op in before), f"other memory access before the wait: {before}"
    assert not re.search(r"^\s*(?:@!?%p\d+\s+)?ret\b", body[:wait], re.M), "a program returns before waiting"
    after = body[wait:]
    assert re.search(r"cp\.async\.c[ag]\.shared\.global", after), "the activations are not copied after the wait"
    assert ("griddepcontrol.launch_dependents" in body) == (trig > 0)
    # 16-byte copies of the weight words (the ring's point: bytes in flight without registers)
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], (?:16|0x10),", body)
