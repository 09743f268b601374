"""Attention kernels on CUDA against the float32 math: SDPA flash, SDPA cuDNN, compiled flex, flash-attn.

Each kernel runs in bf16 on (batch 2, 16 query heads, seq 1024, head_dim 128), with 16 or 4 (GQA)
key/value heads, forward and backward; the reference is the attention written out in float32 from
the same bf16 inputs with an explicit boolean mask. A reference with a wrong mask must land far
outside the tolerance, so that a kernel ignoring its mask fails.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask

from titan_models import document_ids, llama3_args
from titan_models.attention import attend
from titan_models.attention_masks import build_attention_mask

pytestmark = pytest.mark.gpu

BATCH, HEADS, SEQ, HEAD_DIM = 2, 16, 1024, 128
# Relative error norms of bf16 kernels against float32 math: 2e-3 to 3e-3 on an H100 (bf16 keeps 8 bits).
KERNEL_TOLERANCE = 1e-2
EOS = 1
# Packed documents of each row (lengths sum to SEQ): boundaries off the 128-token flex blocks.
DOCUMENTS = ([300, 200, 400, 124], [100, 517, 407])


def _inputs(kv_heads: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(heads: int) -> torch.Tensor:
        return torch.randn(BATCH, heads, SEQ, HEAD_DIM, generator=g, device="cuda", dtype=torch.bfloat16)

    return randn(HEADS), randn(kv_heads), randn(kv_heads), randn(HEADS)  # q, k, v, grad of the output


def _causal_mask() -> torch.Tensor:
    return torch.ones(SEQ, SEQ, dtype=torch.bool, device="cuda").tril()[None, None]


def _block_causal_mask() -> torch.Tensor:
    """(BATCH, 1, SEQ, SEQ): causal within each document of DOCUMENTS, nothing across documents."""
    mask = torch.zeros(BATCH, 1, SEQ, SEQ, dtype=torch.bool, device="cuda")
    for row, lengths in enumerate(DOCUMENTS):
        start = 0
        for n in lengths:
            mask[row, 0, start : start + n, start : start + n] = torch.ones(n, n, dtype=torch.bool).tril()
            start += n
    return mask


def _packed_tokens() -> torch.Tensor:
    """Token ids of DOCUMENTS: random ids above EOS, each document closed by EOS."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for lengths in DOCUMENTS:
        docs = [
            torch.cat([torch.randint(EOS + 1, 2048, (n - 1,), generator=g), torch.tensor([EOS])])
            for n in lengths
        ]
        rows.append(torch.cat(docs))
    return torch.stack(rows).cuda()


def _math_reference(q, k, v, grad_out, mask: torch.Tensor):
    """Output and (dq, dk, dv) of softmax(q kᵀ/√d + mask) v in float32, key/value heads repeated for GQA."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    n_rep = q.shape[1] // k.shape[1]
    keys, values = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    scores = q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1])
    out = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ values
    out.backward(grad_out.float())
    return out.detach(), (q.grad, k.grad, v.grad)


def _run_kernel(kernel, q, k, v, grad_out):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = kernel(q, k, v)
    out.backward(grad_out)
    assert out.dtype == torch.bfloat16
    return out.detach(), (q.grad, k.grad, v.grad)


def _check_against_math(kernel, kv_heads, mask, wrong_mask, report, rel_error) -> None:
    q, k, v, grad_out = _inputs(kv_heads)
    out, grads = _run_kernel(kernel, q, k, v, grad_out)
    ref_out, ref_grads = _math_reference(q, k, v, grad_out, mask)
    wrong_out, _ = _math_reference(q, k, v, grad_out, wrong_mask)
    errors = {"out": rel_error(out, ref_out)}
    errors.update({f"d{name}": rel_error(g, r) for name, g, r in zip("qkv", grads, ref_grads, strict=True)})
    wrong = rel_error(out, wrong_out)
    report(kv_heads=kv_heads, **errors, out_error_against_wrong_mask=wrong)
    assert max(errors.values()) < KERNEL_TOLERANCE, errors
    assert wrong > 10 * KERNEL_TOLERANCE, f"a wrong mask gives only {wrong:.3g}: the comparison cannot fail"


@pytest.mark.parametrize("kv_heads", [HEADS, 4])
def test_sdpa_flash_backend_matches_float32_math_forward_and_backward(kv_heads, report, rel_error):
    def kernel(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return attend(q, k, v, "sdpa", None)  # Titan's path: causal, GQA by repeating kv heads

    full = torch.ones_like(_causal_mask())
    _check_against_math(kernel, kv_heads, _causal_mask(), full, report, rel_error)


def _cudnn_attention_runs() -> str | None:
    """None if cuDNN SDPA runs a small causal bf16 forward here, else why not."""
    if not torch.backends.cudnn.is_available():
        return "cuDNN is not available to torch"
    q = torch.randn(1, 2, 128, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
    except RuntimeError as err:
        return f"cuDNN SDPA unavailable: {str(err).splitlines()[0]}"
    return None


@pytest.mark.parametrize("kv_heads", [HEADS, 4])
def test_sdpa_cudnn_backend_matches_float32_math_forward_and_backward(kv_heads, report, rel_error):
    why_not = _cudnn_attention_runs()
    if why_not:
        pytest.skip(why_not)

    def kernel(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return attend(q, k, v, "sdpa", None)

    full = torch.ones_like(_causal_mask())
    _check_against_math(kernel, kv_heads, _causal_mask(), full, report, rel_error)


def test_document_ids_of_packed_tokens_follow_the_documents():
    expected = [torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]) for lengths in DOCUMENTS]
    assert torch.equal(document_ids(_packed_tokens(), EOS).cpu(), torch.stack(expected).to(torch.int32))


@pytest.mark.parametrize("kv_heads", [HEADS, 4])
def test_compiled_flex_block_causal_matches_float32_math_forward_and_backward(kv_heads, report, rel_error):
    args = replace(llama3_args("debugmodel"), attn_backend="flex", attn_mask_type="block_causal", eos_id=EOS)
    block_mask = build_attention_mask(args, document_ids(_packed_tokens(), EOS), "cuda")
    assert isinstance(block_mask, BlockMask)

    def kernel(q, k, v):
        return attend(q, k, v, "flex", block_mask)  # compiled flex attention on CUDA

    # Plain causal attention crosses the document boundaries: the wrong answer here.
    _check_against_math(kernel, kv_heads, _block_causal_mask(), _causal_mask(), report, rel_error)


@pytest.mark.parametrize("kv_heads", [HEADS, 4])
def test_flash_attn_matches_float32_math_forward_and_backward(kv_heads, report, rel_error):
    pytest.importorskip("flash_attn", reason="the flash-attn package (flash_attn) is not installed")

    def kernel(q, k, v):
        return attend(q, k, v, "flash", None)

    full = torch.ones_like(_causal_mask())
    _check_against_math(kernel, kv_heads, _causal_mask(), full, report, rel_error)


@pytest.mark.parametrize("kv_heads", [HEADS, 4])
def test_varlen_attention_matches_float32_block_causal_math_forward_and_backward(kv_heads, report, rel_error):
    args = replace(
        llama3_args("debugmodel"), attn_backend="varlen", attn_mask_type="block_causal", eos_id=EOS
    )
    mask = build_attention_mask(args, document_ids(_packed_tokens(), EOS), "cuda")

    def kernel(q, k, v):
        return attend(q, k, v, "varlen", mask)  # torch's varlen kernel over cu_seqlens

    _check_against_math(kernel, kv_heads, _block_causal_mask(), _causal_mask(), report, rel_error)


# -- the whole Transformer with each backend, against the same model on SDPA's math kernel -----------

# Both runs under bf16 autocast; on an H100 (torch 2.11) the logits differed by about 1e-3 and the
# worst parameter gradient by about 5e-3.
LOGITS_TOLERANCE, GRAD_TOLERANCE = 5e-3, 2e-2


def _forward_backward(model, tokens):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, dims=1).flatten())
    loss.backward()
    return logits.detach().float(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "backend, mask_type",
    [
        ("sdpa", "causal"),
        ("flex", "block_causal"),
        ("flex", "causal"),
        ("flash", "causal"),
        ("varlen", "block_causal"),
    ],
)
def test_transformer_with_each_attention_backend_matches_the_sdpa_math_run(
    backend, mask_type, build_model, report, rel_error
):
    if backend == "flash":
        pytest.importorskip("flash_attn", reason="the flash-attn package (flash_attn) is not installed")
    tokens = _packed_tokens()  # (2, 1024), the packed DOCUMENTS
    shape = dict(attn_mask_type=mask_type, eos_id=EOS, max_seq_len=SEQ)
    model = build_model(attn_backend=backend, **shape)
    reference = build_model(attn_backend="sdpa", **shape)  # block_causal: an explicit boolean mask
    logits, grads = _forward_backward(model, tokens)
    with sdpa_kernel(SDPBackend.MATH):
        ref_logits, ref_grads = _forward_backward(reference, tokens)
    grad_errors = {name: rel_error(grads[name], ref_grads[name]) for name in ref_grads}
    worst = max(grad_errors, key=grad_errors.get)
    logits_error = rel_error(logits, ref_logits)
    report(logits=logits_error, worst_grad=grad_errors[worst], worst_grad_param=worst)
    assert logits_error < LOGITS_TOLERANCE
    assert grad_errors[worst] < GRAD_TOLERANCE, f"{worst}: {grad_errors[worst]:.3g}"
