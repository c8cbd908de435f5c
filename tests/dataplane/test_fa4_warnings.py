"""The CuTe DSL's UserWarning at each first compile of FA4's forward (a screenful a data plane's
start) is dropped once FA4 imports, and no other warning with it."""

import warnings

from dataplane.attention import flash_attn_backend

# as flash-attn-4 4.0.0b36's first compile on an H100 wrote it (bench/results/h100/
# serve-qwen3-0.6b-auto-35bc58a.log), the kernel's name shortened
COMPILE_WARNING = (
    "Argument aux_data (position 17) cannot be converted to a JitArgument for function "
    "'cutlass___call___flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at__"
    "Tensorgmemoi64i641_None_00883883476'. Its type `<class 'flash_attn.cute.utils.AuxData'>` "
    "is not supported. If the value is known at compile time, annotate it: `aux_data: "
    "Constexpr`.")


def test_only_fa4s_compile_warning_is_dropped():
    with warnings.catch_warnings(record=True) as caught:  # restores the filters after
        warnings.simplefilter("always")
        flash_attn_backend._quiet_fa4_compile_warning()
        warnings.warn(COMPILE_WARNING, UserWarning)
        warnings.warn(COMPILE_WARNING.replace("aux_data", "page_table"), UserWarning)
        warnings.warn(COMPILE_WARNING, DeprecationWarning)
    assert [(w.category, str(w.message)[:22]) for w in caught] == [
        (UserWarning, "Argument page_table (p"), (DeprecationWarning, "Argument aux_data (pos")]
