"""The operators a served model may run: one explicit allowlist, shared by both formats.

A model is a program written by its author. TorchScript graphs (`torchscript_guard`) and
torch.export graphs (`pt2_guard`) may call these operators and nothing else; an operator
not named here is refused, with its name, before the model runs.

This list is defence in depth, not the boundary. ATen's kernels are C++ that trust much
of what they are given, and no list of names makes them memory-safe: a model that passes
this list may still run code of its choosing inside the process that runs it. The
boundary is that process's sandbox (its own user, no secrets, rlimits and a syscall
filter: docs/security.md). The list keeps the ways that are known and cheap to refuse out
of reach, so that an attack needs a new kernel bug rather than a call by name.

Policy:

- Pure tensor maths is allowed generously: creation from values (`zeros`, `ones`, `full`,
  `arange`, `tensor`, `*_like`), shape and view changes, indexing and slicing, arithmetic,
  comparisons, reductions, activations, normalisation, convolution, pooling, attention,
  recurrent cells (not the raw `lstm`/`gru`/`rnn_*` kernels), embeddings, type and
  device conversions, random draws (`rand`,
  `dropout`: they draw from the generator, they do not save or set its state).
- The plumbing TorchScript compiles ordinary Python into is allowed: constants, attribute
  reads and writes on the model's own objects, lists, tuples, dicts, strings, scalar
  arithmetic, `if`/`for`/`while` blocks, `raise`, `with torch.no_grad()`,
  calls to the archive's own functions and methods (`prim::CallFunction`/`CallMethod`,
  which the guard checks point to functions it also checks).
- torch's own dynamic quantization of linear layers (`quantized::linear_dynamic` and the
  packing and unpacking of its weights, INT8 and FP16): what `servemesh models quantize
  --to int8` writes. They compute on tensors and on torch's packed-weights object
  (`LinearPackedParamsBase`, the one custom C++ class `torchscript_guard` lets through).
- Refused, by not being here: everything that reaches outside the tensors:
  files (`aten::from_file`, `aten::save`, `aten::load`), storages and raw memory
  (`aten::set_`, `aten::as_strided`, `aten::data_ptr`, `prim::id`, the `*storage*` entry
  points), uninitialised memory (`aten::empty*`, `aten::resize_`: it can hold what the
  process freed, a request or a credential), printing (`prim::Print` writes to the
  server's stdout, where it could forge log lines), threads (`prim::fork`, `aten::wait`),
  RPC, profiler and RNG-state operators, Python callbacks (`prim::PythonOp`), every
  namespace but `aten`, `prim` and the `quantized` operators above (custom operators from
  `torch.ops.*`), ATen's private `aten::_*` entry points (but for a few pieces of
  plumbing listed by name below), the raw kernels behind checked public operators
  (`RAW_KERNELS`), and `warnings.warn` (`aten::warn` writes into the server's log).

Operators are matched by name, without the overload (`aten::add` covers `add.Tensor`,
`add.Scalar`, `add.out`, ...): no allowed name has an overload that does more than its
name says.
"""

from __future__ import annotations

__all__ = ["ALLOWED_ATEN", "ALLOWED_PRIM", "ALLOWED_QUANTIZED", "RAW_KERNELS", "allowed_operator"]

# prim:: nodes: TorchScript's own plumbing for Python constructs; none touches the world.
ALLOWED_PRIM: frozenset[str] = frozenset(
    """
    Constant GetAttr SetAttr ListConstruct ListUnpack TupleConstruct TupleUnpack TupleIndex
    TupleSlice DictConstruct If Loop CallMethod CallFunction NumToTensor RaiseException
    Uninitialized unchecked_cast unchecked_unwrap_optional device dtype layout is_cuda
    is_cpu is_xpu is_mps is_meta is_nested is_sparse is_sparse_csr is_mkldnn is_quantized
    is_vulkan is_ipu is_maia requires_grad grad data type name shape min max abs
    isinstance CreateObject Enter Exit ModuleContainerIndex ModuleDictIndex EnumName
    EnumValue StringIndex tolist
    """.split()
)

# aten:: operators on Python-level values (scalars, strings, lists, dicts) that TorchScript
# compiles builtins and operators into.
_ATEN_BUILTINS = """
    __getitem__ _set_item __contains__ __is__ __isnot__ __not__ __and__ __or__ __xor__
    __lshift__ __rshift__ __round_to_zero_floordiv __range_length __derive_index
    __interpolate __upsample __upsample_bilinear append extend insert pop remove clear copy
    len list dict keys values items get setdefault update popitem sort sorted reverse count
    index slice str format join strip lstrip rstrip lower upper startswith endswith find
    rfind replace isdigit isalpha isalnum isspace isupper islower capitalize title center
    ljust rjust zfill splitlines partition rpartition percentFormat ord chr bin hex oct
    floordiv hash Int Float Bool Complex ScalarImplicit IntImplicit FloatImplicit ComplexImplicit
    divmod gcd factorial degrees radians isnan isinf isfinite mathremainder
    warn is_grad_enabled set_grad_enabled _set_grad_enabled is_autocast_enabled
    is_autocast_cpu_enabled is_inference_mode_enabled _get_tracing_state is_scripting
"""

# aten:: tensor operators: pure functions of their tensor and scalar arguments (in-place
# `_` variants write only into the tensors they are given).
_ATEN_TENSOR = """
    tensor as_tensor scalar_tensor zeros zeros_like ones ones_like full full_like new_zeros
    new_ones new_full new_tensor arange range linspace logspace eye tril_indices
    triu_indices rand rand_like randn randn_like randint randint_like randperm bernoulli
    bernoulli_ multinomial normal normal_ uniform_ exponential_ geometric_ cauchy_
    log_normal_ random_ poisson

    size dim numel stride is_floating_point is_complex is_signed is_contiguous is_same_size
    is_nonzero is_leaf element_size get_device item _local_scalar_dense nbytes itemsize

    to type_as cpu cuda double float half bfloat16 int long short char byte bool cfloat
    cdouble contiguous clone detach detach_ alias requires_grad_ numpy_T view_as_real
    view_as_complex real imag conj resolve_conj resolve_neg

    view view_as reshape reshape_as flatten unflatten squeeze squeeze_ unsqueeze unsqueeze_
    permute transpose transpose_ t t_ T mT H mH adjoint movedim moveaxis swapaxes swapdims
    expand expand_as broadcast_to broadcast_tensors repeat repeat_interleave tile narrow
    select slice index_select masked_select take take_along_dim gather scatter scatter_
    scatter_add scatter_add_ scatter_reduce scatter_reduce_ index index_put index_put_
    index_add index_add_ index_copy index_copy_ index_fill index_fill_ masked_fill
    masked_fill_ masked_scatter masked_scatter_ put put_ cat concat concatenate stack hstack
    vstack dstack column_stack row_stack split split_with_sizes tensor_split chunk unbind
    hsplit vsplit dsplit flip fliplr flipud roll rot90 diag diag_embed diagonal diagflat
    tril triu unfold pad constant_pad_nd reflection_pad1d reflection_pad2d
    reflection_pad3d replication_pad1d replication_pad2d replication_pad3d
    circular_pad1d circular_pad2d circular_pad3d zero_pad2d atleast_1d atleast_2d
    atleast_3d meshgrid cartesian_prod combinations block_diag nonzero nonzero_static
    argwhere where fill fill_ zero_ copy_ fill_diagonal_ one_hot bucketize searchsorted
    histc bincount unique unique_consecutive unique_dim

    add add_ sub sub_ rsub mul mul_ div div_ true_divide true_divide_ floor_divide
    floor_divide_ remainder remainder_ fmod fmod_ pow pow_ float_power neg neg_ negative
    positive abs abs_ absolute sign sign_ sgn signbit reciprocal reciprocal_ sqrt sqrt_
    rsqrt rsqrt_ square square_ exp exp_ exp2 expm1 log log_ log2 log10 log1p logaddexp
    logaddexp2 sin sin_ cos cos_ tan tan_ asin acos atan atan2 arctan2 arcsin arccos arctan
    sinh cosh tanh tanh_ asinh acosh atanh arcsinh arccosh arctanh sinc hypot erf erfc
    erfinv lgamma digamma polygamma mvlgamma i0 xlogy logit floor floor_ ceil ceil_ round
    round_ trunc trunc_ fix frac frac_ clamp clamp_ clamp_min clamp_min_ clamp_max
    clamp_max_ clip clip_ lerp lerp_ addcmul addcmul_ addcdiv addcdiv_ copysign nan_to_num
    nan_to_num_ deg2rad rad2deg bitwise_and bitwise_and_ bitwise_or bitwise_or_
    bitwise_xor bitwise_xor_ bitwise_not bitwise_not_ bitwise_left_shift
    bitwise_right_shift __and__ __or__ __xor__ __lshift__ __rshift__ __iand__ __ior__
    __ixor__ __ilshift__ __irshift__ logical_and logical_and_ logical_or logical_or_
    logical_xor logical_not logical_not_ gcd lcm heaviside nextafter ldexp frexp

    eq eq_ ne ne_ lt lt_ le le_ gt gt_ ge ge_ greater greater_equal less less_equal
    not_equal equal allclose isclose isnan isinf isfinite isposinf isneginf isreal isin
    maximum minimum fmax fmin max min amax amin aminmax argmax argmin sort argsort msort
    topk kthvalue median nanmedian mode

    sum nansum mean nanmean prod std var std_mean var_mean norm frobenius_norm
    nuclear_norm renorm dist cumsum cumsum_ cumprod cumprod_ cummax cummin logcumsumexp
    logsumexp all any count_nonzero diff trace quantile nanquantile cov corrcoef

    matmul mm bmm addmm addmm_ addbmm baddbmm addmv addmv_ mv dot vdot inner outer ger
    addr einsum tensordot kron cross linalg_cross chain_matmul linalg_vector_norm
    linalg_matrix_norm linalg_norm linalg_det det logdet slogdet linalg_slogdet
    linalg_inv inverse linalg_solve linalg_cholesky cholesky linalg_qr qr linalg_svd svd
    linalg_eigh linalg_eigvalsh linalg_pinv pinverse linalg_matrix_power matrix_power
    linalg_vecdot

    linear bilinear relu relu_ relu6 relu6_ leaky_relu leaky_relu_ elu elu_ selu selu_ celu
    celu_ gelu gelu_ silu silu_ mish mish_ sigmoid sigmoid_ hardsigmoid hardsigmoid_ hardtanh
    hardtanh_ hardswish hardswish_ hardshrink softshrink tanhshrink softplus softsign
    log_sigmoid prelu rrelu rrelu_ glu threshold threshold_ softmax log_softmax softmin
    dropout dropout_ feature_dropout feature_dropout_ alpha_dropout alpha_dropout_
    feature_alpha_dropout feature_alpha_dropout_ native_dropout

    layer_norm native_layer_norm rms_norm group_norm native_group_norm batch_norm
    native_batch_norm instance_norm local_response_norm normalize cosine_similarity
    pairwise_distance cdist pdist

    conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d convolution
    conv_tbc max_pool1d max_pool2d max_pool3d max_pool1d_with_indices
    max_pool2d_with_indices max_pool3d_with_indices avg_pool1d avg_pool2d avg_pool3d
    adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d
    adaptive_max_pool2d adaptive_max_pool3d lp_pool1d lp_pool2d lp_pool3d max_unpool1d
    max_unpool2d max_unpool3d fractional_max_pool2d pixel_shuffle pixel_unshuffle
    channel_shuffle upsample_nearest1d upsample_nearest2d upsample_nearest3d
    upsample_linear1d upsample_bilinear2d upsample_bicubic2d upsample_trilinear3d
    interpolate grid_sampler affine_grid_generator im2col col2im

    embedding embedding_bag embedding_renorm_ scaled_dot_product_attention lstm gru rnn_tanh
    rnn_relu lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell

    cross_entropy_loss nll_loss nll_loss2d nll_loss_nd mse_loss l1_loss smooth_l1_loss
    huber_loss binary_cross_entropy binary_cross_entropy_with_logits kl_div
    margin_ranking_loss hinge_embedding_loss soft_margin_loss multilabel_margin_loss
    multi_margin_loss cosine_embedding_loss triplet_margin_loss poisson_nll_loss
"""

# ATen's private `_` entry points allowed: TorchScript's own plumbing for Python builtins
# (dict item assignment, `torch.no_grad()`, `torch.jit.is_tracing()`), the read of one element
# that `.item()` compiles to, and the assertions torch.export writes. None is a kernel that
# takes sizes, strides or indices from its caller. Every other `aten::_*` is refused: ATen's
# private kernels trust their callers (the public wrappers check), and a model that calls
# one directly gets memory outside its tensors (`_reshape_alias` with a far stride,
# `_pad_packed_sequence` with a negative batch, `_embedding_bag` with `padding_idx` past
# the table, the fused transformer and attention fast paths). The `_upsample_*` kernels stay:
# `torch.nn.functional.interpolate` compiles into them, and they are structured kernels whose
# size checks run in the kernel's own meta function, not in a public wrapper.
_ATEN_PRIVATE = """
    _set_item _set_grad_enabled _get_tracing_state _local_scalar_dense
    _assert_scalar _assert_tensor_metadata _assert_async _functional_assert_async
    _functional_assert_scalar
    _upsample_nearest_exact1d _upsample_nearest_exact2d _upsample_nearest_exact3d
    _upsample_bilinear2d_aa _upsample_bicubic2d_aa _upsample_lanczos2d_aa
    sym_size sym_stride sym_numel sym_constrain_range
    sym_constrain_range_for_size lift_fresh lift_fresh_copy
"""

# Refused though their names sound harmless, so that no later edit adds them by accident.
_NEVER = """
    from_file save load set_ set source_Storage as_strided as_strided_ as_strided_scatter
    data_ptr storage_offset untyped_storage _storage _new_storage empty empty_like
    new_empty new_empty_strided empty_strided empty_permuted resize_ resize_as_
    _efficientzerotensor
"""

# The raw kernels behind public operators that check their arguments: called directly,
# they read or write past the tensors they are given. `native_batch_norm` in training mode
# with one-element running stats for four channels writes past them (`batch_norm` refuses
# that); raw `lstm`/`gru`/`rnn_*` with 1x1 weight views for a wider layer read past them
# (the cells, `lstm_cell` and kin, check their weights' sizes, so a recurrent model runs
# its cells in a loop, or is pushed as a torch.export program of cells). `warn` writes a
# line of the model's choosing into the server's log, which could forge a JSON log record
# (`prim::Print` is refused for the same reason).
RAW_KERNELS: frozenset[str] = frozenset(
    """
    native_batch_norm native_layer_norm native_group_norm native_dropout lstm gru
    rnn_tanh rnn_relu quantized_lstm quantized_gru warn
    """.split()
)

ALLOWED_ATEN: frozenset[str] = frozenset(
    (set(_ATEN_BUILTINS.split()) | set(_ATEN_TENSOR.split()) | set(_ATEN_PRIVATE.split()))
    - set(_NEVER.split())
    - RAW_KERNELS
)


# quantized:: operators of dynamically quantized linear layers (torch.ao.nn.quantized
# .dynamic.Linear, as scripted): the forward pass, and the weight (un)packing its methods
# compile.
ALLOWED_QUANTIZED: frozenset[str] = frozenset(
    """
    linear_dynamic linear_dynamic_fp16 linear_prepack linear_prepack_fp16 linear_unpack
    linear_unpack_fp16
    """.split()
)


def allowed_operator(kind: str) -> bool:
    """Whether a graph node's kind (`aten::relu`, `prim::If`) is on the allowlist."""
    namespace, _, name = kind.partition("::")
    if namespace == "aten":
        return name in ALLOWED_ATEN
    if namespace == "prim":
        return name in ALLOWED_PRIM
    if namespace == "quantized":
        return name in ALLOWED_QUANTIZED
    return False
