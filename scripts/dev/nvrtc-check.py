#!/usr/bin/env python3
"""Compiles our CUDA kernel bodies (src/kernels/*.rs) with NVRTC on a machine
without a GPU, wrapped as MLX's fast::cuda_kernel wraps them (inputs, then
outputs, template constants first), for each dtype we instantiate. It only
proves the text compiles; correctness is src/kernels/tests.rs on a GPU.

    python3 -m pip install --target /tmp/nvrtc "nvidia-cuda-nvrtc==13.*" \
        "nvidia-cuda-runtime==13.*" "nvidia-cuda-cccl==13.*"
    python3 scripts/dev/nvrtc-check.py /tmp/nvrtc

With --ptxas=PATH (ptxas from `pip install --target /tmp/nvcc
"nvidia-cuda-nvcc==13.*"`), each kernel's registers, spills and shared
memory on sm_90 too; --only and --sass below. With --ptx-dir=DIR, each
kernel's PTX into DIR (FILE-DTYPE.ptx), to diff two trees' kernels byte for
byte (a header's edit that must leave the default kernels as they were);
--dtypes=bfloat16,float16 compiles only those (each tree's whole set takes
~40 minutes on two cores).
With --files, each kernel
also as it reaches MLX by default (MLX_LFM_KERNEL_TEXT unset since session 39; its texts in files
that #include lines name): the same PTX, byte for byte, or it fails. With
--qint=bits|convert, the quantized walk's other forms (MLX_LFM_QINT; pairs
by default, as the kernels ship).
"""
import ctypes
import re
import sys
import tempfile
from pathlib import Path

root = Path(__file__).resolve().parents[2]
args = [a for a in sys.argv[1:] if not a.startswith("--")]
base = Path(args[0] if args else "/tmp/nvrtc") / "nvidia" / "cu13"
nvrtc = ctypes.CDLL(str(base / "lib" / "libnvrtc.so.13"))
inc = base / "include"

PRELUDE = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cuda/std/array>
#include <cuda/std/limits>
typedef unsigned int uint32_t;
typedef int int32_t;
using Shape = cuda::std::array<int32_t, 8>;
using Strides = cuda::std::array<long long, 8>;
"""
CTYPE = {"bfloat16": "__nv_bfloat16", "float16": "__half", "float32": "float"}

KERNELS = {
    # file: (inputs with their element types, outputs, template constants)
    "add_rms_norm.rs": (
        [("h", "T"), ("r", "T"), ("w", "T"), ("eps", "float")],
        [("s", "T"), ("y", "T")],
        lambda dt: [("D", 2048), ("BLOCK", 256)],
    ),
    # Eps compiled in (MLX_LFM_EPS_CONST: REPLACE_OF's substitution).
    "add_rms_norm.rs@epsc": (
        [("h", "T"), ("r", "T"), ("w", "T"), ("eps", "float")],
        [("s", "T"), ("y", "T")],
        lambda dt: [("D", 2048), ("BLOCK", 256), ("EPS_BITS", 925353388)],
    ),
    "decode_attention.rs": (
        [("q", "T"), ("k", "T"), ("v", "T"), ("mask", "bool")],
        [("out", "T"), ("sc", "float")],
        lambda dt: [("HD", 64), ("SCALE_BITS", 1040187392)],
    ),
    # The split variant (MLX_LFM_DECODE_ATTENTION_SPLIT: LFM_ATT_DPB, see
    # DEFINES_OF), bounded by the position as the compiled step runs it.
    "decode_attention.rs@upto-split16": (
        [("q", "T"), ("k", "T"), ("v", "T"), ("upto", "int")],
        [("out", "T"), ("sc", "float")],
        lambda dt: [("HD", 64), ("SCALE_BITS", 1040187392), ("PER_ROW", 1)],
    ),
    # The positions in chunks (MLX_LFM_DECODE_ATTENTION_CHUNKS) and their join.
    "decode_attention.rs#part": (
        [("q", "T"), ("k", "T"), ("v", "T"), ("mask", "bool")],
        [("parts", "float"), ("sc", "float")],
        lambda dt: [("HD", 64), ("R", 4), ("CHUNKS", 8), ("SCALE_BITS", 1040187392)],
    ),
    "decode_attention.rs#part@upto": (
        [("q", "T"), ("k", "T"), ("v", "T"), ("upto", "int")],
        [("parts", "float"), ("sc", "float")],
        lambda dt: [("HD", 64), ("R", 4), ("CHUNKS", 8), ("SCALE_BITS", 1040187392), ("PER_ROW", 1)],
    ),
    "decode_attention.rs#join": (
        [("parts", "float")],
        [("out", "T")],
        lambda dt: [("HD", 64), ("CHUNKS", 8)],
    ),
    "decode_attention.rs@upto-split8": (
        [("q", "T"), ("k", "T"), ("v", "T"), ("upto", "int")],
        [("out", "T"), ("sc", "float")],
        lambda dt: [("HD", 64), ("SCALE_BITS", 1040187392), ("PER_ROW", 1)],
    ),
    # The wide variant (MLX_LFM_DECODE_ATTENTION_WIDE): a row over several
    # lanes, its scores in shared memory; head sizes 64, and 256 (128 in
    # float32: a row's loads one warp).
    "decode_attention.rs#wide": (
        [("q", "T"), ("k", "T"), ("v", "T"), ("mask", "bool")],
        [("out", "T"), ("sc", "float")],
        lambda dt: [("HD", 64), ("SCALE_BITS", 1040187392), ("SN", 8192)],
    ),
    "decode_attention.rs#wide@upto": (
        [("q", "T"), ("k", "T"), ("v", "T"), ("upto", "int")],
        [("out", "T"), ("sc", "float")],
        lambda dt: [("HD", 256 if dt != "float32" else 128), ("SCALE_BITS", 1040187392), ("PER_ROW", 1), ("SN", 8192)],
    ),
    # The same body bounded by the position (`UPTO_VALID` for `__VALIDITY__`).
    "decode_attention.rs@upto": (
        [("q", "T"), ("k", "T"), ("v", "T"), ("upto", "int")],
        [("out", "T"), ("sc", "float")],
        lambda dt: [("HD", 64), ("SCALE_BITS", 1040187392), ("PER_ROW", 1)],
    ),
    "gemv.rs": (
        [("x", "T"), ("w", "T")],
        [("y", "T")],
        lambda dt: [("K", 2048), ("M", 1)],
    ),
    "gemv.rs#swiglu": (
        [("x", "T"), ("w", "T")],
        [("y", "T")],
        lambda dt: [("K", 2048), ("M", 1)],
    ),
    "quant_gemv.rs": (
        [("x", "T"), ("w", "uint32_t"), ("scales", "T"), ("biases", "T")],
        [("y", "T")],
        lambda dt: [("K", 2048), ("BITS", 4), ("GS", 64), ("M", 2)],
    ),
    "moe_experts.rs#gate_up": (
        [("x", "T"), ("idx", "uint32_t"), ("w", "uint32_t"), ("scales", "T"), ("biases", "T")],
        [("y", "T")],
        lambda dt: [("K", 2048), ("BITS", 4), ("GS", 64), ("KE", 4)],
    ),
    "moe_experts.rs#down": (
        [("h", "T"), ("idx", "uint32_t"), ("score", "T"), ("w", "uint32_t"), ("scales", "T"), ("biases", "T")],
        [("y", "T")],
        lambda dt: [("K", 1792), ("BITS", 8), ("GS", 32), ("KE", 4)],
    ),
    "moe_experts.rs#down@loads": (
        [("h", "T"), ("idx", "uint32_t"), ("score", "T"), ("w", "uint32_t"), ("scales", "T"), ("biases", "T")],
        [("y", "T")],
        lambda dt: [("K", 1792), ("BITS", 4), ("GS", 64), ("KE", 4)],
    ),
    "norm_gemv.rs#dense": (
        [("h", "T"), ("r", "T"), ("wn", "T"), ("eps", "float"), ("w", "T")],
        [("s", "T"), ("y", "T")],
        lambda dt: [("K", 2048), ("M", 1)],
    ),
    "norm_gemv.rs#swiglu": (
        [("h", "T"), ("r", "T"), ("wn", "T"), ("eps", "float"), ("w", "T")],
        [("s", "T"), ("y", "T")],
        lambda dt: [("K", 2048), ("M", 2)],
    ),
    "norm_gemv.rs#quant": (
        [("h", "T"), ("r", "T"), ("wn", "T"), ("eps", "float"), ("w", "uint32_t"), ("scales", "T"), ("biases", "T")],
        [("s", "T"), ("y", "T")],
        lambda dt: [("BITS", 4), ("GS", 64), ("K", 2048), ("M", 1)],
    ),
    "qk_norm_rope.rs": (
        [("q", "T"), ("k", "T"), ("qw", "T"), ("kw", "T"), ("offset", "int32_t")],
        [("qo", "T"), ("ko", "T")],
        lambda dt: [("HD", 64), ("PER_ROW", "false"), ("EPS_BITS", 925353388), ("BASE_BITS", 1095963082)],
    ),
    "qk_norm_rope.rs#qkv": (
        [("qkv", "T"), ("qw", "T"), ("kw", "T"), ("offset", "int32_t")],
        [("qo", "T"), ("ko", "T"), ("vo", "T")],
        lambda dt: [("HD", 64), ("QH", 32), ("KVH", 8), ("PER_ROW", "false"), ("EPS_BITS", 925353388),
                    ("BASE_BITS", 1095963082)],
    ),
    # A greedy step's argmax with the finiteness flag (a CUDA default).
    "argmax_finite.rs": (
        [("logits", "T")],
        [("token", "uint32_t"), ("finite", "uint32_t")],
        lambda dt: [],
    ),
    # ...over 16-byte chunks (MLX_LFM_ARGMAX_VEC, opt-in).
    "argmax_finite.rs#vec": (
        [("logits", "T")],
        [("token", "uint32_t"), ("finite", "uint32_t")],
        lambda dt: [],
    ),
    # A MoE prefill's rows sorted by expert (MLX_LFM_MOE_SORT_KERNEL): the
    # 8B-A1B's 32 experts, top-4, and the most experts served (no T: one
    # dtype's build).
    "moe_sort.rs": (
        [("ids", "uint32_t")],
        [("src", "int32_t"), ("inv", "int32_t"), ("offsets", "int32_t")],
        lambda dt: [("K", 4), ("E", 32)],
        ["bfloat16"],
    ),
    "moe_sort.rs@e128": (
        [("ids", "uint32_t")],
        [("src", "int32_t"), ("inv", "int32_t"), ("offsets", "int32_t")],
        lambda dt: [("K", 2), ("E", 128)],
        ["bfloat16"],
    ),
    # ...and the experts' rows back in token order, weighted and summed
    # (MLX_LFM_MOE_COMBINE_KERNEL).
    "moe_sort.rs#combine": (
        [("y", "T"), ("inv", "int32_t"), ("scores", "T")],
        [("out", "T")],
        lambda dt: [("K", 4), ("D", 2048)],
    ),
    # A quantized embedding's rows (MLX_LFM_QUANT_EMBED_KERNEL).
    "quant_embed.rs": (
        [("ids", "uint32_t"), ("w", "uint32_t"), ("scales", "T"), ("biases", "T")],
        [("out", "T")],
        lambda dt: [("D", 2048), ("BITS", 4), ("GS", 64)],
    ),
    # A prompt's q/k/v (MLX_LFM_QKV_PREFILL_KERNEL).
    "qk_norm_rope.rs#qkv_prefill": (
        [("qkv", "T"), ("qw", "T"), ("kw", "T"), ("offset", "int32_t")],
        [("qo", "T"), ("ko", "T"), ("vo", "T")],
        lambda dt: [("HD", 64), ("QH", 32), ("KVH", 8), ("PER_ROW", "false"), ("EPS_BITS", 925353388),
                    ("BASE_BITS", 1095963082)],
    ),
    "short_conv.rs": (
        [("bcx", "T"), ("state", "T"), ("w", "T")],
        [("next", "T"), ("y", "T")],
        lambda dt: [("D", 2048), ("KEEP", 2)],
    ),
    # The in_proj GEMV folded in front of the step (MLX_LFM_CONV_GEMV_KERNEL).
    "short_conv.rs#gemv": (
        [("x", "T"), ("w", "T"), ("state", "T"), ("cw", "T")],
        [("next", "T"), ("y", "T")],
        lambda dt: [("K", 2048), ("D", 2048), ("KEEP", 2)],
    ),
    # A prompt's pass of the conv (MLX_LFM_CONV_PREFILL_KERNEL).
    "short_conv.rs#prefill": (
        [("bcx", "T"), ("state", "T"), ("w", "T")],
        [("padded", "T"), ("y", "T")],
        lambda dt: [("D", 2048), ("KEEP", 2)],
    ),
    "moe_router.rs": (
        [("probs", "T"), ("bias", "float"), ("scale", "float")],
        [("inds", "uint32_t"), ("scores", "T")],
        lambda dt: [("E", 32), ("K", 4), ("NORM", "true")],
    ),
    "moe_gemm.rs": (
        [("x", "T"), ("offsets", "int32_t"), ("w", "uint32_t"), ("scales", "T"), ("biases", "T")],
        [("y", "T")],
        lambda dt: [("K", 2048), ("BITS", 4), ("GS", 64)],
        # Tensor cores take half types only (available() serves no other).
        ["bfloat16", "float16"],
    ),
    # ...reading its sorted rows through their places in x (the MoE sort
    # kernel's src: moe_gemm.rs GATHERED_SUBSTITUTIONS).
    "moe_gemm.rs@gathered": (
        [("x", "T"), ("src", "int32_t"), ("offsets", "int32_t"), ("w", "uint32_t"), ("scales", "T"), ("biases", "T")],
        [("y", "T")],
        lambda dt: [("K", 2048), ("BITS", 4), ("GS", 64)],
        ["bfloat16", "float16"],
    ),
    "moe_router.rs#gate": (
        [("x", "T"), ("w", "uint32_t"), ("scales", "T"), ("biases", "T"), ("bias", "float"), ("scale", "float")],
        [("inds", "uint32_t"), ("scores", "T")],
        lambda dt: [("BITS", 8), ("GS", 64), ("D", 2048), ("E", 32), ("TOPK", 4), ("NORM", "true")],
    ),
    "moe_router.rs#gate_norm": (
        [("h", "T"), ("r", "T"), ("wn", "T"), ("eps", "float"), ("w", "uint32_t"), ("scales", "T"), ("biases", "T"),
         ("bias", "float"), ("scale", "float")],
        [("s", "T"), ("y", "T"), ("inds", "uint32_t"), ("scores", "T")],
        lambda dt: [("BITS", 4), ("GS", 64), ("D", 2048), ("E", 32), ("TOPK", 4), ("NORM", "true"), ("RW", 8)],
    ),
}
# The router + norm kernel a warp an expert (its default; 8 warps with
# MLX_LFM_ROUTER_NORM_WIDE=0, the entry above).
# The experts' weights written as float32 (MLX_LFM_ROUTER_SCORES_F32), and
# the down kernel reading them so.
KERNELS["moe_router.rs#gate_norm@f32"] = (KERNELS["moe_router.rs#gate_norm"][0],
                                          [("s", "T"), ("y", "T"), ("inds", "uint32_t"), ("scores", "float")],
                                          KERNELS["moe_router.rs#gate_norm"][2])
KERNELS["moe_experts.rs#down@f32"] = ([("h", "T"), ("idx", "uint32_t"), ("score", "float"), ("w", "uint32_t"),
                                       ("scales", "T"), ("biases", "T")], *KERNELS["moe_experts.rs#down"][1:])
# Eps and the route's scale compiled in (MLX_LFM_EPS_CONST: REPLACE_OF's substitutions).
KERNELS["moe_router.rs#gate_norm@const"] = (*KERNELS["moe_router.rs#gate_norm"][:2],
                                            lambda dt: [("BITS", 4), ("GS", 64), ("D", 2048), ("E", 32), ("TOPK", 4),
                                                        ("NORM", "true"), ("RW", 32), ("EPS_BITS", 925353388),
                                                        ("SCALE_BITS", 1075838976)])
KERNELS["moe_router.rs#gate_norm@wide"] = (*KERNELS["moe_router.rs#gate_norm"][:2],
                                           lambda dt: [("BITS", 4), ("GS", 64), ("D", 2048), ("E", 32), ("TOPK", 4),
                                                       ("NORM", "true"), ("RW", 32)])

# A lone sequence's MoE layer in one launch (MLX_LFM_MOE_FUSED): the 8B-A1B's shapes.
KERNELS["moe_fused.rs"] = (
    [("h", "T"), ("r", "T"), ("wn", "T"), ("gw", "uint32_t"), ("gscales", "T"), ("gbiases", "T"), ("bias", "float"),
     ("uw", "uint32_t"), ("uscales", "T"), ("ubiases", "T"), ("dw", "uint32_t"), ("dscales", "T"), ("dbiases", "T"),
     ("ctr", "uint32_t")],
    [("s", "T"), ("out", "T"), ("yn", "T"), ("inds", "uint32_t"), ("scores", "float"), ("hk", "T")],
    lambda dt: [("D", 2048), ("F", 1792), ("E", 32), ("TOPK", 4), ("NORM", "true"), ("GBITS", 4), ("GGS", 64),
                ("BITS", 4), ("GS", 64), ("WARPS", 32), ("EPS_BITS", 925353388), ("SCALE_BITS", 1065353216)],
)
# A lone sequence's short-conv layer in one launch (MLX_LFM_CONV_FUSED): the 8B-A1B's.
KERNELS["conv_fused.rs"] = (
    [("h", "T"), ("r", "T"), ("wn", "T"), ("state", "T"), ("cw", "T"), ("iw", "uint32_t"), ("iscales", "T"),
     ("ibiases", "T"), ("ow", "uint32_t"), ("oscales", "T"), ("obiases", "T"), ("ctr", "uint32_t")],
    [("s", "T"), ("out", "T"), ("next", "T"), ("yn", "T"), ("yc", "T")],
    lambda dt: [("D", 2048), ("C", 2048), ("KEEP", 2), ("IBITS", 4), ("IGS", 64), ("OBITS", 4), ("OGS", 64),
                ("NBLK", 256 if dt != "float32" else 512), ("WARPS", 16), ("EPS_BITS", 925353388)],
)
# Over dense projections (the 1.2B's): "@dense" (its header and defines).
KERNELS["conv_fused.rs@dense"] = (
    [("h", "T"), ("r", "T"), ("wn", "T"), ("state", "T"), ("cw", "T"), ("iw", "T"), ("ow", "T"), ("ctr", "uint32_t")],
    KERNELS["conv_fused.rs"][1],
    lambda dt: [("D", 2048), ("C", 2048), ("KEEP", 2), ("NBLK", 256 if dt != "float32" else 512), ("WARPS", 16),
                ("EPS_BITS", 925353388)],
)
# Its scratch rows in the layer's state (MLX_LFM_SCRATCH_IN_STATE): two
# outputs, the rows' places as template values (the 8B-A1B's layout in bf16,
# moe_fused.rs scratch_layout), the body after SCRATCH_PRELUDE (PRELUDE_OF).
KERNELS["moe_fused.rs@scratch"] = (KERNELS["moe_fused.rs"][0], KERNELS["moe_fused.rs"][1][:2],
                                   lambda dt: KERNELS["moe_fused.rs"][2](dt)
                                   + [("SCR_YN", 256), ("SCR_INDS", 4352), ("SCR_SCORES", 4608), ("SCR_HK", 4864)])
# Its most registers by ptxas: rows of 1,536 (the last chunk guarded), 4-bit
# experts 8,192 wide in groups of 128 (64 in bf16, the limit at 1,024 threads).
KERNELS["moe_fused.rs@d1536"] = (*KERNELS["moe_fused.rs"][:2],
                                 lambda dt: [("D", 1536), ("F", 8192), ("E", 32), ("TOPK", 1), ("NORM", "true"),
                                             ("GBITS", 4), ("GGS", 64), ("BITS", 4), ("GS", 128), ("WARPS", 32),
                                             ("EPS_BITS", 925353388), ("SCALE_BITS", 1065353216)],
                                 ["bfloat16", "float16"])
# A lone sequence's feed-forward in one launch (MLX_LFM_FFN_FUSED): the
# 8B-A1B's two dense layers (4-bit) and, "@dense", the 1.2B's.
KERNELS["ffn_fused.rs"] = (
    [("h", "T"), ("r", "T"), ("wn", "T"), ("iw", "uint32_t"), ("iscales", "T"), ("ibiases", "T"), ("ow", "uint32_t"),
     ("oscales", "T"), ("obiases", "T"), ("ctr", "uint32_t")],
    [("s", "T"), ("out", "T"), ("yn", "T"), ("hk", "T")],
    lambda dt: [("D", 2048), ("F", 7168), ("NBLK", 256 if dt != "float32" else 512), ("WARPS", 16),
                ("EPS_BITS", 925353388), ("IBITS", 4), ("IGS", 64), ("OBITS", 4), ("OGS", 64)],
)
KERNELS["ffn_fused.rs@dense"] = (
    [("h", "T"), ("r", "T"), ("wn", "T"), ("iw", "T"), ("ow", "T"), ("ctr", "uint32_t")],
    KERNELS["ffn_fused.rs"][1],
    lambda dt: [("D", 2048), ("F", 8192 if dt != "float32" else 4096), ("NBLK", 256 if dt != "float32" else 512),
                ("WARPS", 16), ("EPS_BITS", 925353388)],
)
# A conv layer with its feed-forward in one launch (MLX_LFM_CONV_LAYER_FUSED):
# the 8B-A1B's dense layer (4-bit) and, "@dense", the 1.2B's.
KERNELS["conv_layer_fused.rs"] = (
    [("h", "T"), ("r", "T"), ("wn", "T"), ("state", "T"), ("cw", "T"), ("iw", "uint32_t"), ("iscales", "T"),
     ("ibiases", "T"), ("ow", "uint32_t"), ("oscales", "T"), ("obiases", "T"), ("fwn", "T"), ("fw", "uint32_t"),
     ("fscales", "T"), ("fbiases", "T"), ("gw", "uint32_t"), ("gscales", "T"), ("gbiases", "T"), ("ctr", "uint32_t")],
    [("s", "T"), ("out", "T"), ("next", "T"), ("s1", "T"), ("yn", "T"), ("yc", "T"), ("o1", "T"), ("yn2", "T"),
     ("hk", "T")],
    lambda dt: [("D", 2048), ("C", 2048), ("KEEP", 2), ("F", 7168), ("NBLK", 256 if dt != "float32" else 512),
                ("WARPS", 16), ("EPS_BITS", 925353388), ("IBITS", 4), ("IGS", 64), ("OBITS", 4), ("OGS", 64),
                ("FBITS", 4), ("FGS", 64), ("GBITS", 4), ("GGS", 64)],
)
KERNELS["conv_layer_fused.rs@dense"] = (
    [("h", "T"), ("r", "T"), ("wn", "T"), ("state", "T"), ("cw", "T"), ("iw", "T"), ("ow", "T"), ("fwn", "T"),
     ("fw", "T"), ("gw", "T"), ("ctr", "uint32_t")],
    KERNELS["conv_layer_fused.rs"][1],
    lambda dt: [("D", 2048), ("C", 2048), ("KEEP", 2), ("F", 8192 if dt != "float32" else 4096),
                ("NBLK", 256 if dt != "float32" else 512), ("WARPS", 16), ("EPS_BITS", 925353388)],
)
# A conv layer with its MoE in one launch (MLX_LFM_CONV_LAYER_FUSED): the
# 8B-A1B's (4-bit), blocks of the MoE's 32 warps.
KERNELS["conv_layer_fused.rs#moe"] = (
    [("h", "T"), ("r", "T"), ("wn", "T"), ("state", "T"), ("cw", "T"), ("iw", "uint32_t"), ("iscales", "T"),
     ("ibiases", "T"), ("ow", "uint32_t"), ("oscales", "T"), ("obiases", "T"), ("fwn", "T"), ("gw", "uint32_t"),
     ("gscales", "T"), ("gbiases", "T"), ("bias", "float"), ("uw", "uint32_t"), ("uscales", "T"), ("ubiases", "T"),
     ("dw", "uint32_t"), ("dscales", "T"), ("dbiases", "T"), ("ctr", "uint32_t")],
    [("s", "T"), ("out", "T"), ("next", "T"), ("s1", "T"), ("yn", "T"), ("yc", "T"), ("o1", "T"), ("yn2", "T"),
     ("inds", "uint32_t"), ("scores", "float"), ("hk", "T")],
    lambda dt: [("D", 2048), ("C", 2048), ("KEEP", 2), ("F", 1792), ("E", 32), ("TOPK", 4), ("NORM", "true"),
                ("GBITS", 4), ("GGS", 64), ("BITS", 4), ("GS", 64), ("NBLK", 256 if dt != "float32" else 512),
                ("WARPS", 32), ("EPS_BITS", 925353388), ("SCALE_BITS", 1065353216), ("IBITS", 4), ("IGS", 64),
                ("OBITS", 4), ("OGS", 64)],
)
# Rows of 1,536 with 8,192-wide experts: 66 registers a thread, past the 64
# that 1,024 threads allow; kept to show why available_moe serves only rows
# of 1,024 and 2,048 (it builds, but must not be launched).
KERNELS["conv_layer_fused.rs#moe@d1536"] = (*KERNELS["conv_layer_fused.rs#moe"][:2],
                                            lambda dt: [("D", 1536), ("C", 1536), ("KEEP", 2), ("F", 8192), ("E", 32),
                                                        ("TOPK", 1), ("NORM", "true"), ("GBITS", 4), ("GGS", 64),
                                                        ("BITS", 4), ("GS", 128), ("NBLK", 256), ("WARPS", 32),
                                                        ("EPS_BITS", 925353388), ("SCALE_BITS", 1065353216),
                                                        ("IBITS", 4), ("IGS", 64), ("OBITS", 4), ("OGS", 64)],
                                            ["bfloat16", "float16"])
# An attention layer's out_proj joined to the feed-forward or MoE after it
# (MLX_LFM_CONV_LAYER_FUSED): "#out" the 1.2B's (dense), "#out-moe" the
# 8B-A1B's (4-bit, blocks of 32 warps).
KERNELS["conv_layer_fused.rs#out"] = (
    [("yc", "T"), ("r", "T"), ("ow", "T"), ("fwn", "T"), ("fw", "T"), ("gw", "T"), ("ctr", "uint32_t")],
    [("s", "T"), ("out", "T"), ("o1", "T"), ("yn2", "T"), ("hk", "T")],
    lambda dt: [("D", 2048), ("C", 2048), ("F", 8192 if dt != "float32" else 4096), ("NBLK", 256 if dt != "float32" else 512),
                ("WARPS", 16), ("EPS_BITS", 925353388)],
)
# A 4-bit model's attention layer with its dense feed-forward.
KERNELS["conv_layer_fused.rs#out-q"] = (
    [("yc", "T"), ("r", "T"), ("ow", "uint32_t"), ("oscales", "T"), ("obiases", "T"), ("fwn", "T"), ("fw", "uint32_t"),
     ("fscales", "T"), ("fbiases", "T"), ("gw", "uint32_t"), ("gscales", "T"), ("gbiases", "T"), ("ctr", "uint32_t")],
    [("s", "T"), ("out", "T"), ("o1", "T"), ("yn2", "T"), ("hk", "T")],
    lambda dt: [("D", 2048), ("C", 2048), ("F", 8192), ("NBLK", 256 if dt != "float32" else 512), ("WARPS", 16),
                ("EPS_BITS", 925353388), ("OBITS", 4), ("OGS", 64), ("FBITS", 4), ("FGS", 64), ("GBITS", 4), ("GGS", 64)],
)
KERNELS["conv_layer_fused.rs#out-moe"] = (
    [("yc", "T"), ("r", "T"), ("ow", "uint32_t"), ("oscales", "T"), ("obiases", "T"), ("fwn", "T"), ("gw", "uint32_t"),
     ("gscales", "T"), ("gbiases", "T"), ("bias", "float"), ("uw", "uint32_t"), ("uscales", "T"), ("ubiases", "T"),
     ("dw", "uint32_t"), ("dscales", "T"), ("dbiases", "T"), ("ctr", "uint32_t")],
    [("s", "T"), ("out", "T"), ("o1", "T"), ("yn2", "T"), ("inds", "uint32_t"), ("scores", "float"), ("hk", "T")],
    lambda dt: [("D", 2048), ("C", 2048), ("F", 1792), ("E", 32), ("TOPK", 4), ("NORM", "true"), ("GBITS", 4),
                ("GGS", 64), ("BITS", 4), ("GS", 64), ("NBLK", 256 if dt != "float32" else 512), ("WARPS", 32),
                ("EPS_BITS", 925353388), ("SCALE_BITS", 1065353216), ("OBITS", 4), ("OGS", 64)],
    ["bfloat16", "float16"],
)
# The router as checkpoints hold it: mlx-lm's LFM2-MoE recipe (and our
# convert) quantizes `feed_forward.gate` at 8 bits in groups of 64, the
# experts and the rest at 4; the entries above take a 4-bit router.
def router8(key):
    ins, outs, targs, *dts = KERNELS[key]
    g8 = lambda dt: [(k, 8 if k == "GBITS" else v) for k, v in targs(dt)]
    return (ins, outs, g8, *dts)


ROUTER8 = ["moe_fused.rs", "conv_layer_fused.rs#moe", "conv_layer_fused.rs#out-moe"]
for key in ROUTER8:
    KERNELS[key + "@g8"] = router8(key)


# The greedy test's WideMoe layers (src/kernels/tests.rs: two of 8 experts
# 256 wide, every projection 4-bit in groups of 32, the router 8-bit g64).
def wide_moe(key):
    ins, outs, targs, *dts = KERNELS[key]
    shape = {"F": 256, "E": 8, "TOPK": 2, "GBITS": 8, "GGS": 64, "GS": 32, "IGS": 32, "OGS": 32}
    return (ins, outs, lambda dt: [(k, shape.get(k, v)) for k, v in targs(dt)], *dts)


for key in ROUTER8:
    KERNELS[key + "@widemoe"] = wide_moe(key)
# A lone sequence's q/k/v stage in one launch (MLX_LFM_QKV_FUSED): the 8B-A1B's
# (4-bit) and, "@dense", the 1.2B's.
KERNELS["qk_norm_rope.rs#qkv_fused"] = (
    [("h", "T"), ("r", "T"), ("wn", "T"), ("iw", "uint32_t"), ("iscales", "T"), ("ibiases", "T"), ("qw", "T"), ("kw", "T"),
     ("offset", "int"), ("ctr", "uint32_t")],
    [("s", "T"), ("qo", "T"), ("ko", "T"), ("vo", "T"), ("yn", "T")],
    lambda dt: [("D", 2048 if dt != "float32" else 1024), ("HD", 64), ("QH", 32), ("KVH", 8),
                ("NBLK", 256), ("WARPS", 16), ("EPS_NORM_BITS", 925353388), ("EPS_BITS", 925353388),
                ("BASE_BITS", 1100968922), ("IBITS", 4), ("IGS", 64)],
)
KERNELS["qk_norm_rope.rs#qkv_fused@dense"] = (
    [("h", "T"), ("r", "T"), ("wn", "T"), ("iw", "T"), ("qw", "T"), ("kw", "T"), ("offset", "int"), ("ctr", "uint32_t")],
    KERNELS["qk_norm_rope.rs#qkv_fused"][1],
    lambda dt: [("D", 2048 if dt != "float32" else 1024), ("HD", 64), ("QH", 32), ("KVH", 8), ("NBLK", 256),
                ("WARPS", 16), ("EPS_NORM_BITS", 925353388), ("EPS_BITS", 925353388), ("BASE_BITS", 1100968922)],
)
# A head over 32 warps (MLX_LFM_QKV_WARPS=32): blocks of 1,024 threads, so
# at most 64 registers; heads of 64 (the models') and of 128 (the widest
# served), 4-bit and dense.
for _k in ("qk_norm_rope.rs#qkv_fused", "qk_norm_rope.rs#qkv_fused@dense"):
    for _hd in (64, 128):
        KERNELS[_k + ("-" if "@" in _k else "@") + f"w32-hd{_hd}"] = (
            *KERNELS[_k][:2], lambda dt, _k=_k, _hd=_hd: [(n, 32 if n == "WARPS" else _hd if n == "HD" else v)
                                                        for n, v in KERNELS[_k][2](dt)])
# Every wait given up at once (the tests' MLX_LFM_FUSED_NO_WAIT: DEFINES_OF).
KERNELS["moe_fused.rs@no-wait"] = KERNELS["moe_fused.rs"]
# The experts in MLX's arithmetic (MLX_LFM_MOE_EXACT: moe_fused.rs
# EXACT_DEFINES, DEFINES_OF), with 8-bit experts, the scratch rows in the
# state, and the most registers' shape.
KERNELS["moe_fused.rs@exact"] = KERNELS["moe_fused.rs"]
KERNELS["moe_fused.rs@exact8"] = (*KERNELS["moe_fused.rs"][:2],
                                  lambda dt: [(n, 8 if n == "BITS" else v) for n, v in KERNELS["moe_fused.rs"][2](dt)])
KERNELS["moe_fused.rs@exact-scratch"] = KERNELS["moe_fused.rs@scratch"]
KERNELS["moe_fused.rs@exact-d1536"] = KERNELS["moe_fused.rs@d1536"]
# 8-bit experts on rows of 1,536: the most registers under MLX_LFM_QINT
# (64 of the 64 that 1,024 threads allow, session 37's sweep).
KERNELS["moe_fused.rs@exact8-d1536"] = (*KERNELS["moe_fused.rs@d1536"][:2],
                                        lambda dt: [(n, 8 if n == "BITS" else 64 if n == "GS" else v)
                                                    for n, v in KERNELS["moe_fused.rs@d1536"][2](dt)],
                                        KERNELS["moe_fused.rs@d1536"][3])
# The down rows asked of L2 by the gate/up blocks (MLX_LFM_MOE_DOWN_PREFETCH:
# its define and helpers, DEFINES_OF, HEADER_AFTER), before their rows
# (pf) and after (pfa), with the scratch rows in the state, with the experts
# exact (the default), and on the most registers' shapes.
KERNELS["moe_fused.rs@pf"] = KERNELS["moe_fused.rs"]
KERNELS["moe_fused.rs@pfa"] = KERNELS["moe_fused.rs"]
KERNELS["moe_fused.rs@pf-scratch"] = KERNELS["moe_fused.rs@scratch"]
KERNELS["moe_fused.rs@exact-pf"] = KERNELS["moe_fused.rs"]
KERNELS["moe_fused.rs@exact-pfa"] = KERNELS["moe_fused.rs"]
KERNELS["moe_fused.rs@exact-pf-scratch"] = KERNELS["moe_fused.rs@scratch"]
KERNELS["moe_fused.rs@pf-d1536"] = KERNELS["moe_fused.rs@d1536"]
KERNELS["moe_fused.rs@exact8-pf-d1536"] = KERNELS["moe_fused.rs@exact8-d1536"]
# Two gate/up outputs a warp (MLX_LFM_MOE_GATE_ROWS=2: moe_fused.rs
# gate_rows, Form::header; the experts exact only), with the scratch rows
# in the state and the down rows' prefetch: within the 64 registers 1,024
# threads allow (moe_fused.rs registers_fit_two has the sweep).
_MOE_G2 = (("@exact-g2", "@exact"), ("@exact-g2-scratch", "@exact-scratch"), ("@exact-pf-g2", "@exact-pf"))
# ...and two down columns a warp (MLX_LFM_MOE_DOWN_COLS=2: moe_fused.rs
# down_cols), alone and with two gate/up outputs.
_MOE_D2 = (("@exact-d2", "@exact"), ("@exact-d2-scratch", "@exact-scratch"), ("@exact-pf-d2", "@exact-pf"),
           ("@exact-g2-d2", "@exact"), ("@exact-g2-d2-scratch", "@exact-scratch"))
for _v, _of in _MOE_G2 + _MOE_D2:
    KERNELS["moe_fused.rs" + _v] = KERNELS["moe_fused.rs" + _of]
# The bench's timeline form: the stamps an extra int64 output (REPLACE_OF).
KERNELS["moe_fused.rs@timeline"] = (KERNELS["moe_fused.rs"][0], KERNELS["moe_fused.rs"][1] + [("times", "long long")],
                                    KERNELS["moe_fused.rs"][2])
# ...of the form that ships (the experts exact) and with the down rows'
# prefetch (moe_fused.rs timeline_kernel takes a plain launch's form).
KERNELS["moe_fused.rs@exact-timeline"] = KERNELS["moe_fused.rs@timeline"]
KERNELS["moe_fused.rs@exact-pf-timeline"] = KERNELS["moe_fused.rs@timeline"]
KERNELS["moe_fused.rs@exact-g2-timeline"] = KERNELS["moe_fused.rs@timeline"]
KERNELS["moe_fused.rs@exact-g2-d2-timeline"] = KERNELS["moe_fused.rs@timeline"]
# The conv layer's and feed-forward's rows asked of L2 before their waits
# (MLX_LFM_EARLY_PREFETCH: stages.rs EARLY_SUBSTITUTIONS, early_header).
for _k in ("conv_fused.rs", "ffn_fused.rs", "qk_norm_rope.rs#qkv_fused"):
    KERNELS[_k + "@early"] = KERNELS[_k]
    KERNELS[_k + "@dense-early"] = KERNELS[_k + "@dense"]
# The conv layer's timeline forms (the bench's), by default and early.
for _v in ("@timeline", "@early-timeline", "@dense-timeline", "@dense-early-timeline"):
    _base = KERNELS["conv_fused.rs@dense" if "dense" in _v else "conv_fused.rs"]
    KERNELS["conv_fused.rs" + _v] = (_base[0], _base[1] + [("times", "long long")], _base[2])
KERNELS["conv_fused.rs@no-wait"] = KERNELS["conv_fused.rs"]
# The feed-forward's timeline forms (the bench's), 4-bit and dense.
for _v in ("@timeline", "@dense-timeline"):
    _base = KERNELS["ffn_fused.rs@dense" if "dense" in _v else "ffn_fused.rs"]
    KERNELS["ffn_fused.rs" + _v] = (_base[0], _base[1] + [("times", "long long")], *_base[2:])

# Two gate outputs a warp (MLX_LFM_FFN_GATE_ROWS=2: ffn_fused.rs gate_outs),
# 4-bit and dense, plain, early and the bench's timeline form.
for _v in ("@g2", "@g2-early", "@g2-timeline", "@g2-early-timeline", "@dense-g2", "@dense-g2-early", "@dense-g2-timeline",
           "@dense-g2-early-timeline"):
    _base = "ffn_fused.rs" + ("@dense" if "dense" in _v else "")
    if "timeline" in _v:
        _base += "-timeline" if "dense" in _v else "@timeline"
    KERNELS["ffn_fused.rs" + _v] = KERNELS[_base]

KERNELS["ffn_fused.rs@dense-g2r"] = KERNELS["ffn_fused.rs@dense"]
KERNELS["ffn_fused.rs@dense-g2r-timeline"] = KERNELS["ffn_fused.rs@dense-timeline"]
KERNELS["ffn_fused.rs@dense-g2r-early"] = KERNELS["ffn_fused.rs@dense"]
KERNELS["ffn_fused.rs@dense-r4"] = KERNELS["ffn_fused.rs@dense"]

# The folds with their first column's rows prefetched before the prologue
# (MLX_LFM_NORM_GEMV_PREFETCH=early: NAME_EARLY before it), each as its fold.
for _fold in ("dense", "swiglu", "quant"):
    KERNELS[f"norm_gemv.rs#{_fold}@early"] = KERNELS[f"norm_gemv.rs#{_fold}"]
# The deferred folds (MLX_LFM_NORM_GEMV_DEFERRED): eps always compiled in.
for _fold in ("dense", "swiglu"):
    KERNELS[f"norm_gemv.rs#{_fold}_deferred"] = (*KERNELS[f"norm_gemv.rs#{_fold}"][:2],
                                                lambda dt, m=(1 if _fold == "dense" else 2): [("K", 2048), ("M", m),
                                                                                             ("EPS_BITS", 925353388)])
# The folds with eps compiled in (MLX_LFM_EPS_CONST: REPLACE_OF's substitution).
for _fold in ("dense", "swiglu", "quant"):
    _ins, _outs, _targs = KERNELS[f"norm_gemv.rs#{_fold}"]
    KERNELS[f"norm_gemv.rs#{_fold}@epsc"] = (_ins, _outs, lambda dt, t=_targs: t(dt) + [("EPS_BITS", 925353388)])


def header_of(path):
    """A file's device code as its Rust side joins it (`header()`)."""
    k = path.parent
    gemv = named(k / "gemv.rs", "ALIGN_HEADER") + named(k / "gemv.rs", "HEADER")
    if path.name == "gemv.rs":
        return gemv
    if path.name == "add_rms_norm.rs":
        return named(path, "HEADER") + named(k / "gemv.rs", "ALIGN_HEADER")
    if "quant_gemv::{header" in path.read_text() or path.name == "quant_gemv.rs":
        return gemv + named(k / "quant_gemv.rs", "QUANT_HEADER")
    return named(path, "HEADER")


def named(path, name):
    """The text of a const NAME: &str = "..." or r#"..."#."""
    text = path.read_text()
    hdr = re.search(r'const ' + name + r': &str = (?:r#"(.*?)"#|"(.*?)");', text, re.S)
    if not hdr:
        return ""
    return hdr.group(1) if hdr.group(1) is not None else hdr.group(2).replace("\\n", "\n").replace('\\"', '"')


def staged_header(k):
    """A one-launch layer's header (src/kernels/conv_fused.rs, ffn_fused.rs,
    qkv_fused.rs): the add + RMSNorm code, the GEMV's (and the quantized
    one's), the ticket helpers, the projections' products (stages.rs; the
    dense ones for a variant "@dense")."""
    lead = "#define LFM_NORM_IN_WIDER_BLOCK 1\n" + named(k / "add_rms_norm.rs", "HEADER")
    ticket = named(k / "stages.rs", "TICKET_HEADER")
    if DENSE:
        return lead + header_of(k / "gemv.rs") + ticket + named(k / "stages.rs", "DENSE_PRODUCTS")
    return lead + header_of(k / "quant_gemv.rs") + ticket + named(k / "stages.rs", "QUANT_PRODUCTS")


def body_and_header(path, which="SOURCE"):
    text = path.read_text()
    if path.name == "moe_fused.rs":
        # stages.rs's LAYER_SOURCE (its MoE part, by DEFINES_OF) over the
        # router + norm kernel's header and the ticket helpers.
        k = path.parent
        lead = "#define LFM_NORM_IN_WIDER_BLOCK 1\n" + named(k / "add_rms_norm.rs", "HEADER") + header_of(k / "quant_gemv.rs")
        return named(k / "stages.rs", "LAYER_SOURCE"), (lead + named(k / "moe_router.rs", "ROUTE_HEADER")
                                                       + named(k / "moe_router.rs", "GATE_HEADER") + named(k / "stages.rs", "TICKET_HEADER"))
    if path.name == "conv_layer_fused.rs" and "OUT" in which:
        # out_proj joined to the tail: the MoE's header (the router + norm
        # kernel's) and the quantized products, or the dense GEMVs' and the
        # feed-forward's rows.
        k = path.parent
        lead = "#define LFM_NORM_IN_WIDER_BLOCK 1\n" + named(k / "add_rms_norm.rs", "HEADER")
        ticket = named(k / "stages.rs", "TICKET_HEADER")
        if "MOE" in which:
            return named(k / "stages.rs", "LAYER_SOURCE"), (lead + header_of(k / "quant_gemv.rs") + named(k / "moe_router.rs", "ROUTE_HEADER")
                                                           + named(k / "moe_router.rs", "GATE_HEADER") + ticket
                                                           + named(k / "stages.rs", "QUANT_PRODUCTS"))
        if "-Q" in which:
            return named(k / "stages.rs", "LAYER_SOURCE"), (lead + header_of(k / "quant_gemv.rs") + ticket
                                                           + named(k / "stages.rs", "QUANT_PRODUCTS") + named(path, "QUANT_FFN_ROWS"))
        return named(k / "stages.rs", "LAYER_SOURCE"), (lead + header_of(k / "gemv.rs") + ticket + named(k / "stages.rs", "DENSE_PRODUCTS")
                                                       + named(path, "DENSE_FFN_ROWS"))
    if path.name == "conv_layer_fused.rs" and "MOE" in which:
        # The conv layer joined to its MoE: the router + norm kernel's
        # header, the ticket helpers, the conv's quantized products.
        k = path.parent
        lead = "#define LFM_NORM_IN_WIDER_BLOCK 1\n" + named(k / "add_rms_norm.rs", "HEADER") + header_of(k / "quant_gemv.rs")
        return named(k / "stages.rs", "LAYER_SOURCE"), (lead + named(k / "moe_router.rs", "ROUTE_HEADER")
                                                       + named(k / "moe_router.rs", "GATE_HEADER")
                                                       + named(k / "stages.rs", "TICKET_HEADER") + named(k / "stages.rs", "QUANT_PRODUCTS"))
    if path.name in ("ffn_fused.rs", "conv_fused.rs", "conv_layer_fused.rs"):
        # One body for the three (stages.rs's LAYER_SOURCE, its parts chosen
        # by DEFINES_OF); the joined kernel's feed-forward rows beside the
        # conv's products.
        rows = named(path, "DENSE_FFN_ROWS" if DENSE else "QUANT_FFN_ROWS") if path.name == "conv_layer_fused.rs" else ""
        return named(path.parent / "stages.rs", "LAYER_SOURCE"), staged_header(path.parent) + rows
    if path.name == "qk_norm_rope.rs":
        # Each body is a `concat!` of raw strings and macros (`qkv_heads!`,
        # `norm_rope_body!`), each macro one raw string: joined in order.
        start = re.search(which + r': &str = concat!\(', text).end()
        end = text.index("\n);", start)
        macro = lambda m: re.search(r'macro_rules! ' + m + r' \{.*?r#"(.*?)"#', text, re.S).group(1)
        parts = re.findall(r'r#"(.*?)"#|(\w+)!\(\)', text[start:end], re.S)
        body = "".join(lit if name == "" else macro(name) for lit, name in parts)
        if "QKV_FUSED" in which:
            # The fused q/k/v stage (src/kernels/qkv_fused.rs joins its
            # header as the other one-launch layers do).
            k = path.parent
            return body, staged_header(k)
        return body, ""
    src = re.search(which + r': &str = r#"(.*?)"#;', text, re.S).group(1)
    if path.name == "norm_gemv.rs" and "DEFERRED" in which:
        # The deferred folds: no prologue; the GEMV's header, then theirs.
        return src, header_of(path.parent / "gemv.rs") + named(path, "DEFERRED_HEADER")
    if path.name == "norm_gemv.rs":
        # As norm_gemv.rs joins them: PROLOGUE before each body; the add +
        # RMSNorm header, the GEMV's, the quantized one for QUANT_SOURCE.
        k = path.parent
        src = named(path, "PROLOGUE") + src
        if EARLY:
            src = named(path, which.split()[-1].replace("SOURCE", "EARLY")) + src
        quant = named(k / "quant_gemv.rs", "QUANT_HEADER") if "QUANT" in which else ""
        return src, named(k / "add_rms_norm.rs", "HEADER") + header_of(k / "gemv.rs") + quant
    if path.name == "decode_attention.rs":
        # As decode_attention.rs makes its two kernels: the mask's validity
        # or the position's in the body.
        return src.replace("__VALIDITY__", named(path, VALIDITY)), header_of(path)
    if path.name == "moe_gemm.rs":
        return src, header_of(path.parent / "gemv.rs") + named(path, "MMA_HEADER")
    if path.name == "moe_router.rs":
        # The route's header; the gate kernel's after the quantized GEMV's.
        k = path.parent
        lead = header_of(k / "quant_gemv.rs") if "GATE" in which else ""
        if "GATE_NORM" in which:
            # The add + RMSNorm code first, as route_gate_norm's kernel joins
            # them (its block may be wider than the norm's 256 threads).
            lead = "#define LFM_NORM_IN_WIDER_BLOCK 1\n" + named(k / "add_rms_norm.rs", "HEADER") + lead
        gate = named(path, "GATE_HEADER") if "GATE" in which else ""
        return src, lead + named(path, "ROUTE_HEADER") + gate
    if path.name == "short_conv.rs" and "GEMV" in which:
        # The in_proj + step kernel takes the GEMV's header (the plain step none).
        return src, header_of(path.parent / "gemv.rs")
    if path.name == "moe_experts.rs" and "DOWN" in which and LOADS:
        return src, header_of(path) + named(path, "DOWN_EARLY_HEADER")
    if path.name == "argmax_finite.rs" and "VEC" in which:
        # The chunked scan: its block reduction as a helper after the header.
        return src, header_of(path) + named(path, "BLOCK_HEADER")
    return src, header_of(path)


def opt(name):
    return next((a.split("=", 1)[1] for a in sys.argv if a.startswith(f"--{name}=")), None)


PTXAS = opt("ptxas")
# --only=gemv.rs (a KERNELS key): that kernel alone. --sass=DIR (with
# --ptxas and --cuobjdump=PATH, which needs nvdisasm beside it: pip
# "nvidia-cuda-cuobjdump==13.*" "nvidia-cuda-nvdisasm==13.*"): each compiled
# kernel's SASS into DIR, to see where ptxas put the loads.
ONLY = opt("only")
SASS = opt("sass")
CUOBJDUMP = opt("cuobjdump")
PTX_DIR = Path(opt("ptx-dir")) if opt("ptx-dir") else None
DTYPES = [d.strip() for d in opt("dtypes").split(",")] if opt("dtypes") else None
# (A name it does not know would skip every kernel and pass.)
assert DTYPES is None or set(DTYPES) <= set(CTYPE), f"--dtypes: one of {sorted(CTYPE)}, not {DTYPES}"


def resources(name, prog):
    """ptxas -v on the program's PTX: registers, spills and shared memory
    per thread/block for sm_90 (what decides a kernel's occupancy)."""
    import subprocess
    import tempfile
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    with tempfile.NamedTemporaryFile("wb", suffix=".ptx", delete=False) as f:
        f.write(ptx.value)
    cubin = f.name[:-4] + ".cubin"
    r = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90", "-o", cubin, f.name], capture_output=True, text=True)
    if SASS and CUOBJDUMP:
        out = Path(SASS) / (name.replace("#", "-") + ".sass")
        out.parent.mkdir(parents=True, exist_ok=True)
        env = {"PATH": str(Path(CUOBJDUMP).parent)}
        out.write_text(subprocess.run([CUOBJDUMP, "-sass", cubin], capture_output=True, text=True, env=env).stdout)
    return " ".join(l.split("ptxas info    : ", 1)[-1] for l in r.stderr.splitlines() if "Used" in l or "spill" in l)


def compile_one(name, code, ptx_to=None):
    prog = ctypes.c_void_p()
    rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), name.encode(), 0, None, None)
    assert rc == 0, rc
    opts = [b"--gpu-architecture=compute_90", b"-std=c++17", b"-I" + str(inc).encode(),
            b"-I" + str(inc / "cccl").encode()]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if rc == 0 and PTXAS:
        print("   ", resources(name, prog))
    if ptx_to and rc != 0:
        # (No file where it failed: a previous run's would read as this one's.)
        ptx_to.unlink(missing_ok=True)
    if rc == 0 and ptx_to:
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetPTX(prog, buf)
        ptx_to.parent.mkdir(parents=True, exist_ok=True)
        ptx_to.write_bytes(buf.raw)
    return rc, log.value.decode(errors="replace")


def ptx_of(name, code):
    """The PTX NVRTC makes of `code` (None where it does not compile)."""
    prog = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), name.encode(), 0, None, None) == 0
    opts = [b"--gpu-architecture=compute_90", b"-std=c++17", b"-I" + str(inc).encode(),
            b"-I" + str(inc / "cccl").encode()]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    if nvrtc.nvrtcCompileProgram(prog, len(opts), arr) != 0:
        return None
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetPTX(prog, buf)
    return buf.raw


# --files: each kernel also as CudaKernel hands it to MLX with
# its texts in files, the default since session 39 (src/mlx/kernel_text.rs): its header and body in
# files that two #include lines name (the body's after a comment naming the
# shapes it reads, where MLX looks for them); the PTX must be the inline
# text's, byte for byte.
FILES = "--files" in sys.argv
FILES_DIR = Path(tempfile.mkdtemp(prefix="nvrtc-files-")) if FILES else None


def shape_params(ins, src):
    """The shape, strides and rank arguments MLX adds where `src` names them."""
    return [(n, s) for n, _ in ins for s in ("_shape", "_strides", "_ndim") if f"{n}{s}" in src]


# --define=NAME=VALUE (repeatable): a #define before every kernel's text,
# as a kernel variant's Rust side prepends one (e.g. LFM_DENSE_PLAIN=1, the
# GEMVs' MLX_LFM_GEMV_LOOP=plain walk).
DEFINES = "".join(f"#define {a.split('=', 2)[1]} {a.split('=', 2)[2]}\n" for a in sys.argv if a.startswith("--define="))
# --qint=pairs|bits|convert: how the MLX-exact quantized walk makes q, as
# quant_gemv.rs `header()` defines it for MLX_LFM_QINT (pairs, the default
# since session 38).
QINT = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--qint=")), "pairs")
DEFINES = {"pairs": "#define LFM_QINT_BITS 1\n#define LFM_QINT_PAIRS 1\n", "bits": "#define LFM_QINT_BITS 1\n",
           "convert": ""}[QINT] + DEFINES
VALIDITY = "MASK_VALID"
EARLY = False
LOADS = False
DENSE = False
# A kernel variant's text substitution, as its Rust side makes it.
def substitutions(path, name):
    """A Rust `const NAME: [(&str, &str); N]` of (was, now) string pairs."""
    text = (root / "src" / "kernels" / path).read_text()
    # ("const NAME", so that a NAME ending another's, SPLIT_EARLY_ for
    # EARLY_, is not taken for it.)
    body = re.search(r"const " + name + r": \[\(&str, &str\); \d+\] = \[(.*?)\n\];", text, re.S).group(1)
    lit = r'"((?:[^"\\]|\\.)*)"'
    unescape = lambda t: t.replace("\\n", "\n").replace('\\"', '"')
    return [(unescape(a), unescape(b)) for a, b in re.findall(r"\(\s*" + lit + r",\s*" + lit + r",?\s*\)", body)]


def rust_tokens(text):
    """String literals ("..." and r#"..."#, unescaped), names (paths and
    macro variables whole), and the punctuation between them."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c.isspace():
            i += 1
        elif text.startswith('r#"', i):
            j = text.index('"#', i + 3)
            out.append(("s", text[i + 3:j]))
            i = j + 2
        elif c == '"':
            j = i + 1
            while text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(("s", text[i + 1:j].replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")))
            i = j + 1
        elif c.isalnum() or c in "_$:":
            j = i
            while j < len(text) and (text[j].isalnum() or text[j] in "_$:"):
                j += 1
            out.append(("n", text[i:j]))
            i = j
        else:
            out.append((c, c))
            i += 1
    return out


def own_norm(eps):
    """stages.rs's `own_norm!(eps)`: its `concat!` with `$eps` put in."""
    text = (root / "src" / "kernels" / "stages.rs").read_text()
    body = re.search(r"macro_rules! own_norm \{.*?=> \{\s*(concat!\(.*?\n\s*\))\s*\};", text, re.S).group(1)
    toks = [("s", eps) if t == ("n", "$eps") else t for t in rust_tokens(body)]
    return rust_value(toks, 0)[0]


def rust_value(toks, i):
    """The string the expression at toks[i] makes (a literal, `concat!` of
    such, `own_norm!`), and the index after it."""
    kind, val = toks[i]
    if kind == "s":
        return val, i + 1
    assert kind == "n" and toks[i + 1][0] == "!" and toks[i + 2][0] == "(", f"not a string expression: {toks[i:i + 3]}"
    args, i = [], i + 3
    while toks[i][0] != ")":
        v, i = rust_value(toks, i)
        args.append(v)
        if toks[i][0] == ",":
            i += 1
    name = val.rsplit("::", 1)[-1]
    if name == "concat":
        return "".join(args), i + 1
    if name == "own_norm":
        return own_norm(args[0]), i + 1
    raise AssertionError(f"unknown macro {val}!")


def pair_const(path, name):
    """A Rust `const NAME: (&str, &str) = (was, now);` of literals,
    `concat!` and `own_norm!`."""
    text = (root / "src" / "kernels" / path).read_text()
    start = re.search(r"const " + name + r": \(&str, &str\) = \(", text).end()
    toks = rust_tokens(text[start:text.index("\n);", start)])
    was, i = rust_value(toks, 0)
    assert toks[i][0] == ",", f"{path} {name}"
    now, _ = rust_value(toks, i + 1)
    return was, now


REPLACE_OF = {
    "add_rms_norm.rs@epsc": substitutions("add_rms_norm.rs", "EPS_CONST_SUBSTITUTIONS"),
    "moe_router.rs#gate_norm@const": substitutions("moe_router.rs", "GATE_NORM_CONST_SUBSTITUTIONS"),
    "moe_experts.rs#down@loads": substitutions("moe_experts.rs", "DOWN_EARLY_SUBSTITUTIONS"),
    "moe_gemm.rs@gathered": substitutions("moe_gemm.rs", "GATHERED_SUBSTITUTIONS"),
    **{f"norm_gemv.rs#{f}@epsc": substitutions("add_rms_norm.rs", "EPS_CONST_SUBSTITUTIONS") for f in ("dense", "swiglu", "quant")},
    # The bench's timeline form (stages.rs TIMELINE_HEADER): stamps in.
    "moe_fused.rs@timeline": substitutions("stages.rs", "TIMELINE_SUBSTITUTIONS"),
    "moe_fused.rs@exact-timeline": substitutions("stages.rs", "TIMELINE_SUBSTITUTIONS"),
    "moe_fused.rs@exact-pf-timeline": substitutions("stages.rs", "TIMELINE_SUBSTITUTIONS"),
    "moe_fused.rs@exact-g2-timeline": substitutions("stages.rs", "TIMELINE_SUBSTITUTIONS"),
    "moe_fused.rs@exact-g2-d2-timeline": substitutions("stages.rs", "TIMELINE_SUBSTITUTIONS"),
    **{_k + v: substitutions("stages.rs", "EARLY_SUBSTITUTIONS") for _k in ("conv_fused.rs", "ffn_fused.rs")
       for v in ("@early", "@dense-early")},
    **{"qk_norm_rope.rs#qkv_fused" + v: substitutions("qkv_fused.rs", "EARLY_SUBSTITUTIONS") for v in ("@early", "@dense-early")},
    "conv_fused.rs@timeline": substitutions("stages.rs", "TIMELINE_SUBSTITUTIONS"),
    "ffn_fused.rs@timeline": substitutions("stages.rs", "TIMELINE_SUBSTITUTIONS"),
    "ffn_fused.rs@dense-timeline": substitutions("stages.rs", "TIMELINE_SUBSTITUTIONS"),
    "ffn_fused.rs@dense-g2r-timeline": substitutions("stages.rs", "TIMELINE_SUBSTITUTIONS"),
    "ffn_fused.rs@dense-g2r-early": substitutions("stages.rs", "EARLY_SUBSTITUTIONS"),
    "conv_fused.rs@dense-timeline": substitutions("stages.rs", "TIMELINE_SUBSTITUTIONS"),
    **{"conv_fused.rs" + v: substitutions("stages.rs", "EARLY_SUBSTITUTIONS") + substitutions("stages.rs", "TIMELINE_SUBSTITUTIONS")
       for v in ("@early-timeline", "@dense-early-timeline")},
    **{"ffn_fused.rs" + v: substitutions("stages.rs", "EARLY_SUBSTITUTIONS") for v in ("@g2-early", "@dense-g2-early")},
    **{"ffn_fused.rs" + v: substitutions("stages.rs", "TIMELINE_SUBSTITUTIONS") for v in ("@g2-timeline", "@dense-g2-timeline")},
    **{"ffn_fused.rs" + v: substitutions("stages.rs", "EARLY_SUBSTITUTIONS") + substitutions("stages.rs", "TIMELINE_SUBSTITUTIONS")
       for v in ("@g2-early-timeline", "@dense-g2-early-timeline")},
}
# A kernel variant's own #define, as its Rust side prepends it.
# The parts of stages.rs's LAYER_SOURCE each kernel compiles (its
# layer_defines).
LAYER_CONV = "#define LFM_CONV_PART 1\n#define LFM_FFN_PART 0\n#define LFM_MOE_PART 0\n#define LFM_CONV_SUM s\n#define LFM_CONV_ROW out\n"
LAYER_FFN = ("#define LFM_CONV_PART 0\n#define LFM_FFN_PART 1\n#define LFM_MOE_PART 0\n#define LFM_FFN_YN yn\n"
             "#define LFM_F_ROWS(K, R, rows, xs, lane, out) LFM_IN_ROWS(K, R, rows, xs, lane, out)\n#define LFM_G_ROWS(K, R, rows, xs, lane, out) LFM_OUT_ROWS(K, R, rows, xs, lane, out)\n")
LAYER_BOTH = "#define LFM_CONV_PART 1\n#define LFM_FFN_PART 1\n#define LFM_MOE_PART 0\n#define LFM_CONV_SUM s1\n#define LFM_CONV_ROW o1\n#define LFM_FFN_YN yn2\n#define LFM_TAIL_RESIDUAL s1\n"
LAYER_MOE = "#define LFM_CONV_PART 0\n#define LFM_FFN_PART 0\n#define LFM_MOE_PART 1\n#define LFM_FFN_YN yn\n"
LAYER_CONV_MOE = ("#define LFM_CONV_PART 1\n#define LFM_FFN_PART 0\n#define LFM_MOE_PART 1\n#define LFM_CONV_SUM s1\n"
                  "#define LFM_CONV_ROW o1\n#define LFM_FFN_YN yn2\n#define LFM_TAIL_RESIDUAL s1\n")
LAYER_OUT_FFN = ("#define LFM_CONV_PART 1\n#define LFM_OUT_ONLY 1\n#define LFM_FFN_PART 1\n#define LFM_MOE_PART 0\n"
                 "#define LFM_CONV_ROW o1\n#define LFM_FFN_YN yn2\n#define LFM_TAIL_RESIDUAL r\n")
LAYER_OUT_MOE = ("#define LFM_CONV_PART 1\n#define LFM_OUT_ONLY 1\n#define LFM_FFN_PART 0\n#define LFM_MOE_PART 1\n"
                 "#define LFM_CONV_ROW o1\n#define LFM_FFN_YN yn2\n#define LFM_TAIL_RESIDUAL r\n")
# The quantized GEMV (MLX's arithmetic, its only walk since session 56)
# over one row too.
KERNELS["quant_gemv.rs@m1"] = (*KERNELS["quant_gemv.rs"][:2], lambda dt: [("K", 2048), ("BITS", 4), ("GS", 64), ("M", 1)])
DEFINES_OF = {
    "decode_attention.rs@upto-split16": "#define LFM_ATT_DPB 16\n",
    "decode_attention.rs@upto-split8": "#define LFM_ATT_DPB 8\n",
    "moe_fused.rs": LAYER_MOE,
    "moe_fused.rs@d1536": LAYER_MOE,
    "moe_fused.rs@no-wait": "#define LFM_SPIN_LIMIT 0\n" + LAYER_MOE,
    "moe_fused.rs@scratch": LAYER_MOE,
    "moe_fused.rs@timeline": named(root / "src" / "kernels" / "stages.rs", "TIMELINE_HEADER") + LAYER_MOE,
    "conv_fused.rs": "#define LFM_QMLX_TILES 2\n" + LAYER_CONV,
    "conv_fused.rs@no-wait": "#define LFM_SPIN_LIMIT 0\n#define LFM_QMLX_TILES 2\n" + LAYER_CONV,
    "conv_fused.rs@dense": "#define LFM_DENSE_PREFETCH 0\n" + LAYER_CONV,
    "ffn_fused.rs": "#define LFM_QMLX_TILES 2\n" + LAYER_FFN,
    "ffn_fused.rs@dense": "#define LFM_DENSE_PREFETCH 0\n" + LAYER_FFN,
    "conv_layer_fused.rs": "#define LFM_QMLX_TILES 2\n" + LAYER_BOTH,
    "conv_layer_fused.rs@dense": "#define LFM_DENSE_PREFETCH 0\n" + LAYER_BOTH,
    "conv_layer_fused.rs#moe": "#define LFM_QMLX_TILES 2\n" + LAYER_CONV_MOE,
    "conv_layer_fused.rs#out": "#define LFM_DENSE_PREFETCH 0\n" + LAYER_OUT_FFN,
    "conv_layer_fused.rs#out-moe": "#define LFM_QMLX_TILES 2\n" + LAYER_OUT_MOE,
    "conv_layer_fused.rs#out-q": "#define LFM_QMLX_TILES 2\n" + LAYER_OUT_FFN,
    "conv_layer_fused.rs#moe@d1536": "#define LFM_QMLX_TILES 2\n" + LAYER_CONV_MOE,
    "qk_norm_rope.rs#qkv_fused": "#define LFM_QMLX_TILES 2\n",
    "qk_norm_rope.rs#qkv_fused@dense": "#define LFM_DENSE_PREFETCH 0\n",
}
for _hd in (64, 128):
    DEFINES_OF[f"qk_norm_rope.rs#qkv_fused@w32-hd{_hd}"] = DEFINES_OF["qk_norm_rope.rs#qkv_fused"]
    DEFINES_OF[f"qk_norm_rope.rs#qkv_fused@dense-w32-hd{_hd}"] = DEFINES_OF["qk_norm_rope.rs#qkv_fused@dense"]
# (The 8-bit router's and the WideMoe variants take their kernel's defines.)
DEFINES_OF.update({key + variant: DEFINES_OF[key] for key in ROUTER8 for variant in ("@g8", "@widemoe")})

_STAGES = root / "src" / "kernels" / "stages.rs"
for _k in ("conv_fused.rs", "ffn_fused.rs", "qk_norm_rope.rs#qkv_fused"):
    DEFINES_OF[_k + "@early"] = (named(_STAGES, "PREFETCH_HEADER") + named(_STAGES, "EARLY_QUANT_ROWS")
                                 + DEFINES_OF[_k])
    DEFINES_OF[_k + "@dense-early"] = (named(_STAGES, "PREFETCH_HEADER") + named(_STAGES, "EARLY_DENSE_ROWS")
                                       + DEFINES_OF[_k + "@dense"])
_TL = named(_STAGES, "TIMELINE_HEADER")
DEFINES_OF["conv_fused.rs@timeline"] = _TL + DEFINES_OF["conv_fused.rs"]
DEFINES_OF["ffn_fused.rs@timeline"] = _TL + DEFINES_OF["ffn_fused.rs"]
DEFINES_OF["ffn_fused.rs@dense-timeline"] = _TL + DEFINES_OF["ffn_fused.rs@dense"]
DEFINES_OF["conv_fused.rs@dense-timeline"] = _TL + DEFINES_OF["conv_fused.rs@dense"]
DEFINES_OF["conv_fused.rs@early-timeline"] = _TL + DEFINES_OF["conv_fused.rs@early"]
DEFINES_OF["conv_fused.rs@dense-early-timeline"] = _TL + DEFINES_OF["conv_fused.rs@dense-early"]
_G2 = "#define LFM_GATE_OUTS 2\n"
DEFINES_OF["ffn_fused.rs@g2"] = _G2 + DEFINES_OF["ffn_fused.rs"]
DEFINES_OF["ffn_fused.rs@dense-g2"] = _G2 + DEFINES_OF["ffn_fused.rs@dense"]
DEFINES_OF["ffn_fused.rs@g2-early"] = DEFINES_OF["ffn_fused.rs@early"] + _G2
DEFINES_OF["ffn_fused.rs@dense-g2-early"] = DEFINES_OF["ffn_fused.rs@dense-early"] + _G2
DEFINES_OF["ffn_fused.rs@g2-timeline"] = _TL + _G2 + DEFINES_OF["ffn_fused.rs"]
DEFINES_OF["ffn_fused.rs@dense-g2-timeline"] = _TL + _G2 + DEFINES_OF["ffn_fused.rs@dense"]
DEFINES_OF["ffn_fused.rs@dense-g2-early-timeline"] = _TL + DEFINES_OF["ffn_fused.rs@dense-early"] + _G2
DEFINES_OF["ffn_fused.rs@g2-early-timeline"] = _TL + DEFINES_OF["ffn_fused.rs@early"] + _G2
# The two-outputs form in rounds (MLX_LFM_FFN_GATE_ROUNDS: ffn_fused.rs
# rounds), dense, plain and the bench's timeline form; its w2 walk
# (stages.rs ROUNDS_HEADER) after the header (HEADER_AFTER, below).
_G2R = _G2 + "#define LFM_GATE_ROUNDS 2\n"
DEFINES_OF["ffn_fused.rs@dense-r4"] = "#define LFM_GATE_OUTS 4\n#define LFM_GATE_ROUNDS 4\n" + DEFINES_OF["ffn_fused.rs@dense"]
DEFINES_OF["ffn_fused.rs@dense-g2r"] = _G2R + DEFINES_OF["ffn_fused.rs@dense"]
DEFINES_OF["ffn_fused.rs@dense-g2r-timeline"] = _TL + _G2R + DEFINES_OF["ffn_fused.rs@dense"]
DEFINES_OF["ffn_fused.rs@dense-g2r-early"] = DEFINES_OF["ffn_fused.rs@dense-early"] + _G2R
# A variant's text before its kernel's body, as its Rust side puts it there.
PRELUDE_OF = {"moe_fused.rs@scratch": named(root / "src" / "kernels" / "moe_fused.rs", "SCRATCH_PRELUDE")}
PRELUDE_OF["moe_fused.rs@exact-scratch"] = PRELUDE_OF["moe_fused.rs@scratch"]
# A variant's text after its kernel's header, as its Rust side puts it
# there (the exact forms' row products: moe_fused.rs Form::header).
HEADER_AFTER = {}
for _v in ("@exact", "@exact8", "@exact-scratch", "@exact-d1536", "@exact8-d1536"):
    DEFINES_OF["moe_fused.rs" + _v] = named(root / "src" / "kernels" / "moe_fused.rs", "EXACT_DEFINES") + LAYER_MOE
    HEADER_AFTER["moe_fused.rs" + _v] = named(_STAGES, "QUANT_PRODUCTS")
assert "LFM_MOE_EXACT" in DEFINES_OF["moe_fused.rs@exact"], "moe_fused.rs EXACT_DEFINES"
for _v in ("@dense-g2r", "@dense-g2r-timeline", "@dense-g2r-early", "@dense-r4"):
    HEADER_AFTER["ffn_fused.rs" + _v] = named(_STAGES, "ROUNDS_HEADER")
PRELUDE_OF["moe_fused.rs@pf-scratch"] = PRELUDE_OF["moe_fused.rs@scratch"]
PRELUDE_OF["moe_fused.rs@exact-pf-scratch"] = PRELUDE_OF["moe_fused.rs@scratch"]
_PF = named(_STAGES, "PREFETCH_HEADER") + named(_STAGES, "MOE_DOWN_PREFETCH_HEADER")
assert "lfm_moe_down_prefetch" in _PF and "lfm_prefetch_block" in _PF, "stages.rs MOE_DOWN_PREFETCH_HEADER"
for _v, _at in (("@pf", 1), ("@pfa", 2), ("@pf-scratch", 1), ("@pf-d1536", 1)):
    DEFINES_OF["moe_fused.rs" + _v] = f"#define LFM_MOE_DOWN_PREFETCH {_at}\n" + LAYER_MOE
    HEADER_AFTER["moe_fused.rs" + _v] = _PF
for _v, _at, _of in (("@exact-pf", 1, "@exact"), ("@exact-pfa", 2, "@exact"), ("@exact-pf-scratch", 1, "@exact"),
                     ("@exact8-pf-d1536", 1, "@exact8-d1536")):
    DEFINES_OF["moe_fused.rs" + _v] = f"#define LFM_MOE_DOWN_PREFETCH {_at}\n" + DEFINES_OF["moe_fused.rs" + _of]
    HEADER_AFTER["moe_fused.rs" + _v] = HEADER_AFTER["moe_fused.rs" + _of] + _PF
for _v, _of in _MOE_G2 + _MOE_D2:
    DEFINES_OF["moe_fused.rs" + _v] = (("#define LFM_MOE_GATE_ROWS 2\n" if "g2" in _v else "")
                                       + ("#define LFM_MOE_DOWN_COLS 2\n" if "d2" in _v else "") + DEFINES_OF["moe_fused.rs" + _of])
    if "moe_fused.rs" + _of in HEADER_AFTER:
        HEADER_AFTER["moe_fused.rs" + _v] = HEADER_AFTER["moe_fused.rs" + _of]
    if "moe_fused.rs" + _of in PRELUDE_OF:
        PRELUDE_OF["moe_fused.rs" + _v] = PRELUDE_OF["moe_fused.rs" + _of]
DEFINES_OF["moe_fused.rs@exact-timeline"] = _TL + DEFINES_OF["moe_fused.rs@exact"]
HEADER_AFTER["moe_fused.rs@exact-timeline"] = HEADER_AFTER["moe_fused.rs@exact"]
DEFINES_OF["moe_fused.rs@exact-pf-timeline"] = _TL + DEFINES_OF["moe_fused.rs@exact-pf"]
HEADER_AFTER["moe_fused.rs@exact-pf-timeline"] = HEADER_AFTER["moe_fused.rs@exact-pf"]
DEFINES_OF["moe_fused.rs@exact-g2-timeline"] = _TL + DEFINES_OF["moe_fused.rs@exact-g2"]
HEADER_AFTER["moe_fused.rs@exact-g2-timeline"] = HEADER_AFTER["moe_fused.rs@exact-g2"]
DEFINES_OF["moe_fused.rs@exact-g2-d2-timeline"] = _TL + DEFINES_OF["moe_fused.rs@exact-g2-d2"]
HEADER_AFTER["moe_fused.rs@exact-g2-d2-timeline"] = HEADER_AFTER["moe_fused.rs@exact-g2-d2"]
# The other one-launch layers with their scratch rows in the state
# (MLX_LFM_SCRATCH_IN_STATE): outputs without the rows, their places (bf16,
# 2,048 wide: stages.rs scratch_places) as template values.
for key, rust, kept, places in [
        ("conv_fused.rs", "conv_fused.rs", 3, [("SCR_YN", 256), ("SCR_YC", 4352)]),
        ("conv_fused.rs@dense", "conv_fused.rs", 3, [("SCR_YN", 256), ("SCR_YC", 4352)]),
        ("ffn_fused.rs", "ffn_fused.rs", 2, [("SCR_YN", 256), ("SCR_HK", 4352)]),
        ("ffn_fused.rs@dense", "ffn_fused.rs", 2, [("SCR_YN", 256), ("SCR_HK", 4352)]),
        ("ffn_fused.rs@g2", "ffn_fused.rs", 2, [("SCR_YN", 256), ("SCR_HK", 4352)]),
        ("ffn_fused.rs@dense-g2", "ffn_fused.rs", 2, [("SCR_YN", 256), ("SCR_HK", 4352)]),
        ("qk_norm_rope.rs#qkv_fused", "qkv_fused.rs", 4, [("SCR_YN", 256)]),
        ("qk_norm_rope.rs#qkv_fused@dense", "qkv_fused.rs", 4, [("SCR_YN", 256)])]:
    ins, outs, targs, *rest = KERNELS[key]
    name = key + ("-scratch" if "@" in key else "@scratch")
    KERNELS[name] = (ins, outs[:kept], lambda dt, t=targs, p=places: t(dt) + p, *rest)
    DEFINES_OF[name] = DEFINES_OF.get(key, "")
    PRELUDE_OF[name] = named(root / "src" / "kernels" / rust, "SCRATCH_PRELUDE")

# A head's rows over SPLIT blocks (MLX_LFM_QKV_SPLIT: qkv_fused.rs
# SPLIT_SUBSTITUTIONS, then SPLIT_MEET), 2 and 4, 4-bit and dense, with the
# scratch row in the state as a step runs it and without; the dense one
# over 32 warps and early too (SPLIT_EARLY_SUBSTITUTIONS).
_QKV_RS = (root / "src" / "kernels" / "qkv_fused.rs").read_text()
_meet = re.search(r'const SPLIT_MEET: \(&str, &str\) = \(\s*"((?:[^"\\]|\\.)*)",\s*r#"(.*?)"#,', _QKV_RS, re.S)
assert _meet, "qkv_fused.rs SPLIT_MEET"
_SPLIT = substitutions("qkv_fused.rs", "SPLIT_SUBSTITUTIONS") + [(_meet.group(1).replace("\\n", "\n"), _meet.group(2))]
assert len(_SPLIT) == 7, "qkv_fused.rs SPLIT_SUBSTITUTIONS"
for _n, _dense, _scratch, _form in ((2, False, True, ""), (4, False, True, ""), (2, False, False, ""), (2, True, True, ""),
                                    (4, True, True, ""), (2, True, False, "w32"), (2, True, True, "early")):
    _of = "qk_norm_rope.rs#qkv_fused" + ("@dense" if _dense else "") + ("-scratch" if _dense and _scratch else "@scratch" if _scratch else "")
    _v = "qk_norm_rope.rs#qkv_fused@" + ("dense-" if _dense else "") + f"split{_n}" + ("-scratch" if _scratch else "") + (f"-{_form}" if _form else "")
    _ins, _outs, _targs, *_rest = KERNELS[_of]
    _place = 8448  # (scratch_places([2048 * 4, 0])[1]; only compiled here)
    KERNELS[_v] = (_ins, _outs, lambda dt, t=_targs, n=_n, w=32 if _form == "w32" else 16:
                   [(k, w if k == "WARPS" else v) for k, v in t(dt)] + [("SPLIT", n), ("HEAD_ST", _place)], *_rest)
    _def = "qk_norm_rope.rs#qkv_fused" + ("@dense" if _dense else "")
    DEFINES_OF[_v] = DEFINES_OF[_def + ("-early" if _form == "early" else "")]
    if _scratch:
        PRELUDE_OF[_v] = PRELUDE_OF[_of]
    REPLACE_OF[_v] = _SPLIT + (substitutions("qkv_fused.rs", "SPLIT_EARLY_SUBSTITUTIONS") if _form == "early" else [])

# The q/k/v stage writing k's and v's heads into the layer's K/V buffers in
# place (MLX_LFM_KV_IN_PLACE: qkv_fused.rs KV_SUBSTITUTION), 4-bit and
# dense, with the scratch row in the state as a step runs it and without.
_kv = re.search(r'const KV_SUBSTITUTION: \(&str, &str\) = \(\s*r#"(.*?)"#,\s*r#"(.*?)"#,', _QKV_RS, re.S)
assert _kv and "kc_shape" in _kv.group(2), "qkv_fused.rs KV_SUBSTITUTION"
for _dense in (False, True):
    for _scratch in (False, True):
        _of = "qk_norm_rope.rs#qkv_fused" + ("@dense" if _dense else "")
        _v = "qk_norm_rope.rs#qkv_fused@" + ("dense-" if _dense else "") + "kv" + ("-scratch" if _scratch else "")
        _ins, _outs, _targs, *_rest = KERNELS[_of]
        _outs = [o for o in _outs if o[0] not in ("ko", "vo")]
        _t = (lambda dt, t=_targs: t(dt) + [("SCR_YN", 256)]) if _scratch else _targs
        KERNELS[_v] = (_ins + [("kc", "T"), ("vc", "T")], _outs[:2] if _scratch else _outs, _t, *_rest)
        DEFINES_OF[_v] = DEFINES_OF[_of]
        if _scratch:
            PRELUDE_OF[_v] = named(root / "src" / "kernels" / "qkv_fused.rs", "SCRATCH_PRELUDE")
        REPLACE_OF[_v] = [(_kv.group(1), _kv.group(2))]

# Every head's block computing the norm itself (MLX_LFM_QKV_EVERY_NORM:
# qkv_fused.rs EVERY_NORM_SUBSTITUTION), over the one-block form and its
# K/V-writing form, 4-bit and dense, with the scratch row in the state.
_EN = [pair_const("qkv_fused.rs", "EVERY_NORM_SUBSTITUTION")]
assert "lfm_add_rms_row" in _EN[0][1], "qkv_fused.rs EVERY_NORM_SUBSTITUTION"
for _dense in (False, True):
    for _kvf in (False, True):
        _of = "qk_norm_rope.rs#qkv_fused@" + ("dense-" if _dense else "") + "kv-scratch" if _kvf else \
            "qk_norm_rope.rs#qkv_fused" + ("@dense-scratch" if _dense else "@scratch")
        _v = "qk_norm_rope.rs#qkv_fused@" + ("dense-" if _dense else "") + ("kv-" if _kvf else "") + "every-norm"
        KERNELS[_v] = KERNELS[_of]
        DEFINES_OF[_v] = DEFINES_OF.get(_of, "")
        PRELUDE_OF[_v] = PRELUDE_OF[_of]
        REPLACE_OF[_v] = REPLACE_OF.get(_of, []) + _EN

# The conv layer's in_proj blocks and the feed-forward's gate blocks each
# computing the layer's norm (MLX_LFM_CONV_EVERY_NORM, MLX_LFM_FFN_EVERY_NORM:
# stages.rs CONV_EVERY_NORM_SUBSTITUTION, FFN_EVERY_NORM_SUBSTITUTION),
# 4-bit and dense, the feed-forward's also in rounds (the bf16 default's,
# and four) and two gate outputs a warp.
for _of, _sub in (("conv_fused.rs", "CONV"), ("conv_fused.rs@dense", "CONV"), ("ffn_fused.rs", "FFN"),
                  ("ffn_fused.rs@dense", "FFN"), ("ffn_fused.rs@dense-g2r", "FFN"), ("ffn_fused.rs@g2", "FFN"),
                  ("ffn_fused.rs@dense-g2", "FFN"), ("ffn_fused.rs@dense-r4", "FFN")):
    _v = _of + ("-" if "@" in _of else "@") + "every-norm"
    KERNELS[_v] = KERNELS[_of]
    DEFINES_OF[_v] = DEFINES_OF[_of]
    if _of in HEADER_AFTER:
        HEADER_AFTER[_v] = HEADER_AFTER[_of]
    _pair = pair_const("stages.rs", f"{_sub}_EVERY_NORM_SUBSTITUTION")
    assert "lfm_add_rms_row" in _pair[1], f"stages.rs {_sub}_EVERY_NORM_SUBSTITUTION"
    REPLACE_OF[_v] = REPLACE_OF.get(_of, []) + [_pair]

# The q/k/v stage's timeline form (the bench's, one block a head:
# qkv_fused.rs TIMELINE_SUBSTITUTIONS), 4-bit and dense.
for _k in ("qk_norm_rope.rs#qkv_fused", "qk_norm_rope.rs#qkv_fused@dense"):
    _v = _k + ("-timeline" if "@" in _k else "@timeline")
    KERNELS[_v] = (KERNELS[_k][0], KERNELS[_k][1] + [("times", "long long")], *KERNELS[_k][2:])
    DEFINES_OF[_v] = _TL + DEFINES_OF[_k]
    # (Its first two are stages.rs's: qkv_fused.rs names them by index.)
    REPLACE_OF[_v] = substitutions("stages.rs", "TIMELINE_SUBSTITUTIONS")[:2] + substitutions("qkv_fused.rs", "TIMELINE_SUBSTITUTIONS")
    assert len(REPLACE_OF[_v]) == 5, "qkv_fused.rs TIMELINE_SUBSTITUTIONS"

# How many dtype values CudaKernel::new adds (src/mlx/kernel.rs IO_NAMES),
# seven operands each: a kernel with more operands is refused there.
IO_VALUES = int(re.search(r"const IO_NAMES: \[&str; (\d+)\]", (root / "src" / "mlx" / "kernel.rs").read_text()).group(1))

failed = 0
for file, (ins, outs, targs, *only_dtypes) in KERNELS.items():
    if ONLY and file != ONLY:
        continue
    # "file.rs@variant": a body with a variant's substitution (decode
    # attention's position bound).
    file_key, _, variant = file.partition("@")
    VALIDITY = "UPTO_VALID" if variant.startswith("upto") else "MASK_VALID"
    EARLY = variant == "early"
    LOADS = variant == "loads"
    DENSE = variant.startswith("dense")
    # "file.rs#name": the file's NAME_SOURCE (a second kernel in one file).
    fname, _, extra = file_key.partition("#")
    src, hdr = body_and_header(root / "src" / "kernels" / fname, "const " + (extra.upper() + "_" if extra else "") + "SOURCE")
    src = PRELUDE_OF.get(file, "") + src
    hdr = hdr + HEADER_AFTER.get(file, "")
    for was, now in REPLACE_OF.get(file, []):
        assert was in src, f"{file}: {was!r} not in its source"
        src = src.replace(was, now)
    for dt, ct in CTYPE.items():
        if only_dtypes and dt not in only_dtypes[0] or DTYPES and dt not in DTYPES:
            continue
        params = []
        for n, t in ins:
            params.append(f"const {t.replace('T', ct) if t == 'T' else t}* {n}")
            # MLX adds an input's shape, strides and rank arguments, in that
            # order, where the source names them.
            if f"{n}_shape" in src:
                params.append(f"const __grid_constant__ Shape {n}_shape")
            if f"{n}_strides" in src:
                params.append(f"const __grid_constant__ Strides {n}_strides")
            if f"{n}_ndim" in src:
                params.append(f"const __grid_constant__ int {n}_ndim")
        params += [f"{t.replace('T', ct) if t == 'T' else t}* {n}" for n, t in outs]
        consts = "".join(f"  constexpr {'bool' if isinstance(v, str) else 'int'} {k} = {v};\n" for k, v in targs(dt))
        # The operands' dtypes, as CudaKernel adds them (src/mlx/kernel.rs:
        # dtype_args, with_io_reads): packed codes, seven operands a value,
        # each read once at the top of the body.
        io = -(-len(ins + outs) // 7)
        if io > IO_VALUES:
            print(f"{file} T={dt}: FAILED: {len(ins + outs)} operands, CudaKernel takes at most {IO_VALUES * 7}")
            failed += 1
            continue
        consts += "".join(f"  constexpr int LFM_IO{i} = 0;\n" for i in range(io))
        body = "".join(f"(void)LFM_IO{i};" for i in range(io)) + "\n" + src
        code = (DEFINES + DEFINES_OF.get(file, "") + PRELUDE + hdr + "namespace cg = cooperative_groups;\n"
                + f'extern "C" __global__ void k({", ".join(params)}) {{\n{consts}  using T = {ct};\n{body}\n}}\n')
        ptx_to = PTX_DIR / (re.sub(r"[^A-Za-z0-9_.@#-]", "_", f"{file}-{dt}") + ".ptx") if PTX_DIR else None
        rc, log = compile_one(f"{file}-{dt}.cu", code, ptx_to)
        if rc == 0 and FILES:
            tag = re.sub(r"[^A-Za-z0-9_]", "_", f"{file}-{dt}")
            (FILES_DIR / f"{tag}.head.cuh").write_text(hdr)
            (FILES_DIR / f"{tag}.body.cuh").write_text(body)
            reads = [f"{n}{x}" for n, x in shape_params(ins, src)]
            inc_body = (f"// reads {' '.join(reads)}\n" if reads else "") + f'#include "{FILES_DIR}/{tag}.body.cuh"\n'
            inc_hdr = f'#include "{FILES_DIR}/{tag}.head.cuh"\n' if hdr else ""
            if shape_params(ins, inc_body) != shape_params(ins, src):
                print(f"{file} T={dt}: FAILED: from files MLX would pass other shape arguments")
                failed += 1
            files_code = (DEFINES + DEFINES_OF.get(file, "") + PRELUDE + inc_hdr + "namespace cg = cooperative_groups;\n"
                          + f'extern "C" __global__ void k({", ".join(params)}) {{\n{consts}  using T = {ct};\n{inc_body}\n}}\n')
            inline_ptx, files_ptx = ptx_of(f"{file}-{dt}.cu", code), ptx_of(f"{file}-{dt}.cu", files_code)
            if files_ptx is None or files_ptx != inline_ptx:
                print(f"{file} T={dt}: FAILED: from files the PTX differs")
                failed += 1
            else:
                print(f"{file} T={dt}: the same PTX from files")
        status = "ok" if rc == 0 else "FAILED"
        print(f"{file} T={dt}: {status}")
        if rc != 0 or "warning" in log:
            print(log)
        failed += rc != 0
sys.exit(1 if failed else 0)
