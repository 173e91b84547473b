"""Layer specs: sizes, dtypes, validation with layer names, KV-sharing graph checks."""

from __future__ import annotations

import pytest
from hybrid_kv.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVSharingSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SpecError,
    canonical_dtype,
    dtype_size,
    layer_context,
    validate_layers,
)


def test_attention_page_size_matches_vllm_formula() -> None:
    # vllm-semantics §1.1: bs16, 8 heads, 128, bf16 -> 65536; head_size_v 64 -> 49152.
    spec = FullAttentionSpec(num_kv_heads=8, head_size=128, dtype="bf16")
    assert spec.bytes_per_token == 2 * 8 * 128 * 2
    assert spec.page_size_bytes(16) == 65536
    assert FullAttentionSpec(num_kv_heads=8, head_size=128, head_size_v=64).page_size_bytes(16) == (
        49152
    )


def test_fp8_page_is_half_of_bf16() -> None:
    fp8 = SlidingWindowSpec(num_kv_heads=8, head_size=128, dtype="fp8", sliding_window=128)
    assert fp8.dtype == "fp8_e4m3"
    assert fp8.page_size_bytes(16) == 32768


def test_mla_page_is_one_latent_vector_per_token() -> None:
    # DeepSeek: head 576 bf16, bs64 -> 73728.
    assert MLAAttentionSpec(head_size=576).page_size_bytes(64) == 73728


def test_dtype_aliases_are_canonicalised_and_compare_equal() -> None:
    a = FullAttentionSpec(num_kv_heads=1, head_size=64, dtype="bfloat16")
    b = FullAttentionSpec(num_kv_heads=1, head_size=64, dtype="torch.bfloat16")
    assert a == b and hash(a) == hash(b)
    assert canonical_dtype("float8_e5m2") == "fp8_e5m2"
    assert dtype_size("float32") == 4


def test_spec_kinds_distinguish_attention_types() -> None:
    kwargs = {"num_kv_heads": 1, "head_size": 8}
    assert FullAttentionSpec(**kwargs).kind == "full"
    assert SlidingWindowSpec(**kwargs, sliding_window=4).kind == "sliding_window"
    assert ChunkedLocalAttentionSpec(**kwargs, attention_chunk_size=4).kind == "chunked_local"
    assert MLAAttentionSpec(head_size=8).kind == "full"
    # Equal fields of different types must not merge into one bucket.
    assert FullAttentionSpec(**kwargs) != SlidingWindowSpec(**kwargs, sliding_window=4)


def test_mamba1_state_shapes_and_bytes() -> None:
    # Jamba-1.5-Mini: d_inner = 2 * 4096, d_state 16, d_conv 4, bf16.
    spec = MambaSpec.mamba1(intermediate_size=8192, state_size=16, conv_kernel=4)
    assert spec.shapes == ((3, 8192), (8192, 16))  # vLLM's default conv layout: (d_conv-1, dim)
    assert spec.state_bytes == (8192 * 3 + 8192 * 16) * 2
    assert spec.page_size_bytes(16) == spec.page_size_bytes(528) == spec.state_bytes
    assert spec.bytes_per_token == 0


def test_mamba2_state_shapes_and_bytes() -> None:
    # Bamba-9B: d_inner 8192, 1 group, 128 heads x 64, d_state 128, d_conv 4.
    spec = MambaSpec.mamba2(
        intermediate_size=8192,
        n_groups=1,
        num_heads=128,
        head_dim=64,
        state_size=128,
        conv_kernel=4,
    )
    assert spec.shapes == ((3, 8192 + 2 * 128), (128, 64, 128))
    assert spec.state_bytes == 2147840


def test_mamba_sub_states_are_aligned_to_their_dtype() -> None:
    spec = MambaSpec(shapes=((3,), (2,)), dtypes=("fp16", "fp32"))
    assert spec.state_offsets == (0, 8)  # 6 bytes of fp16, then fp32 aligned to 4
    assert spec.state_bytes == 16


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: FullAttentionSpec(num_kv_heads=0, head_size=64), "num_kv_heads must be > 0"),
        (lambda: FullAttentionSpec(num_kv_heads=1, head_size=-1), "head_size must be > 0"),
        (
            lambda: SlidingWindowSpec(num_kv_heads=1, head_size=8, sliding_window=0),
            "sliding_window must be > 0",
        ),
        (
            lambda: ChunkedLocalAttentionSpec(num_kv_heads=1, head_size=8, attention_chunk_size=-4),
            "attention_chunk_size must be > 0",
        ),
        (lambda: FullAttentionSpec(num_kv_heads=1, head_size=8, dtype="int3"), "unknown dtype"),
        (lambda: FullAttentionSpec(num_kv_heads=1.5, head_size=8), "must be an int"),
        (lambda: MambaSpec(shapes=((4, 0),), dtypes=("bf16",)), "must be > 0"),
        (lambda: MambaSpec(shapes=(), dtypes=()), "at least one state shape"),
        (lambda: MambaSpec(shapes=((4,), (4,)), dtypes=("bf16", "bf16", "fp32")), "dtypes"),
        (lambda: KVSharingSpec(""), "non-empty"),
    ],
)
def test_invalid_values_raise_spec_error(factory: object, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        factory()  # type: ignore[operator]


def test_spec_error_is_a_value_error() -> None:
    assert issubclass(SpecError, ValueError)


def test_layer_context_puts_the_layer_name_in_the_message() -> None:
    with pytest.raises(SpecError, match=r"layer 'model.layers.7': .*sliding_window must be > 0"):
        with layer_context("model.layers.7"):
            SlidingWindowSpec(num_kv_heads=1, head_size=8, sliding_window=-1)


FULL = FullAttentionSpec(num_kv_heads=1, head_size=8)


def test_validate_layers_rejects_missing_sharing_target() -> None:
    with pytest.raises(SpecError, match=r"layer 'b'.*target 'nope' does not exist"):
        validate_layers({"a": FULL, "b": KVSharingSpec("nope")})


def test_validate_layers_rejects_sharing_chains() -> None:
    layers = {"a": FULL, "b": KVSharingSpec("a"), "c": KVSharingSpec("b")}
    with pytest.raises(SpecError, match=r"layer 'c'.*'b' is itself a sharing layer"):
        validate_layers(layers)


def test_validate_layers_rejects_cycles() -> None:
    with pytest.raises(SpecError, match=r"cycle a -> b -> a"):
        validate_layers({"x": FULL, "a": KVSharingSpec("b"), "b": KVSharingSpec("a")})
    with pytest.raises(SpecError, match=r"layer 'a'.*cycle a -> a"):
        validate_layers({"x": FULL, "a": KVSharingSpec("a")})


def test_validate_layers_rejects_sharing_a_mamba_state() -> None:
    mamba = MambaSpec(shapes=((4,),), dtypes=("fp32",))
    with pytest.raises(SpecError, match=r"layer 'b'.*Mamba"):
        validate_layers({"a": mamba, "b": KVSharingSpec("a")})


def test_validate_layers_rejects_non_specs_and_non_mappings() -> None:
    with pytest.raises(SpecError, match=r"layer 'a': expected a layer spec"):
        validate_layers({"a": object()})  # type: ignore[dict-item]
    with pytest.raises(SpecError, match="must be a mapping"):
        validate_layers([FULL])  # type: ignore[arg-type]


def test_an_attention_free_model_has_no_layers() -> None:
    validate_layers({})


def test_mamba2_over_tensor_parallel_ranks_splits_width_and_heads() -> None:
    # Bamba over 4 ranks: 1 group replicated to 4, conv width (8192 + 2*4*128) / 4.
    spec = MambaSpec.mamba2(
        intermediate_size=8192,
        n_groups=1,
        num_heads=128,
        head_dim=64,
        state_size=128,
        conv_kernel=4,
        tensor_parallel_size=4,
    )
    assert spec.shapes == ((3, (8192 + 2 * 4 * 128) // 4), (32, 64, 128))
    with pytest.raises(SpecError, match="does not split over 3 TP ranks"):
        MambaSpec.mamba2(
            intermediate_size=8192,
            n_groups=1,
            num_heads=128,
            head_dim=64,
            state_size=128,
            conv_kernel=4,
            tensor_parallel_size=3,
        )


def test_gated_delta_net_state_shapes() -> None:
    # Qwen3-Next: 16 key heads, 32 value heads of 128, kernel 4.
    spec = MambaSpec.gated_delta_net(
        num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_kernel=4
    )
    assert spec.shapes == ((3, 2 * 16 * 128 + 32 * 128), (32, 128, 128))
    assert spec.mamba_type == "gdn"
    assert spec.state_bytes == (3 * 8192 + 32 * 128 * 128) * 2


def test_validate_layers_accepts_sharing_onto_an_attention_layer() -> None:
    validate_layers({"a": FULL, "b": KVSharingSpec("a")})


def test_torch_dtypes_are_accepted_as_vllm_specs_hold_them() -> None:
    torch = pytest.importorskip("torch")
    spec = FullAttentionSpec(num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    assert spec == FullAttentionSpec(num_kv_heads=1, head_size=64, dtype="bf16")
    assert canonical_dtype(torch.float8_e4m3fn) == "fp8_e4m3"
    assert MambaSpec(shapes=((3,), (2,)), dtypes=torch.float32).dtypes == ("fp32", "fp32")
    sizes = {"intermediate_size": 64, "n_groups": 1, "num_heads": 4, "head_dim": 16}
    sizes |= {"state_size": 16, "conv_kernel": 4}
    assert MambaSpec.mamba2(**sizes, dtype=torch.float16, ssm_dtype=torch.float32) == (
        MambaSpec.mamba2(**sizes, dtype="fp16", ssm_dtype="fp32")
    )
    with pytest.raises(SpecError, match="unknown dtype 'torch.int8'"):
        FullAttentionSpec(num_kv_heads=1, head_size=64, dtype=torch.int8)
