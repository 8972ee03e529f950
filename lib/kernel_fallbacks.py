"""
What a training run does about the fused kernel (FlexAttention): the note it prints where a score
bias cannot be fused on its device, and the fallbacks it takes where the compiler cannot build it
for this model on this GPU.
"""

from collections.abc import Callable
from dataclasses import replace

from fast_paths import FLEX_MIN_HEAD_DIM, AttentionOptions, flex_fits

MATERIALIZED = (
    "attention adds a materialized bias instead (slower, memory quadratic in the context)"
)


def fused_attention_note(
    head_dim: int, device_type: str, dropout: float = 0.0, compiled: bool = True
) -> str | None:
    """Why a score bias cannot be fused in training on this device, for the user; None where it can
    (or where no fused kernel is taken anyway: a CPU, or an uncompiled run, for dropout)."""
    if device_type != "cuda":
        return None
    if not flex_fits(head_dim, device_type):
        why = (
            f"FlexAttention needs a head dim of at least {FLEX_MIN_HEAD_DIM} on CUDA (this model "
            f"has {head_dim})"
        )
        return f"{why}: {MATERIALIZED}"
    if dropout > 0 and compiled:
        why = f"FlexAttention has no attention dropout (dropout={dropout:g})"
        return f"{why}: in training {MATERIALIZED}; --dropout=0 fuses it"
    return None


# --------------------------------------------------------------------------------------------------
# Kernel fallbacks: a fused kernel that the compiler cannot build for this model on this GPU
# (Triton's shared memory, an unsupported shape) is replaced, never a crash: first the same kernel
# with one pipeline stage (less shared memory per block), then a materialized bias (always
# compiles). Each replaces fields of the model's AttentionOptions.
KERNEL_FALLBACKS = [
    (
        "FlexAttention retries with kernel_options num_stages=1 (less shared memory)",
        {"flex_kernel_options": {"num_stages": 1}},
    ),
    (MATERIALIZED, {"fused": False}),
]


def compiler_failure(e: BaseException | None) -> bool:
    """Whether e, or an exception it came from, is the compiler's (Dynamo's backend, Inductor,
    Triton)."""
    from torch._dynamo.exc import BackendCompilerFailed

    # imported here: torch does not load inductor until it compiles
    from torch._inductor import exc as inductor_exc

    kinds = (BackendCompilerFailed, getattr(inductor_exc, "InductorError", BackendCompilerFailed))
    while e is not None:
        name = f"{type(e).__module__}.{type(e).__name__}"
        if (
            isinstance(e, kinds)
            or name.startswith("triton.")
            or name.endswith("NoTritonConfigsError")
        ):
            return True
        e = e.__cause__ or e.__context__
    return False


def fall_back(
    attention_options: AttentionOptions, error: BaseException
) -> tuple[AttentionOptions, str] | None:
    """Where error is the compiler failing on the fused kernel the default attention_options chose,
    the next fallback's attention_options and what changed (one line); None where there is nothing
    to fall back from or to."""
    if not (attention_options.fused is None and compiler_failure(error)):
        return None
    for what, settings in KERNEL_FALLBACKS:
        if any(getattr(attention_options, k) != v for k, v in settings.items()):
            first_line = next(
                (ln for ln in str(error).splitlines() if ln.strip()), type(error).__name__
            )[:200]
            note = (
                f"the fused attention kernel (FlexAttention) failed to compile ({first_line}); "
                f"{what}"
            )
            return replace(attention_options, **settings), note
    return None


def with_kernel_fallbacks(
    step: Callable,
    attention_options: AttentionOptions | None,
    retry: Callable[[AttentionOptions], None],
    log=print,
):
    """step(), and where the fused kernel cannot be compiled, again after each fallback in turn (one
    log line each; a fallback stays). retry(attention_options) gives the model the fallback's and
    puts back what the failed step changed; None: the model has no score bias."""
    while True:
        try:
            return step()
        except Exception as e:
            fallback = None if attention_options is None else fall_back(attention_options, e)
            if fallback is None:
                raise
            attention_options, note = fallback
            log(f"note: {note}")
            retry(attention_options)
