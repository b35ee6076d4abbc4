"""Pipeline-parallel models on a Ray cluster: each stage a contiguous range of blocks, in a Ray actor on its node,
running an ordinary local plan prepared once (models/stage.py); per step only hidden states and a few bytes of
metadata cross between stages. Ray is imported on first use (`pip install ggml_py[cluster]`). See docs/cluster.md.
"""

from ggml_py.cluster.pipeline import ClusterError, Pipeline, StageSpec, start_pipeline

__all__ = ["ClusterError", "Pipeline", "StageSpec", "start_pipeline"]
