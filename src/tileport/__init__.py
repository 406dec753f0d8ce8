"""tileport: fast, exactly-specified GPU ops for LLM layers, drop-in for flash-linear-attention.

    import tileport
    o = tileport.fused_attnres(query, residuals, rms_weight)
    o, state = tileport.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)

`tileport explain <op>` says which backend runs a call and why the others refuse it.
"""

from tileport.dispatch import BackendRefused, use_backend
from tileport.ops.attnres import fused_attnres
from tileport.ops.gdn import chunk_gated_delta_rule
from tileport.ops.rms_norm import rms_norm
from tileport.ops.rope import rope
from tileport.ops.softmax import softmax
from tileport.ops.swiglu import swiglu
from tileport.ops.grouped_gemm import grouped_gemm
from tileport.ops.kda import chunk_kda

__version__ = "0.1.0"

__all__ = ["fused_attnres", "chunk_gated_delta_rule", "rms_norm", "rope", "swiglu", "softmax", "grouped_gemm", "chunk_kda", "use_backend", "BackendRefused", "__version__"]
